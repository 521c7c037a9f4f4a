"""Several chain drafters, one per row and step: e.g. prompt lookup where it matches and a draft model (or head)
elsewhere (`draft=ngram+model`). The engine's draft-length controller picks each row's source from the parts'
signals and measured gains (`engine.adaptive`); `view.sources` says which.

Exact: the choice looks only at the past (the parts' signals, earlier acceptance and timings), and each row's chain
carries the q it was drawn from — the sampled part's distributions, a one-hot q for a chosen (deterministic) part.
A part that drafts nothing for a row still sees its committed tokens (`update` with an empty path): a draft model's
cache catches up on the row's next draft.
"""

from __future__ import annotations

import time

import torch

from .base import BatchView, Draft, Proposer, Signal

__all__ = ["SwitchProposer"]


class SwitchProposer(Proposer):
    """parts: chain proposers with one source each; source i is parts[i]."""

    name = "switch"

    def __init__(self, parts: list[Proposer]):
        if len(parts) < 2 or any(p.tree is not None or len(p.source_costs) != 1 for p in parts):
            raise ValueError("a SwitchProposer chooses between two or more chain drafters with one source each")
        self.parts = list(parts)
        self._drafts: list[Draft] = []
        self.kept = [0] * len(parts)  # per source: its draft tokens kept, over the proposer's life
        self.source_seconds: list[float] = []  # per source: its seconds in the last `propose` (the step's costs)

    @property
    def source_costs(self) -> tuple[float, ...]:
        return tuple(p.cost_prior for p in self.parts)

    def start(self, view: BatchView, capacity: int) -> None:
        for p in self.parts:
            p.start(view, capacity)

    def add(self, view: BatchView, capacity: int) -> None:
        for p in self.parts:
            p.add(view, capacity)

    def select(self, rows: list[int]) -> None:
        for p in self.parts:
            p.select(rows)

    def weights_changed(self, model) -> float:
        return sum(p.weights_changed(model) for p in self.parts)

    def release(self) -> None:
        for p in self.parts:
            p.release()

    def signals(self, view: BatchView) -> list[tuple[Signal | None, ...]]:
        per_part = [p.signals(view) for p in self.parts]  # [part][row] -> (signal,)
        return [tuple(part[b][0] for part in per_part) for b in range(len(view.seqs))]

    def propose(self, view: BatchView, caps: list[int]) -> Draft:
        sources = view.sources or [0] * len(caps)
        self._drafts, self.source_seconds = [], []
        for i, p in enumerate(self.parts):
            t0 = time.perf_counter()
            self._drafts.append(p.propose(view, [c if s == i else 0 for c, s in zip(caps, sources)]))
            self.source_seconds.append(time.perf_counter() - t0)
        return merge_chains(self._drafts, sources, view.device)

    def update(self, view: BatchView, old_lengths: list[int], draft: Draft, paths: list[list[int]]) -> None:
        sources = view.sources or [0] * len(paths)
        for path, s in zip(paths, sources):
            self.kept[s] += len(path)
        for i, (p, own) in enumerate(zip(self.parts, self._drafts)):
            p.update(view, old_lengths, own, [path if s == i else [] for path, s in zip(paths, sources)])


def merge_chains(drafts: list[Draft], sources: list[int], device: torch.device) -> Draft:
    """One chain per row from the draft of its source (rows another part drafted are empty in each draft); q:
    the sampled parts' distributions, one-hot at a chosen part's tokens; None when no row's chain was sampled."""
    B = len(sources)
    num = [drafts[s].num_nodes[b] for b, s in enumerate(sources)]
    k = max(num, default=0)
    ids = torch.full((B, k), -1, dtype=torch.int64, device=device)  # [B, k]
    for b, s in enumerate(sources):
        ids[b, : num[b]] = drafts[s].token_ids[b, : num[b]]
    sampled = [
        d.probs is not None and any(d.num_nodes[b] for b, s in enumerate(sources) if s == i)
        for i, d in enumerate(drafts)
    ]
    if not any(sampled) or k == 0:
        return Draft.chain_of(ids, None, num)
    V = next(d.probs.shape[-1] for d, s in zip(drafts, sampled) if s)
    probs = torch.zeros((B, k + 1, V), dtype=next(d.probs.dtype for d, s in zip(drafts, sampled) if s), device=device)
    for b, s in enumerate(sources):  # [B, k + 1, V]: q of each row's drafts
        n = num[b]
        if n and drafts[s].probs is not None:
            probs[b, :n] = drafts[s].probs[b, :n]
        elif n:
            probs[b, torch.arange(n, device=device), ids[b, :n]] = 1.0  # a chosen token: one-hot q
    return Draft.chain_of(ids, probs, num)
