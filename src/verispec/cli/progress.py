"""Progress on stderr for the commands that work for minutes (`certify generate`, `train-draft`): the library tells
(phase, done, total) through a callback and this renders it. On a terminal a rich bar per phase (done / total, rate,
elapsed, time left); elsewhere (a log file, CI) a plain line when a phase starts, at most one every `PLAIN_EVERY_S`
seconds while it runs, and one when it ends, so a log gets a few lines rather than thousands; nothing with --quiet."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["PLAIN_EVERY_S", "ProgressDisplay", "duration", "plain_line"]

PLAIN_EVERY_S = 30.0


def duration(seconds: float) -> str:
    """`42s`, `3m05s`, `2h07m`: a time left or taken, as a progress line shows it."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


@dataclass
class _Phase:
    started: float  # the clock when the phase's first update came
    done0: int  # what was done then (a resumed run starts past 0)
    unit: str  # what `done` counts
    shown: float | None = None  # the clock at the last plain line
    ended: bool = False  # its last plain line (done == total) is out
    task: object = None  # its rich task


class ProgressDisplay:
    """`with ProgressDisplay(quiet) as show: show.update(phase, done, total, info)`.

    Args:
        quiet: Show nothing.
        unit: What `done` counts ("samples", "steps"), for the figures and the rate (`update` may name another).
        console (rich.console.Console | None): Where to draw (default: stderr); a bar when it is a terminal.
        clock: Seconds, monotonic (the plain lines' rate and spacing).
        every: Seconds between two plain lines of one phase.
    """

    def __init__(
        self,
        quiet: bool = False,
        *,
        unit: str = "samples",
        console=None,
        clock: Callable[[], float] = time.monotonic,
        every: float = PLAIN_EVERY_S,
    ):
        self.quiet, self.unit, self.clock, self.every = quiet, unit, clock, every
        self.console, self.bar = console, None
        self._phases: dict[str, _Phase] = {}

    def __enter__(self) -> ProgressDisplay:
        if self.quiet:
            return self
        if self.console is None:
            from rich.console import Console

            self.console = Console(stderr=True)
        if self.console.is_terminal:
            self.bar = _rich_bar(self.console)
            self.bar.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.__exit__(*exc)

    def update(self, phase: str, done: int, total: int | None, info: str = "", unit: str | None = None) -> None:
        """`done` of `total` (None: unknown) `unit`s in `phase`; `info` is shown after the figures (a loss)."""
        if self.quiet:
            return
        now = self.clock()
        st = self._phases.get(phase)
        if st is None:
            st = self._phases[phase] = _Phase(now, done, unit or self.unit)
            if self.bar is not None:
                st.task = self.bar.add_task(phase, total=total, completed=done, info=info, unit=st.unit)
        if self.bar is not None:
            self.bar.update(st.task, completed=done, total=total, info=info)
            return
        last = total is not None and done >= total
        if st.ended or not (st.shown is None or last or now - st.shown >= self.every):
            return
        st.shown, st.ended = now, last
        line = plain_line(phase, done, total, info, st.unit, now - st.started, done - st.done0)
        print(line, file=self.console.file, flush=True)


def plain_line(phase: str, done: int, total: int | None, info: str, unit: str, elapsed: float, progressed: int) -> str:
    """A plain progress line: `sampling: 120/400 samples (30%), 3.2 samples/s, 37s elapsed, ETA 1m28s; info`
    (`progressed` of `done` in the `elapsed` seconds give the rate)."""
    parts = [f"{phase}: {done}/{total} {unit} ({100 * done / total:.0f}%)" if total else f"{phase}: {done} {unit}"]
    rate = progressed / elapsed if elapsed > 0 else 0.0
    if rate > 0:
        parts.append(f"{rate:.3g} {unit}/s")
    if elapsed > 0:
        parts.append(f"{duration(elapsed)} elapsed")
    if total and done >= total:
        parts.append("done")
    elif total and rate > 0:
        parts.append(f"ETA {duration((total - done) / rate)}")
    return ", ".join(parts) + (f"; {info}" if info else "")


def _rich_bar(console):
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        ProgressColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )
    from rich.text import Text

    class Rate(ProgressColumn):
        def render(self, task) -> Text:
            return Text(f"{task.speed:.3g} {task.fields['unit']}/s" if task.speed else "")

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), Rate(), TimeElapsedColumn())
    columns += (TimeRemainingColumn(), TextColumn("{task.fields[info]}"))
    return Progress(*columns, console=console)
