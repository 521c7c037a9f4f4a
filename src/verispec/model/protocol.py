"""The runner protocol: a model computing logits for a batch of rows over a KV cache that can be grown, forked
(`fill` shares a prompt), reordered (`select`) and rolled back (`keep_paths`, `truncate`). `HFRunner`, `FastRunner`
and `LlamaCppRunner` implement it; the engine and the drafters see nothing else of a model."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

__all__ = ["Chunk", "Runner", "Slots", "Staged", "Staging"]

Chunk = Sequence[Sequence[int]]  # per row: a forward's tokens (or, for a tree, their parents)
Slots = Sequence[int]  # per row: one cache slot (where its tree began)


@runtime_checkable
class Runner(Protocol):
    device: torch.device  # where logits come back (verification runs there)
    vocab_size: int  # logits are sliced to this many ids (the vocabulary target and draft share)
    max_positions: int | None  # the model's context, None when it states none

    def start(self, batch: int, capacity: int) -> None:
        """Fresh, empty cache rows: `batch` rows of `capacity` slots."""

    def fill(self, seqs: Sequence[Sequence[int]], capacity: int) -> None:
        """Fresh rows holding seqs[b] (rows with the same prompt share one prefill)."""

    def add_rows(self, seqs: Sequence[Sequence[int]], capacity: int) -> None:
        """Append rows holding seqs[b] to the running batch."""

    @property
    def lengths(self) -> list[int]:
        """[B] committed tokens per row."""

    def truncate(self, lengths: list[int]) -> None:
        """Roll row b back to its first lengths[b] tokens."""

    def select(self, rows: list[int]) -> None:
        """Keep these rows, in this order."""

    def forward(
        self, tokens: Chunk, logits_at: str = "all", parents: Chunk | None = None, tree_start: Slots | None = None
    ) -> Tensor:
        """Append tokens[b] to row b (chains, or token trees by `parents`); float32 logits [B, T, V] ("all") or
        [B, V] ("last"). See `HFRunner.forward`."""

    def keep_paths(self, old_lengths: list[int], paths: Sequence[Sequence[int]]) -> None:
        """After a tree forward: row b keeps the chunk nodes paths[b] (root first) after its prefix."""

    def prefill(self, tokens: Sequence[Sequence[int]], chunk: int = 512) -> None:
        """Feed tokens into the cache without computing logits."""


@runtime_checkable
class Staged(Protocol):
    """A row's prompt being prefilled outside the batch (`Staging.stage`), a chunk at a time."""

    @property
    def remaining(self) -> int:
        """Prompt tokens still to compute."""

    def feed(self, n: int) -> int:
        """Compute the next min(n, remaining) prompt tokens (a runner may compute a few more, to keep its kernels'
        batches those of unchunked prefill); returns how many."""

    def close(self) -> None:
        """Drop the row without joining (its request ended): what it holds is freed."""


@runtime_checkable
class Staging(Protocol):
    """A runner that can prefill a new row outside its running batch (chunked prefill: a long prompt fed one chunk
    per step while the batch decodes)."""

    def stage(self, tokens: Sequence[int], capacity: int) -> Staged:
        """A row holding `tokens` (fed by `Staged.feed`) with room for `capacity` tokens, outside the batch."""

    def join(self, staged: Staged, copies: int = 1, replace: bool = False) -> None:
        """The completely fed row joins after the batch's rows as `copies` rows sharing its prompt's cache entries
        (replace: they become the batch), as rows `add_rows` (`fill`) prefilled."""
