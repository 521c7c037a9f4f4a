"""The exact law of a tiny model's first L output tokens (and finish reason), enumerated level by level: the
reference the law tests' chi-square compares speculative output against."""

from __future__ import annotations

import numpy as np
import torch

from verispec.certify.stats import chisquare_gof
from verispec.sampling import SamplingParams, probs_from_logits

Outcome = tuple[tuple[int, ...], str]


class Law:
    def __init__(self, law: dict[Outcome, float]):
        self.outcomes = sorted(law)
        self.probs = np.array([law[o] for o in self.outcomes])
        assert abs(self.probs.sum() - 1) < 1e-9
        self.probs /= self.probs.sum()
        self._index = {o: i for i, o in enumerate(self.outcomes)}

    def gof(self, completions):
        counts = np.zeros(len(self.outcomes) + 1)
        for c in completions:
            counts[self._index.get((tuple(c.token_ids), c.finish_reason), len(self.outcomes))] += 1
        return chisquare_gof(counts, np.append(self.probs, 0.0))


@torch.no_grad()
def exact_law(model, prompt: list[int], params: SamplingParams, budget: int, eos: int) -> Law:
    """The target's law of (output, finish reason): full forwards over prompt + prefix, level by level."""
    law: dict[Outcome, float] = {}
    frontier: list[tuple[tuple[int, ...], float]] = [((), 1.0)]
    while frontier:
        ids = torch.tensor([prompt + list(p) for p, _ in frontier])
        probs = probs_from_logits(model(ids).logits[:, -1].double(), params)  # [n, V]
        nxt = []
        for (prefix, mass), row in zip(frontier, probs.tolist()):
            for t, pt in enumerate(row):
                if pt <= 0:
                    continue
                if t == eos:
                    law[(prefix, "stop")] = mass * pt
                elif len(prefix) + 1 == budget:
                    law[(prefix + (t,), "length")] = mass * pt
                else:
                    nxt.append((prefix + (t,), mass * pt))
        frontier = nxt
    return Law(law)
