"""The proposer interface: every drafter is one class with `propose` and `update` (plus lifecycle hooks).

A proposer sees the batch through `BatchView` and returns one `Draft`: a token tree per row (a chain: parents -1, 0,
1, ...). For losslessness, `Draft.probs[b, s]` must be exactly the distribution the children of slot s were drawn
from; deterministic drafters (prompt lookup, greedy, top-k children) return `probs=None`, i.e. one-hot q.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from ..sampling.tree import VERIFY_RULES, chain_parents, tree_ancestors
from .batch import BatchView

__all__ = ["BatchView", "Draft", "Proposer", "Signal", "padded"]


def padded(rows: Sequence[Sequence], width: int | None = None, fill=-1, dtype=torch.int64) -> Tensor:
    """Ragged rows -> [len(rows), width (default: the longest row)], `fill` past each row's end (on the CPU)."""
    width = max((len(r) for r in rows), default=0) if width is None else width
    out = torch.full((len(rows), width), fill, dtype=dtype)
    for b, r in enumerate(rows):
        out[b, : len(r)] = torch.as_tensor(r, dtype=dtype)
    return out


@dataclass(frozen=True)
class Draft:
    """One step's drafts: a token tree per row below its pending token (the root).

    Slot s indexes the distributions: slot 0 is the root, slot n + 1 the position after node n. A chain is the
    tree whose node j hangs below node j - 1 (`chain=True`); it is verified by `verify_chain` (its kernel and its
    uniform order), a tree by `verify_tree` with `rule`.
    """

    token_ids: Tensor  # [B, N] int64: node tokens, -1 beyond num_nodes[b]
    parents: Tensor  # [B, N] int64: -1 = child of the root, else an earlier node; -1 for padding
    probs: Tensor | None  # [B, N + 1, V] float: q each slot's children were drawn from; None: one-hot (chosen)
    num_nodes: list[int]  # [B] nodes per row (the tokens the target checks)
    depth: list[int]  # [B] deepest node per row: the most drafts one step can accept (a chain: its length)
    rule: str = "deterministic"  # how siblings were drawn: "iid", "without_replacement", "deterministic", "mixed"
    chain: bool = True
    sampled: Tensor | None = None  # [B, N] bool, rule "mixed": node drawn from its parent slot's q (else chosen)

    def __post_init__(self):
        if self.rule not in VERIFY_RULES:
            raise ValueError(f"rule must be one of {', '.join(VERIFY_RULES)}, got {self.rule!r}")
        if (self.sampled is None) != (self.rule != "mixed"):
            raise ValueError("a draft says which nodes were sampled (`sampled`) exactly when its rule is 'mixed'")
        if (self.probs is None) != (self.rule == "deterministic"):
            raise ValueError(
                "a draft has probs exactly when its tokens were sampled (rule 'iid' or "
                "'without_replacement'); chosen tokens (rule 'deterministic') have one-hot q"
            )

    @property
    def width(self) -> int:  # N: node slots in the padded tensors
        return self.token_ids.shape[1]

    @staticmethod
    def empty(batch: int, device: torch.device) -> Draft:
        return Draft.chain_of(torch.empty((batch, 0), dtype=torch.int64, device=device), None, [0] * batch)

    @staticmethod
    def chain_of(token_ids: Tensor, probs: Tensor | None, num_draft: list[int]) -> Draft:
        """token_ids [B, k] (-1 beyond num_draft[b]); probs [B, k + 1, V] (row j: q draft j was sampled from; the
        last row, the slot after the last draft, is never read by chain verification and may be left out) or None
        for chosen drafts."""
        parents = chain_parents(*token_ids.shape, token_ids.device)
        rule = "deterministic" if probs is None else "iid"
        return Draft(token_ids, parents, probs, list(num_draft), list(num_draft), rule, chain=True)

    @staticmethod
    def tree_of(
        tokens: list[list[int]],
        parents: list[list[int]],
        probs: Tensor | None,
        rule: str,
        device: torch.device,
        sampled: list[list[bool]] | None = None,
    ) -> Draft:
        """Per-row node tokens and parents (-1: the root) -> a padded tree draft; probs [B, >= N + 1, V] or None
        (rule "mixed": [B, S, V], the first S slots); sampled (rule "mixed"): per row, which nodes were sampled."""
        B, N = len(tokens), max((len(t) for t in tokens), default=0)
        ids, par = padded(tokens, N), padded(parents, N)
        drawn = padded(sampled, N, fill=False, dtype=torch.bool) if rule == "mixed" else None  # [B, N]
        if N == 0 or (drawn is not None and not bool(drawn.any())):  # nothing drafted, or every node chosen
            rule = "deterministic"
        probs = None if rule == "deterministic" or probs is None else probs[:, : N + 1]
        depth = tree_ancestors(par)[1].masked_fill(ids < 0, 0).amax(1).tolist() if N else [0] * B
        sampled = drawn.to(device) if rule == "mixed" else None
        return Draft(ids.to(device), par.to(device), probs, [len(t) for t in tokens], depth, rule, False, sampled)


