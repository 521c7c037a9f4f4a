"""The config fields every model benchmark shares: those `verispec.cli.options.add_bench_model_args` gives."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ModelBenchConfig", "SelfDraftBenchConfig"]


@dataclass(frozen=True)
class ModelBenchConfig:
    seed: int = 0
    chat: bool = True  # prompts through the tokenizer's chat template
    runner: str = "auto"  # verispec's model forward (see verispec.model.fast.make_runner)
    draft_quant: str | None = None  # of the draft model


@dataclass(frozen=True)
class SelfDraftBenchConfig(ModelBenchConfig):
    """A benchmark with a self-draft method (the target's own weights quantized)."""

    self_quant: str = "int4"  # of the self-draft
