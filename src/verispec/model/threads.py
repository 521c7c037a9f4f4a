"""CPU threads for every model in the process: torch's intra-op threads and llama.cpp's n_threads / n_threads_batch.

A model's threads meet at a barrier after almost every operation (hundreds per token). On a CPU that other
processes keep busy, a thread that loses its core holds the others at the barrier for a scheduler time slice, so
decoding with more threads than idle CPUs runs many times slower than with one (13-26x under 2 busy processes on 2
cores: docs/bench/threads/README.md). The default therefore takes one thread per CPU that other processes leave idle,
measured once per process from a short sample of /proc/stat, never more than the physical cores (torch's and
llama.cpp's own default) and never less than one.

The policy (`choose_threads`) and the hint (`contention_hint`) are pure functions; `read_sample` and
`default_threads` read the system.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = [
    "CpuSample",
    "choose_threads",
    "contention_hint",
    "current_threads",
    "default_threads",
    "others_busy",
    "parse_stat",
    "read_sample",
    "set_threads",
    "threads_hint",
    "usable_cpus",
]

SAMPLE_SECONDS = 0.2  # how long `default_threads` watches /proc/stat
# A CPU counts as idle when other processes keep it busy less than this fraction of the time: a thread that shares
# its core loses far more (every barrier waits for it) than one thread fewer costs.
IDLE_SLACK = 0.2
# The hint fires when other processes took at least this much of the CPUs the run's threads needed.
HINT_MARGIN = 0.5
HINT_MIN_SECONDS = 0.5  # shorter windows are too noisy to judge


@dataclass(frozen=True)
class CpuSample:
    """Cumulative CPU counters at one moment, over the CPUs this process may use."""

    cpus: int  # how many CPUs the counters cover
    busy: float  # seconds those CPUs spent busy (user, nice, system, irq, softirq, steal), all processes together
    total: float  # seconds those CPUs spent busy or idle
    own: float  # this process's CPU seconds (user + system, all its threads)
    wall: float  # time.monotonic()


def choose_threads(cpus: int, others: float, cores: int | None = None) -> int:
    """The default thread count: one per CPU that other processes leave idle, at least 1.

    Args:
        cpus: CPUs this process may use.
        others: how many of them other processes keep busy on average (0 to cpus).
        cores: physical cores among them (None: as many as cpus); more threads than cores do not help.
    """
    idle = cpus - min(max(others, 0.0), cpus)
    return max(1, min(cpus, cores or cpus, math.floor(idle + IDLE_SLACK)))


def contention_hint(threads: int, cpus: int, others: float) -> str | None:
    """A one-line hint when a run's threads had to share their CPUs with other processes, else None.

    Args:
        threads: the threads each model ran.
        cpus: CPUs this process may use.
        others: how many of them other processes kept busy on average during the run (`others_busy`).
    """
    if threads <= 1 or threads <= cpus - others + HINT_MARGIN:
        return None
    better = choose_threads(cpus, others)
    return (
        f"hint: other processes kept {others:.1f} of {cpus} CPUs busy while each model ran {threads} threads; "
        f"threads that share CPUs wait on each other and run many times slower: try --threads {better}"
    )


def others_busy(start: CpuSample, end: CpuSample) -> float:
    """How many CPUs other processes kept busy on average between two samples (this process's time taken out)."""
    total = end.total - start.total
    if total <= 0 or end.cpus != start.cpus:
        return 0.0
    busy = (end.busy - start.busy) - (end.own - start.own)
    return min(max(busy / total * end.cpus, 0.0), float(end.cpus))


def usable_cpus() -> int:
    """CPUs this process may use: its affinity mask, capped by a cgroup v2 CPU quota (cpu.max) where set."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            cpus = min(cpus, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return cpus


def _physical_cores() -> int | None:
    """Physical cores among the CPUs this process may use (None where the topology is not readable)."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    try:
        sets = {
            Path(f"/sys/devices/system/cpu/cpu{c}/topology/thread_siblings_list").read_text().strip()
            for c in os.sched_getaffinity(0)
        }
    except OSError:
        return None
    return len(sets) or None


def read_sample() -> CpuSample | None:
    """The CPU counters now (None where /proc/stat cannot be read, e.g. not on Linux)."""
    allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    try:
        text = Path("/proc/stat").read_text()
    except OSError:
        return None
    counters = parse_stat(text, allowed)
    if counters is None:
        return None
    tick, times = os.sysconf("SC_CLK_TCK"), os.times()
    cpus, busy, total = counters
    return CpuSample(cpus, busy / tick, total / tick, times.user + times.system, time.monotonic())


def parse_stat(text: str, allowed: set[int] | None = None) -> tuple[int, int, int] | None:
    """(CPUs, busy ticks, total ticks) summed over the per-CPU lines of /proc/stat whose CPU is in `allowed` (None:
    all); busy is user, nice, system, irq, softirq and steal (time the hypervisor gave to others); None if no line
    matches."""
    cpus = busy = total = 0
    for line in text.splitlines():
        name, *fields = line.split() or [""]
        cpu = int(name[3:]) if name.startswith("cpu") and name[3:].isdigit() else None
        if cpu is None or (allowed is not None and cpu not in allowed):
            continue
        user, nice, system, idle, iowait, irq, softirq, steal = (int(f) for f in (fields + ["0"] * 8)[:8])
        busy += user + nice + system + irq + softirq + steal
        total += user + nice + system + idle + iowait + irq + softirq + steal
        cpus += 1
    return (cpus, busy, total) if cpus else None


def _env_threads() -> int | None:
    """OMP_NUM_THREADS where set to a positive integer (torch reads it too): the user's explicit choice."""
    try:
        n = int(os.environ.get("OMP_NUM_THREADS", "").split(",")[0])
    except ValueError:
        return None
    return n if n >= 1 else None


def default_threads(seconds: float = SAMPLE_SECONDS) -> int:
    """The default thread count now: OMP_NUM_THREADS where set, else `choose_threads` on the usable CPUs and the
    load other processes put on them over a `seconds`-long sample of /proc/stat."""
    env = _env_threads()
    if env is not None:
        return env
    start = read_sample()
    time.sleep(seconds)
    end = read_sample()
    others = others_busy(start, end) if start and end else 0.0
    return choose_threads(usable_cpus(), others, _physical_cores())


_TORCH_AT_IMPORT = torch.get_num_threads()  # torch's own choice, unless the caller set it before importing us
_state: dict = {"threads": None, "since": None}  # the count set last, and the CPU counters then


def set_threads(threads: int | None = None) -> int:
    """Set the CPU threads of every model in the process: torch's intra-op threads now, and llama.cpp's
    n_threads / n_threads_batch for models loaded from now on.

    None keeps a count chosen before (by `set_threads`, or by the caller's own `torch.set_num_threads`), else takes
    `default_threads` (sampled once per process). A caller's `torch.set_num_threads` to torch's own default count
    cannot be told from no choice at all: pass the count (`load_model(threads=...)`, `set_threads(n)`) to fix it.
    Returns the count."""
    if threads is None:
        threads = _chosen()
    elif threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    torch.set_num_threads(threads)
    _state.update(threads=threads, since=read_sample())
    return threads


def _chosen() -> int:
    now = torch.get_num_threads()
    if now != (_state["threads"] or _TORCH_AT_IMPORT):
        return now  # the caller set torch's count since
    return _state["threads"] or default_threads()


def current_threads() -> int:
    """The count `set_threads` set, else torch's current intra-op threads."""
    return _state["threads"] or torch.get_num_threads()


def threads_hint(since: CpuSample | None = None) -> str | None:
    """After a run: `contention_hint` for the load other processes put on the CPUs since `since` (None: since the
    threads were last set, i.e. the model load). None when there is nothing to say or nothing to measure."""
    start, end = since or _state["since"], read_sample()
    if start is None or end is None or end.wall - start.wall < HINT_MIN_SECONDS:
        return None
    return contention_hint(current_threads(), end.cpus, others_busy(start, end))
