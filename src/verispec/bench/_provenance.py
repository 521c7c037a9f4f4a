"""Where a benchmark result came from: the one helper every result writer uses (`verispec bench *` and the scripts
in docs/bench), so that a result file says which code measured it, when, and with which command.

`provenance()` returns a dict to merge into the top level of a result:

    commit    git rev-parse HEAD of the checkout verispec is imported from; None outside a git checkout (an
              installed wheel), or where git is missing or fails
    dirty     whether that checkout had uncommitted changes to tracked files (`git status --porcelain
              --untracked-files=no` not empty: a result folder being written does not count); None without a commit
    date      when the result was made, UTC, ISO 8601 to the second (2026-12-03T09:27:10+00:00)
    command   the command line, as it would be typed (`verispec bench e2e ...`, `python3 docs/bench/x.py ...`)
    verispec  the package version
    python, torch, threads    the interpreter, torch's version and its intra-op threads in this process
    cpu       the CPU's model name and the instruction set torch's CPU kernels use here ("... (AVX2)"): torch's
              weight-only int4/int8 kernels, bfloat16 and oneDNN differ by it several-fold

It never raises: a missing piece is None. `provenance_line(result)` is the same information as one line of a
markdown report. Both are exported by `verispec.bench`."""

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
    if _git("ls-files", "--error-unmatch", "--", Path(__file__).name) is None:
        return None, None
    commit = _git("rev-parse", "HEAD") or None
    if commit is None:
        return None, None
    status = _git("status", "--porcelain", "--untracked-files=no")
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
    elif head.suffix == ".py":
        program = ["python3", argv[0]]
    else:
        program = [head.name]
    return shlex.join(program + argv[1:])


def _cpu(capability: str | None) -> str | None:
    """'Intel(R) Xeon(R) ... (AVX2)': /proc/cpuinfo's model name (or the platform's processor) and torch's CPU
    capability; None where neither is known."""
    name = None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    name = name or platform.processor() or None
    if name and capability:
        return f"{name} ({capability})"
    return name or capability


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
    """commit, dirty, date, command and the environment (see the module docstring), for the top level of a result.
    argv: the command line to record (default sys.argv)."""
    from .. import __version__

    commit, dirty = git_commit()
    torch_version, threads, capability = _torch()
    return {
        "commit": commit,
        "dirty": dirty,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command_line(argv),
        "verispec": __version__,
        "python": platform.python_version(),
        "torch": torch_version,
        "threads": threads,
        "cpu": _cpu(capability),
    }


def provenance_line(result: dict) -> str | None:
    """'commit 0123456789ab (dirty), 2026-12-03T09:27:10+00:00, on CPU (AVX2): `verispec bench ...`' from a result's
    fields; None when it has none (a result written before they were recorded)."""
    if "date" not in result and "commit" not in result:
        return None
    commit = result.get("commit")
    text = f"commit {commit[:12]}" if commit else "commit unknown (not a git checkout)"
    if result.get("dirty"):
        text += " (with uncommitted changes)"
    if result.get("provenance"):
        text += f" ({result['provenance']})"
    text += f", {result.get('date') or 'date unknown'}"
    if result.get("cpu"):
        text += f", on {result['cpu']}"
    if result.get("command"):
        text += f": `{result['command']}`"
    return text


def provenance_lines(result: dict) -> list[str]:
    """The head of a markdown report: [provenance_line, ""], or [] for a result without provenance."""
    line = provenance_line(result)
    return [line, ""] if line else []
