"""Run the `verispec` command in the test process or as a process of its own.

A `python -m verispec.cli` process costs seconds on a busy 2-core machine (it imports torch and transformers); the
command's behaviour (exit status, one-line errors, what it prints) is the same from `main` in the test process. So a
test of a CLI behaviour runs in the test process in the default tier and as a process in the slow tier, and a few
default-tier tests keep a real process (the entry point, `sys.exit(main())`, and the interpreter's own output).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from verispec.cli import main

# The two ways to run a command, as a parametrization: `@pytest.mark.parametrize("process", PROCESS)`.
PROCESS = [
    pytest.param(False, id="in-process"),
    pytest.param(True, marks=(pytest.mark.slow, pytest.mark.integration), id="process"),
]


def run_verispec(argv, capsys=None, process: bool = False) -> subprocess.CompletedProcess:
    """`verispec *argv`: its exit status, stdout and stderr. As a process when `process` (then capsys is unused);
    otherwise `main(argv)` in this process, its output read from capsys (argparse's exits count as statuses)."""
    argv = [str(a) for a in argv]
    if process:
        return subprocess.run([sys.executable, "-m", "verispec.cli", *argv], capture_output=True, text=True)
    assert capsys is not None, "in-process runs read the output from capsys"
    capsys.readouterr()  # what the test printed before belongs to no command
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(argv, code, out, err)
