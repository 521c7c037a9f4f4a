"""A prefix-dependent toy language model pair over a few tokens: p(. | prefix) and q(. | prefix), a fresh seeded
softmax per prefix, for exact laws by enumeration (block verification, position-keyed verification)."""

from __future__ import annotations

import hashlib

import torch


def stable_seed(*key) -> int:
    """A seed from a key, the same in every process (Python's hash() of a str is salted per process)."""
    return int.from_bytes(hashlib.blake2b(repr(key).encode(), digest_size=4).digest(), "little")


class ToyLM:
    """p(. | prefix) and q(. | prefix) that depend on the whole prefix (a fresh softmax per prefix), seeded."""

    def __init__(self, vocab: int, seed: int, scale: float = 1.5, zeros: bool = False):
        self.V, self.seed, self.scale, self.zeros, self.cache = vocab, seed, scale, zeros, {}

    def dist(self, prefix: tuple, which: str) -> torch.Tensor:  # [V] float64
        key = (prefix, which)
        if key not in self.cache:
            g = torch.Generator().manual_seed(stable_seed(self.seed, which, *prefix))
            d = (self.scale * torch.randn(self.V, generator=g, dtype=torch.float64)).softmax(-1)
            if self.zeros:  # some tokens impossible under p or q (never both everywhere)
                d[int(torch.randint(self.V, (1,), generator=g))] = 0.0
                d = d / d.sum()
            self.cache[key] = d
        return self.cache[key]
