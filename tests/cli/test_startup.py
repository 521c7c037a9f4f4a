"""Start-up: building the parser and `--help` import no torch (the library loads inside a command's handler), the
constants the parser shows are the library's, and Ctrl-C at any point of start-up exits 130 without a traceback."""

from __future__ import annotations

import dataclasses
import json
import signal
import subprocess
import sys

import pytest

HEAVY = ("torch", "numpy", "transformers", "xgrammar", "llama_cpp", "uvicorn", "fastapi")


def _python(code: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code], text=True, **kwargs)


def test_building_the_parser_and_help_import_no_torch():
    code = f"""
import contextlib, io, json, sys
import verispec.cli
parser = verispec.cli.build_parser()
for argv in (["--help"], ["generate", "--help"], ["serve", "--help"], ["generate", "x", "--temprature", "1"]):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            verispec.cli.main(argv)
        except SystemExit:
            pass
print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))
"""
    proc = _python(code, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = proc.communicate()
    assert proc.returncode == 0, err
    assert json.loads(out) == []


def test_the_parser_constants_are_the_librarys():
    from uvicorn.config import LOG_LEVELS

    from verispec.cli import constants
    from verispec.engine.adaptive import MAX_GAMMA
    from verispec.engine.config import KEYS
    from verispec.engine.core import PREFILL_CHUNK
    from verispec.model import loading
    from verispec.model.fast import RUNNER_KINDS
    from verispec.model.linear import QUANT_MODES
    from verispec.sampling import SamplingParams
    from verispec.serve.access import DEFAULT_MAX_REQUEST_BYTES
    from verispec.serve.transport import DEFAULT_BODY_TIMEOUT_S, DEFAULT_READ_TIMEOUT_S

    assert constants.MAX_GAMMA == MAX_GAMMA and constants.RUNNER_KINDS == RUNNER_KINDS
    assert constants.QUANT_MODES == QUANT_MODES and set(constants.DTYPES) == set(loading._DTYPES)
    sampling = {f.name: getattr(SamplingParams(), f.name) for f in dataclasses.fields(SamplingParams)}
    assert {k: sampling[k] for k in constants.SAMPLING_DEFAULTS} == constants.SAMPLING_DEFAULTS
    assert constants.PREFILL_CHUNK == PREFILL_CHUNK and constants.DEFAULT_MAX_REQUEST_BYTES == DEFAULT_MAX_REQUEST_BYTES
    assert (constants.DEFAULT_READ_TIMEOUT_S, constants.DEFAULT_BODY_TIMEOUT_S) == (
        DEFAULT_READ_TIMEOUT_S,
        DEFAULT_BODY_TIMEOUT_S,
    )
    assert tuple(LOG_LEVELS) == constants.LOG_LEVELS and "stop_below" in KEYS and "max_gamma" in KEYS


def test_every_command_completes_its_options():
    """Each command's options are added when its parser is first used: all of them, once."""
    import argparse

    from verispec.cli import build_parser

    def leaves(parser):
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs:
            return [parser]
        return [leaf for sub in subs[0].choices.values() for leaf in leaves(sub)]

    all_leaves = leaves(build_parser())
    assert len(all_leaves) == 17
    for leaf in all_leaves:
        text = leaf.format_help()
        assert leaf.prog.startswith("verispec ") and "--" in text and "-h, --help" in text
        assert text == leaf.format_help()  # completed once: a second use adds nothing


# Ctrl-C while a module of the command loads (inside main: `import verispec.cli` itself imports none of them). The
# child waits inside that import until the parent, told by its line on stdout, sends SIGINT.
CHILD = """
import importlib.abc, signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)

class Wait(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == {module!r}:
            print("importing", name, flush=True)
            sys.stdin.readline()  # until SIGINT (or the parent closes stdin)
        return None

sys.meta_path.insert(0, Wait())
from verispec.cli import main
print("main", flush=True)
sys.exit(main({argv!r}))
"""


@pytest.mark.parametrize(
    "module,argv",
    [
        ("torch", ["generate", "x", "--max-new-tokens", "1"]),  # the library's first import, checking the options
        ("verispec.certify", ["certify", "generate", "--samples", "20"]),  # a command's options, while parsing
    ],
)
def test_ctrl_c_during_start_up_exits_130_without_a_traceback(module, argv):
    child = _python(
        CHILD.format(module=module, argv=argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        assert child.stdout.readline() == "main\n"  # (not "importing": `import verispec.cli` did not import it)
        assert child.stdout.readline() == f"importing {module}\n"
        child.send_signal(signal.SIGINT)
        _, err = child.communicate()
    finally:
        if child.poll() is None:
            child.kill()
            child.communicate()
    assert child.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
