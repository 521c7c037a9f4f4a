"""The served online head (`verispec serve --spec draft=online`; docs/guides/serving.md, "An online head"): it learns
from the traffic inline, within `online_budget`, as in any engine; here it also trains while no request runs (one
step at a time on the engine thread, so a request that arrives waits at most one step), and `--online-dir` keeps it.

The directory holds the published head (SafeAILab / SpecForge layout: `--draft DIR`, vLLM, SGLang) and its training
state (`online_state.pt`); a server started with it continues from it (`online_config`: `model=DIR`). A save writes
a complete copy beside it and swaps the two by renames, so a crash leaves the old head or the new one, never half of
one: `.NAME.tmp` (being written) and `.NAME.old` (the one replaced) are siblings of DIR, and `recover` puts the old
one back when a crash came between the two renames.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from .limits import ONLINE_SAVE_INTERVAL_S as SAVE_INTERVAL_S

if TYPE_CHECKING:
    from ..engine.config import SpecConfig

__all__ = ["IDLE_PASSES", "SAVE_INTERVAL_S", "OnlineKeeper", "check_online_dir", "online_config", "saved_head"]

log = logging.getLogger("verispec.serve")

IDLE_PASSES = 2  # idle training stops once its steps have read this many tokens per generated token recorded


SAVED = frozenset({"config.json", "model.safetensors", "online_state.pt"})  # what a save writes (and all it writes)


def saved_head(folder: str | os.PathLike) -> bool:
    """Whether `folder` holds what an online head's save writes, and nothing else (a train-draft run's directory,
    with its data and checkpoints, is not one: a save would replace it whole)."""
    folder = Path(folder)
    return folder.is_dir() and {p.name for p in folder.iterdir()} == SAVED


def _siblings(folder: Path) -> tuple[Path, Path]:
    """(the copy being written, the one replaced)."""
    return folder.with_name(f".{folder.name}.tmp"), folder.with_name(f".{folder.name}.old")


def recover(folder: Path) -> None:
    """Undo what a crash mid-save left: the replaced head back where it was missing, leftovers removed."""
    tmp, old = _siblings(folder)
    if not folder.exists() and saved_head(old):
        old.rename(folder)
    for path in (tmp, old):
        shutil.rmtree(path, ignore_errors=True)


def check_online_dir(folder: str | os.PathLike) -> Path:
    """The directory, crash leftovers recovered; ValueError when it is no directory, or one holding other files
    than a saved head (a save replaces it whole)."""
    folder = Path(folder).expanduser().resolve()
    recover(folder)
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"--online-dir {folder}: not a directory")
    if folder.is_dir() and any(folder.iterdir()) and not saved_head(folder):
        raise ValueError(
            f"--online-dir {folder} holds other files than an online head's save (config.json, model.safetensors, "
            "online_state.pt): each save replaces the directory whole, so give an empty or new directory, or one an "
            "earlier --online-dir wrote (to start from another head, pass it as --spec model=DIR)"
        )
    return folder


def online_config(config: SpecConfig, folder: str | os.PathLike) -> SpecConfig:
    """draft=online starting from `folder`'s saved head and training state when it holds one (`model=DIR`), else as
    configured; ValueError for another drafter, or a directory `check_online_dir` refuses."""
    if not config.drafter.online:
        raise ValueError(f"--online-dir keeps an online head: give --spec draft=online (not draft={config.draft})")
    folder = check_online_dir(folder)
    return replace(config, model=str(folder)) if saved_head(folder) else config


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class OnlineKeeper:
    """The server's online head, on its engine thread: idle training (`idle_work`, `idle_step`) and saves (`due`,
    `save`). A failure here is logged and never fails a request (idle training stops; a save is retried later).

    Args:
        learner: The generator's `OnlineLearner`.
        folder: --online-dir (None: nothing saved).
        target_layers: The target's layer count (the saved config's default aux layers).
        save_interval: Seconds between two saves at least.
    """

    def __init__(self, learner, folder: str | os.PathLike | None, target_layers: int, save_interval=SAVE_INTERVAL_S):
        self.learner, self.target_layers, self.save_interval = learner, target_layers, save_interval
        self.folder = None if folder is None else check_online_dir(folder)
        if self.folder is not None and saved_head(self.folder) and learner.version == 0:
            raise ValueError(
                f"--online-dir {self.folder} holds a saved head this generator did not start from: build it with "
                "draft=online,model=DIR (serve.online.online_config)"
            )
        started = self.folder is not None and saved_head(self.folder)  # the learner's version is the one saved there
        self.saved, self._saved_at = learner.version if started else 0, time.monotonic()
        self.idle_steps, self._seen = 0, learner.buffer.generated
        self.idle_failed = False

    def idle_work(self) -> bool:
        """Whether to train while nothing runs: a head to train (or data for one), and idle steps so far that read
        fewer than IDLE_PASSES tokens per generated token recorded since start (an idle server stops training)."""
        lr = self.learner
        if self.idle_failed or not lr.ready():
            return False
        return self.idle_steps * lr.settings.inline_tokens < IDLE_PASSES * (lr.buffer.generated - self._seen)

    def idle_step(self) -> None:
        """One small training step (`OnlineLearner.train_idle`), published every few and at the last."""
        self.idle_steps += 1
        try:
            self.learner.train_idle(publish=not self.idle_work())
        except Exception:
            log.exception("training the online head while idle failed; idle training stops")
            self.idle_failed = True

    def due(self) -> float | None:
        """Seconds until a save is due (0: now), None when the directory holds the newest version (or there is none)."""
        if self.folder is None or self.learner.version <= self.saved:
            return None
        return max(0.0, self._saved_at + self.save_interval - time.monotonic())

    def save(self, now: bool = False) -> None:
        """Write the newest version when one is due (`now`: whenever it is newer), atomically (module docstring)."""
        due = self.due()
        if due is None or (due > 0 and not now):
            return
        try:
            self._write()
        except Exception:
            log.exception("saving the online head to %s failed (retried in %gs)", self.folder, self.save_interval)
        self._saved_at = time.monotonic()

    def _write(self) -> None:
        folder, version = self.folder, self.learner.version
        tmp, old = _siblings(folder)
        shutil.rmtree(tmp, ignore_errors=True)
        self.learner.save(tmp, self.target_layers)
        for f in tmp.iterdir():
            _fsync(f)
        shutil.rmtree(old, ignore_errors=True)
        if folder.exists():
            folder.rename(old)
        tmp.rename(folder)
        _fsync(folder.parent)
        shutil.rmtree(old, ignore_errors=True)
        self.saved = version
        log.info("online head version %d saved to %s", version, folder)
