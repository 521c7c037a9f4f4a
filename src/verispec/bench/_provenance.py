"""Where a benchmark result came from: the one helper every result writer uses (`verispec bench *` and the scripts
in docs/bench), so that a result file says which code measured it, when, and how."""

from __future__ import annotations

import datetime
import platform
import shlex
import subprocess
import sys
from pathlib import Path

__all__ = ["command_line", "git_commit", "provenance", "provenance_line", "provenance_lines"]

_HERE = Path(__file__).resolve().parent


def _git(*args: str, cwd: Path = _HERE) -> str | None:
    """git's stdout (stripped), or None if git is missing, fails or takes over 10 s."""
    try:
        out = subprocess.run(["git", *args], capture_output=True, text=True, timeout=10, cwd=cwd)
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def git_commit() -> tuple[str | None, bool | None]:
    """(HEAD, dirty) of the git checkout verispec is imported from, or (None, None) when this file is not tracked in
    one (an installed package; also a virtual environment inside some other project's repository)."""
    tracked = _git("ls-files", "--error-unmatch", "--", Path(__file__).name) is not None
    commit = _git("rev-parse", "HEAD") if tracked else None
    if not commit:
        return None, None
    status = _git("status", "--porcelain", "--untracked-files=no")  # a result folder being written does not count
    return commit, None if status is None else bool(status)


def command_line(argv: list[str] | None = None) -> str | None:
    """The command line as it would be typed: `verispec ...` for the console script and `python -m verispec`,
    `python3 SCRIPT.py ...` for a script."""
    argv = list(sys.argv if argv is None else argv)
    if not argv or not argv[0]:
        return None
    if argv[0] == "-c":  # python -c CODE: the code itself is not in sys.argv
        return shlex.join(["python3", "-c", "...", *argv[1:]])
    head = Path(argv[0])
    if head.name == "verispec" or (head.name == "__main__.py" and "verispec" in head.parts):
        program = ["verispec"]
    else:
        program = ["python3", argv[0]] if head.suffix == ".py" else [head.name]
    return shlex.join(program + argv[1:])


def _cpu(capability: str | None) -> str | None:
    """'Intel(R) Xeon(R) ... (AVX2)': /proc/cpuinfo's model name (or the platform's processor) and torch's CPU
    capability; None where neither is known."""
    name = None
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        name = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), None)
    except OSError:
        pass
    name = name or platform.processor() or None
    return f"{name} ({capability})" if name and capability else name or capability


def _torch() -> tuple[str | None, int | None, str | None]:
    """torch's version, intra-op threads and CPU capability ("AVX2"), None where unknown."""
    try:
        import torch
    except ImportError:
        return None, None, None
    try:
        capability = torch.backends.cpu.get_cpu_capability()
    except (AttributeError, RuntimeError):
        capability = None
    return torch.__version__, torch.get_num_threads(), capability


def provenance(argv: list[str] | None = None) -> dict:
    """The top level of a result: `commit` (git HEAD of the checkout verispec is imported from; None outside one),
    `dirty` (uncommitted changes to tracked files), `date` (UTC, ISO 8601), `command` (argv as typed; default
    sys.argv), `verispec`, `python`, `torch`, `threads` and `cpu` ("model name (AVX2)"). Never raises: None where
    a piece is missing."""
    from .. import __version__

    commit, dirty = git_commit()
    torch_version, threads, capability = _torch()
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    env = dict(python=platform.python_version(), torch=torch_version, threads=threads, cpu=_cpu(capability))
    return dict(commit=commit, dirty=dirty, date=date, command=command_line(argv), verispec=__version__) | env


def provenance_line(result: dict) -> str | None:
    """'commit 0123456789ab (dirty), 2026-12-03T09:27:10+00:00, on CPU (AVX2): `verispec bench ...`' from a result's
    fields; None when it has none (a result written before they were recorded)."""
    if "date" not in result and "commit" not in result:
        return None
    commit = result.get("commit")
    text = f"commit {commit[:12]}" if commit else "commit unknown (not a git checkout)"
    text += " (with uncommitted changes)" if result.get("dirty") else ""
    text += f" ({result['provenance']})" if result.get("provenance") else ""
    text += f", {result.get('date') or 'date unknown'}"
    text += f", on {result['cpu']}" if result.get("cpu") else ""
    return text + (f": `{result['command']}`" if result.get("command") else "")


def provenance_lines(result: dict) -> list[str]:
    """The head of a markdown report: [provenance_line, ""], or [] for a result without provenance."""
    line = provenance_line(result)
    return [line, ""] if line else []
