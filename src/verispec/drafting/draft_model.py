"""Draft-model drafting: a smaller model samples gamma tokens autoregressively with the request's own
SamplingParams, through the same `probs_from_logits` as the target, so q is exactly what it sampled from.

The draft keeps its own KV cache (its runner's): after verification it is rolled back to the accepted
prefix; after a fully accepted step it catches up on the last draft token in the next step's first pass.
"""

from __future__ import annotations

import torch

from ..model.fast import make_runner
from ..sampling import counts_at_draft_positions, probs_from_logits, sample_from_weights
from .base import BatchView, Proposal, Proposer

__all__ = ["DraftModelProposer"]


class DraftModelProposer(Proposer):
    name = "draft-model"

    def __init__(self, model, vocab_size: int, stop_below: float | None = 0.3, *, runner: str = "auto",
                 quant: str | None = None):
        """stop_below: a row stops drafting once a draft token's probability under the draft's own
        (temperature-1) distribution is below stop_below (the draft is unsure, so later drafts would
        likely be rejected). Any such stopping rule that looks only at
        the draft's own tokens and distributions keeps verification exact. None drafts the full gamma.
        runner / quant: see `verispec.model.fast.make_runner` (quant: weight-only int8 / int4 draft weights)."""
        if stop_below is not None and not 0.0 <= stop_below <= 1.0:
            raise ValueError(f"stop_below must be in [0, 1] or None, got {stop_below}")
        self.runner = make_runner(model, vocab_size, runner=runner, quant=quant)
        self.stop_below = stop_below

    def start(self, view: BatchView, capacity: int) -> None:
        self.runner.start(len(view.seqs), capacity)
        self.runner.prefill([s[:-1] for s in view.seqs])  # invariant: the cache holds all but the pending token

    def add(self, view: BatchView, capacity: int) -> None:
        self.runner.add_rows([s[:-1] for s in view.seqs], capacity)

    def propose(self, view: BatchView, gammas: list[int]) -> Proposal:
        B = len(view.seqs)
        k = max(gammas, default=0)
        if k == 0:
            return Proposal.empty(B, view.device)
        dev = view.device
        ids = torch.full((B, k), -1, dtype=torch.int64, device=dev)
        probs = None
        penalties = any(p.uses_penalties for p in view.params)
        feed = [s[n:] if g > 0 else [] for s, n, g in zip(view.seqs, self.runner.lengths, gammas)]
        for j in range(k):
            logits = self.runner.forward(feed, logits_at="last")  # [B, V]
            counts = None
            if penalties:
                counts = counts_at_draft_positions(view.output_counts, ids[:, :j])[:, j]
            q = probs_from_logits(logits, view.params, prompt_mask=view.prompt_mask, output_counts=counts)  # [B, V]
            if probs is None:
                probs = torch.zeros((B, k, q.shape[-1]), dtype=q.dtype, device=dev)
            probs[:, j] = q
            active = [g > j for g in gammas]
            u = torch.zeros(B, dtype=torch.float64)
            for b in range(B):
                if active[b]:  # only rows that draft here consume randomness
                    u[b] = torch.rand((), dtype=torch.float64, generator=view.generators[b])
            tok = sample_from_weights(q, u.to(dev))  # [B]
            ids[:, j] = torch.where(torch.tensor(active, device=dev), tok, -1)
            if self.stop_below is not None:
                # confidence from the draft's own unprocessed distribution (a greedy q is always one-hot)
                conf = logits.softmax(-1).gather(1, tok.unsqueeze(1)).squeeze(1)
                unsure = (conf < self.stop_below).tolist()
                gammas = [j + 1 if (a and low) else g for g, a, low in zip(gammas, active, unsure)]
            if j + 1 < k:
                if max(gammas) <= j + 1:
                    break
                feed = [[int(tok[b])] if g > j + 1 else [] for b, g in enumerate(gammas)]
        k_used = max(min(g, k) for g in gammas)
        return Proposal(ids[:, :k_used], probs[:, :k_used], [min(g, k) for g in gammas])

    def update(self, view: BatchView, old_lengths: list[int], num_accepted: list[int],
               num_draft: list[int]) -> None:
        # The cache holds the old sequence plus the first (num_draft - 1) drafts that were fed back:
        # keep the old sequence and the accepted ones among them.
        keep = [min(cur, n_old + min(a, max(nd - 1, 0))) if nd > 0 else cur
                for cur, n_old, a, nd in zip(self.runner.lengths, old_lengths, num_accepted, num_draft)]
        self.runner.truncate(keep)

    def select(self, rows: list[int]) -> None:
        self.runner.select(rows)
