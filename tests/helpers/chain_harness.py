"""Thin adapter from the chain tests' (p, q) cases to the kernel certifier's machinery (verispec.certify.kernel).

A "case" fixes per-position target distributions p[j] (j = 0..k, row k is the bonus position) and draft
distributions q[j] (or fixed one-hot draft tokens) that do not depend on the prefix, so that the correct
output of a speculative step is: token at position j ~ p[j], independently, for every position reached.
"""

from __future__ import annotations

from verispec.certify import kernel
from verispec.certify.bugs import broken_verifier as broken_verify  # noqa: F401  (re-exported for the tests)
from verispec.certify.stats import GofResult

LEVEL = 1e-4  # significance level of every single chi-square test in the chain tests


def _case(p, q, onehot_ids=None, ragged=False) -> kernel.KernelCase:
    return kernel.KernelCase("test", p.double(), None if q is None else q.double(), onehot_ids, ragged)


def run_case(sampler, p, q, n, *, onehot_ids=None, ragged=False, seed=0):
    """n independent speculative steps: token_ids [n, k+1], num_accepted [n], num_draft [n]."""
    return kernel.run_case(sampler, _case(p, q, onehot_ids, ragged), n, seed=seed, dtype=p.dtype)


def position_tests(p, q, token_ids, num_accepted, num_draft, onehot_ids=None) -> dict[str, GofResult]:
    tests = kernel.position_tests(_case(p, q, onehot_ids), token_ids, num_accepted, num_draft)
    return {name: res for name, (res, _) in tests.items()}


def failing(results: dict[str, GofResult], level: float = LEVEL) -> list[str]:
    return [
        f"{name}: p={r.pvalue:.3g} (stat {r.statistic:.1f}, dof {r.dof}, n {r.n}, impossible {r.impossible})"
        for name, r in results.items()
        if r.rejects(level)
    ]
