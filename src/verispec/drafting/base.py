"""The proposer interface: every drafter is one class with `propose` and `update` (plus lifecycle hooks).

A proposer sees the batch through `BatchView` (token sequences, per-row sampling parameters and
generators) and returns a `Proposal`. For losslessness, `Proposal.probs[b, j]` must be exactly the
distribution draft j of row b was sampled from; deterministic drafters (prompt lookup, greedy) return
`probs=None`, i.e. one-hot q.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..sampling import SamplingParams

__all__ = ["BatchView", "Proposal", "Proposer"]


@dataclass
class BatchView:
    """What the engine shares with proposers. Row b's last token seqs[b][-1] is the pending token:
    emitted, not yet in any model's cache."""

    seqs: list[list[int]]  # prompt + generated tokens per row
    params: list[SamplingParams]
    generators: list[torch.Generator]  # per-row random streams (draft sampling draws from them)
    prompt_mask: Tensor | None = None  # [B, V] bool, for repetition penalties
    output_counts: Tensor | None = None  # [B, V] generated-token counts, for penalties
    vocab_size: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))


@dataclass
class Proposal:
    token_ids: Tensor  # [B, k] int64, -1 beyond num_draft[b]
    probs: Tensor | None  # [B, k, V] float: the q each draft was sampled from; None = one-hot drafts
    num_draft: list[int]  # [B] drafts per row, each <= the gamma asked for

    @staticmethod
    def empty(batch: int, device: torch.device) -> Proposal:
        return Proposal(torch.empty((batch, 0), dtype=torch.int64, device=device), None, [0] * batch)


class Proposer:
    """Base class. Subclasses implement propose (and update when they keep state such as a KV cache)."""

    name = "proposer"

    def start(self, view: BatchView, capacity: int) -> None:
        """A new batch begins (prompts in view.seqs); capacity bounds any sequence length."""

    def add(self, view: BatchView, capacity: int) -> None:
        """New rows (only they are in view) join after the current ones (continuous batching)."""

    def propose(self, view: BatchView, gammas: list[int]) -> Proposal:  # pragma: no cover - interface
        raise NotImplementedError

    def update(self, view: BatchView, old_lengths: list[int], num_accepted: list[int],
               num_draft: list[int]) -> None:
        """After verification: row b had old_lengths[b] tokens, num_draft[b] drafts of which
        num_accepted[b] were kept, and view.seqs now holds the committed tokens."""

    def select(self, rows: list[int]) -> None:
        """Only these rows stay in the batch."""
