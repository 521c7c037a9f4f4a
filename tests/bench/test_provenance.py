"""Every benchmark result records where it came from (`verispec.bench.provenance`): the commit of the verispec
checkout (None outside one, never an error), whether it had uncommitted changes, the UTC date and the command."""

from __future__ import annotations

import datetime
import json
import subprocess
from pathlib import Path

import torch

from verispec.bench import _provenance, command_line, provenance, provenance_line
from verispec.cli import main
from verispec.strict_json import dumps

SRC = Path(_provenance.__file__).resolve().parent


def _head() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, cwd=SRC)
    except OSError:
        return None
    tracked = subprocess.run(["git", "ls-files", "--error-unmatch", "_provenance.py"], capture_output=True, cwd=SRC)
    return out.stdout.strip() if out.returncode == 0 and tracked.returncode == 0 else None


def _is_utc_now(text: str) -> bool:
    when = datetime.datetime.fromisoformat(text)
    now = datetime.datetime.now(datetime.timezone.utc)
    return when.utcoffset() == datetime.timedelta(0) and abs((now - when).total_seconds()) < 600


def _no_constants(name):
    raise AssertionError(f"invalid JSON constant {name}")


def test_provenance_fields():
    p = provenance(["/usr/local/bin/verispec", "bench", "e2e", "--target", "my model.gguf"])
    assert {"commit", "dirty", "date", "command", "verispec", "python", "torch", "threads", "cpu"} <= set(p)
    assert p["cpu"] is None or p["cpu"].endswith(f"({torch.backends.cpu.get_cpu_capability()})")
    assert p["commit"] == _head()  # this checkout's HEAD, or None where the tests run from an installed copy
    assert (p["dirty"] is None) == (p["commit"] is None)
    assert _is_utc_now(p["date"])
    assert p["command"] == "verispec bench e2e --target 'my model.gguf'"
    json.loads(dumps(p), parse_constant=_no_constants)  # strict JSON


def test_no_git_is_no_error(monkeypatch):
    def no_git(*args, **kwargs):
        raise FileNotFoundError("git")

    monkeypatch.setattr(_provenance.subprocess, "run", no_git)
    p = provenance()
    assert p["commit"] is None and p["dirty"] is None and _is_utc_now(p["date"])
    assert provenance_line(p).startswith("commit unknown")


def test_command_line():
    assert command_line(["/x/src/verispec/__main__.py", "bench", "stops"]) == "verispec bench stops"
    assert command_line(["docs/bench/head_step_cost.py", "--target", "T.gguf"]) == (
        "python3 docs/bench/head_step_cost.py --target T.gguf"
    )
    assert command_line([]) is None


def test_provenance_line():
    assert provenance_line({"config": {}}) is None  # a result from before provenance was recorded
    line = provenance_line({"commit": "0123456789abcdef", "dirty": True, "date": "2026-12-03T09:27:10+00:00"})
    assert line == "commit 0123456789ab (with uncommitted changes), 2026-12-03T09:27:10+00:00"
    line = provenance_line({"commit": "0123456789abcdef", "date": "2026-12-03T09:27:10+00:00", "cpu": "X (AVX2)"})
    assert line == "commit 0123456789ab, 2026-12-03T09:27:10+00:00, on X (AVX2)"


def test_bench_kernel_json_carries_provenance(tmp_path, capsys):
    out = tmp_path / "kernel.json"
    assert main(["bench", "kernel", "--shape", "2x3x40", "--repeats", "1", "--no-reference", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["commit"] == _head() and _is_utc_now(result["date"]) and result["command"]
    assert [(r["B"], r["k"], r["V"]) for r in result["rows"]] == [(2, 3, 40)]
    assert "commit " in capsys.readouterr().out
