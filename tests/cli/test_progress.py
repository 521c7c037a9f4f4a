"""Progress on stderr (cli/progress.py) as a log file or CI sees it: a line when a phase starts, at most one per
interval while it runs, one when it ends, with the rate and the time left; nothing with --quiet; a rich bar on a
terminal. train-draft's training line (cli/train_draft.py). On an injected clock: no wall-clock waits."""

from __future__ import annotations

import io

from rich.console import Console

from verispec.cli.progress import ProgressDisplay, duration
from verispec.cli.train_draft import TrainProgress
from verispec.training.heads import TrainConfig


def plain(clock, **kw) -> tuple[ProgressDisplay, io.StringIO]:
    out = io.StringIO()
    return ProgressDisplay(console=Console(file=out, force_terminal=False), clock=lambda: clock[0], **kw), out


def test_a_log_gets_a_few_lines_with_rate_and_eta():
    clock = [0.0]
    display, out = plain(clock, every=30)
    with display:
        for done in range(0, 401):  # 400 samples at 2 per second: 200 s, 401 updates
            clock[0] = done / 2
            display.update("sampling", done, 400)
    lines = out.getvalue().splitlines()
    assert lines[0] == "sampling: 0/400 samples (0%)"
    assert lines[1] == "sampling: 60/400 samples (15%), 2 samples/s, 30s elapsed, ETA 2m50s"
    assert len(lines) == 8  # the start, one per 30 s (30 ... 180), the end
    assert lines[-1] == "sampling: 400/400 samples (100%), 2 samples/s, 3m20s elapsed, done"


def test_each_phase_has_its_own_lines_and_quiet_has_none():
    clock = [0.0]
    display, out = plain(clock)
    with display:
        display.update("sampling", 0, 2)
        display.update("sampling", 2, 2)
        display.update("sampling", 2, 2)  # the end once
        display.update("training", 1, None, "loss 2.000", unit="steps")
    assert out.getvalue().splitlines() == [
        "sampling: 0/2 samples (0%)",
        "sampling: 2/2 samples (100%), done",
        "training: 1 steps; loss 2.000",
    ]
    quiet, out = plain(clock, quiet=True)
    with quiet:
        quiet.update("sampling", 0, 2)
        quiet.update("sampling", 2, 2)
    assert out.getvalue() == ""


def test_a_terminal_gets_a_bar():
    out = io.StringIO()
    with ProgressDisplay(console=Console(file=out, force_terminal=True, width=120)) as display:
        assert display.bar is not None
        display.update("scoring", 5, 10)
    assert "scoring" in out.getvalue() and "5/10" in out.getvalue()


def test_durations():
    assert [duration(s) for s in (0, 42.4, 185, 7620)] == ["0s", "42s", "3m05s", "2h07m"]


def test_train_draft_shows_loss_epoch_tokens_per_second_and_budget():
    clock = [0.0]
    display, out = plain(clock, every=0)
    shown = TrainProgress(display, TrainConfig(minutes=10, max_steps=100))
    with display:
        shown.training(0, {"phase": "features", "done": 4, "total": 8})
        for step in (1, 2, 3):
            clock[0] = step
            info = {"loss": 3.0 / step, "top1": [0.5, 0.25], "seconds": 2.0 * step, "tokens": 100, "epoch": step / 4}
            shown.training(step, info)
    lines = out.getvalue().splitlines()
    assert lines[0] == "target features: 4/8 sequences (50%)"
    assert lines[1].startswith("training: 1/100 steps (1%); loss 3.000, top1 0.50/0.25, epoch 0.25")
    # steps 2 and 3 read 200 tokens in the 4 training seconds after step 1
    assert lines[-1] == (
        "training: 3/100 steps (3%), 1 steps/s, 2s elapsed, ETA 1m37s; loss 1.000, top1 0.50/0.25, epoch 0.75, "
        "50 tokens/s, time budget left 9m54s"
    )