class Signal(NamedTuple):
    """What a draft source can draft for a row now, read before it drafts (`Proposer.signals`): the draft-length
    controller pools acceptance per (source, bucket) and never drafts deeper than `depth`."""

    bucket: Hashable  # the evidence class, e.g. prompt lookup's (matched n-gram size, agreeing earlier matches)
    depth: int  # the most tokens the source can draft for the row (prompt lookup: its continuation's length)
    # the source's own estimate of the bucket's acceptance by draft position (1, 2, 3+), from past data (an online
    # head's held-out agreement with the target): what the bucket's record is shrunk towards; None: the source's record
    prior: tuple[float, ...] | None = None


ANY_DEPTH = 1 << 30  # a source that drafts as deep as it is asked


class Proposer:
    """Base class. Subclasses implement propose (and update when they keep state such as a KV cache).

    `tree` is the TreeSpec of the trees the proposer drafts, or None when it drafts chains: for chains the engine
    chooses each row's draft length (gamma), for trees the spec's shape does.

    A chain proposer has one or more draft sources (`source_costs`, one entry each; several: a proposer that
    chooses per row between drafters, `SwitchProposer`). Before each step the engine reads `signals` and picks per
    row a source and a length; `view.sources` tells `propose` which source each row drafts from."""

    name = "proposer"
    tree = None
    cost_prior = 0.0  # seconds per drafted token before any is measured, as a share of a target decode step

    @property
    def source_costs(self) -> tuple[float, ...]:
        """Per draft source: its `cost_prior`."""
        return (self.cost_prior,)

    def signals(self, view: BatchView) -> list[tuple[Signal | None, ...]]:
        """Per row, per draft source: what it can draft now (None: nothing). Only the past may decide it (the
        controller's choice must not look at anything drafting samples). Default: one source, any depth, one
        bucket."""
        return [(Signal(None, ANY_DEPTH),)] * len(view.seqs)

    def start(self, view: BatchView, capacity: int) -> None:
        """A new batch begins (prompts in view.seqs); capacity bounds any sequence length."""

    def add(self, view: BatchView, capacity: int) -> None:
        """New rows (only they are in view) join after the current ones (continuous batching)."""

    def propose(self, view: BatchView, caps: list[int]) -> Draft:  # pragma: no cover - interface
        """Draft for every row: at most caps[b] tokens deep (0: nothing for that row)."""
        raise NotImplementedError

    def update(self, view: BatchView, old_lengths: list[int], draft: Draft, paths: list[list[int]]) -> None:
        """After verification: row b had old_lengths[b] tokens, kept the draft nodes paths[b] (root's child first;
        a chain's accepted prefix is [0, 1, ..., a - 1]), and view.seqs now holds the committed tokens."""

    def select(self, rows: list[int]) -> None:
        """Only these rows stay in the batch."""

    def weights_changed(self, model) -> float:
        """`model`'s weights were replaced in place (between batches): rebuild whatever the proposer derived from
        them (e.g. quantized copies). Returns the seconds it took."""
        return 0.0

    def release(self) -> None:
        """No batch runs, and the engine frees its memory (`EngineCore.release`): drop what the proposer holds for a
        batch (a draft's KV cache); the next `start` allocates it again. What it learned stays."""
