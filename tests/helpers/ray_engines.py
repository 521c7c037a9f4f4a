"""Engine factories for the Ray tests: module-level and picklable, so replica processes can build them (they
import this module through the PYTHONPATH the test's Ray runtime environment sets)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from verispec.engine.config import SpecConfig
from verispec.model.loading import LoadedModel
from verispec.rollout import RolloutEngine
from verispec.sampling import SamplingParams

from .tiny import loaded, noisy_copy

REFUSED_TOKENS = 13  # generate(max_new_tokens=13) raises ValueError in a FaultyEngine


class FaultyEngine(RolloutEngine):
    """A rollout engine that fails on demand. With `crash_dir` holding a file "armed", the first generate that
    creates "crashed" there (atomically: exactly one, over all replicas and incarnations) computes its rollouts
    and then kills its process before returning them. max_new_tokens=REFUSED_TOKENS raises ValueError."""

    def __init__(self, *args, crash_dir: str | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.crash_dir = crash_dir

    def generate(self, prompts, n=1, params=SamplingParams(), **kwargs):
        if kwargs.get("max_new_tokens") == REFUSED_TOKENS:
            raise ValueError(f"this engine refuses max_new_tokens={REFUSED_TOKENS}")
        outs = super().generate(prompts, n, params, **kwargs)
        if self.crash_dir is not None and (Path(self.crash_dir) / "armed").exists():
            try:
                os.close(os.open(Path(self.crash_dir) / "crashed", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                return outs
            os._exit(1)  # mid-rollout from the driver's view: the shard's results are lost with the process
        return outs


@dataclass(frozen=True)
class TinyEngine:
    """The tiny Llama target (seed 0) with its noisy copy as draft (accepts often), chains of 3, no history: a
    sample does not depend on its batch, so shards reproduce one engine's rollouts."""

    crash_dir: str | None = None
    max_batch_size: int = 16

    def __call__(self) -> FaultyEngine:
        target = loaded(0)
        draft = LoadedModel(noisy_copy(target.model, 0.3), target.tokenizer, "noisy")
        config = SpecConfig(draft="model", gamma=3, stop_below=None, random="stream")
        return FaultyEngine(target, draft, config=config, max_batch_size=self.max_batch_size, crash_dir=self.crash_dir)
