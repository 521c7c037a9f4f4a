"""Prompt lookup (n-gram) drafting: propose the continuation of the most recent earlier occurrence of the
sequence's last n tokens, for n from the largest configured size down. Deterministic, so q is one-hot."""

from __future__ import annotations

import torch

from .base import BatchView, Proposal, Proposer

__all__ = ["PromptLookupProposer"]


def lookup(seq: torch.Tensor, n_sizes: tuple[int, ...], gamma: int) -> list[int]:
    """seq [L] int64 -> up to gamma tokens following the latest earlier match of the last n tokens."""
    L = seq.shape[0]
    for n in n_sizes:
        if L <= n:
            continue
        windows = seq[: L - 1].unfold(0, n, 1)  # [L - n, n]: every n-gram that has a successor
        hits = (windows == seq[L - n:]).all(dim=1).nonzero()
        if hits.numel():
            start = int(hits[-1]) + n
            return seq[start: start + gamma].tolist()
    return []


class PromptLookupProposer(Proposer):
    name = "ngram"

    def __init__(self, ngram_sizes: tuple[int, ...] = (3, 2, 1)):
        sizes = tuple(sorted({int(n) for n in ngram_sizes}, reverse=True))
        if not sizes or sizes[-1] < 1:
            raise ValueError(f"n-gram sizes must be integers >= 1, got {ngram_sizes}")
        self.ngram_sizes = sizes

    def propose(self, view: BatchView, gammas: list[int]) -> Proposal:
        B = len(view.seqs)
        k = max(gammas, default=0)
        if k == 0:
            return Proposal.empty(B, view.device)
        ids = torch.full((B, k), -1, dtype=torch.int64)
        counts = []
        for b, (seq, g) in enumerate(zip(view.seqs, gammas)):
            found = lookup(torch.as_tensor(seq), self.ngram_sizes, g) if g > 0 else []
            ids[b, : len(found)] = torch.as_tensor(found, dtype=torch.int64)
            counts.append(len(found))
        return Proposal(ids.to(view.device), None, counts)
