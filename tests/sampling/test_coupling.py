"""Gumbel coupling (verispec.sampling.coupling): the keyed race is an exact sampler of p, its noise is a function of
(seed, position) only, a coupled drafter agrees with the target at least (1 - TV) / (1 + TV) of the time, and the
kernel certificate PASSES the coupled verifier while a look-alike with unkeyed positions FAILS."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from verispec.certify.bugs import broken_coupled_verifier
from verispec.certify.kernel import certify_kernel
from verispec.certify.stats import chisquare_gof
from verispec.sampling.coupling import (
    coupled_children,
    coupled_draws,
    coupled_targets,
    gumbel_verifier,
    keyed_exponentials,
    race_winner,
)

LEVEL = 1e-3  # per statistical test below, fixed seeds


def _dist(seed: int, V: int, scale: float = 2.0, zeros: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    p = (scale * torch.randn(V, generator=g, dtype=torch.float64)).softmax(-1)
    p[:zeros] = 0.0
    return p / p.sum()


def test_counter_hash_matches_the_scalar_splitmix64():
    """The int64 tensor version wraps like the 64-bit reference, bit for bit (so it is the same on every device)."""
    from verispec.sampling.coupling import _GOLDEN, _MASK64, _splitmix64, splitmix64_counter

    for key in (0, 1, 2**62 + 12345, 2**63 - 1):
        got = splitmix64_counter(key, 5).tolist()
        want = []
        for i in range(1, 6):
            h = _splitmix64((key + (i - 1) * (_GOLDEN & _MASK64)) & _MASK64)  # _splitmix64 adds golden itself
            want.append(h - (1 << 64) if h >= 1 << 63 else h)
        assert got == want


def test_noise_is_a_function_of_seed_and_position():
    a = keyed_exponentials(7, 3, 50)
    assert torch.equal(a, keyed_exponentials(7, 3, 50))
    assert not torch.equal(a, keyed_exponentials(7, 4, 50)) and not torch.equal(a, keyed_exponentials(8, 3, 50))
    assert bool((a >= 0).all()) and a.dtype == torch.float64


@pytest.mark.statistical
def test_keyed_race_is_an_exact_sampler():
    """20 000 positions of one seed, each an independent race over the same p (with a p = 0 tail): the winners
    pass a chi-square test against p (level 1e-3) and never pick a p = 0 token; a race over p**2 fails it."""
    V, n = 16, 20_000
    p = _dist(1, V, zeros=3)
    exps = torch.stack([keyed_exponentials(5, i, V) for i in range(n)])  # [n, V]
    wins = race_winner(p.expand(n, V), exps).numpy()
    assert chisquare_gof(np.bincount(wins, minlength=V), p.numpy()).pvalue > LEVEL
    assert wins.min() >= 3
    wrong = race_winner((p**2 / (p**2).sum()).expand(n, V), exps).numpy()
    assert chisquare_gof(np.bincount(wrong, minlength=V), p.numpy()).pvalue < LEVEL


@pytest.mark.statistical
@pytest.mark.parametrize("scale", [0.5, 2.0])
def test_coupled_drafter_agrees_at_least_the_bound(scale):
    """P(race(q) == race(p)) >= (1 - TV) / (1 + TV) (Daliri et al.), over 5 000 keyed positions: the observed
    agreement is above the bound minus 4 binomial standard deviations (a one-sided test at level ~3e-5)."""
    V, n = 32, 5_000
    p, q = _dist(2, V, scale), _dist(3, V, scale)
    tv = 0.5 * float((p - q).abs().sum())
    bound = (1 - tv) / (1 + tv)
    seeds = list(range(n))
    drafts = coupled_draws(q.expand(n, V).float(), seeds, [0] * n, [True] * n)
    target = torch.stack([race_winner(p, keyed_exponentials(s, 0, V)) for s in seeds])
    agree = float((drafts == target).double().mean())
    assert agree >= bound - 4 * (bound * (1 - bound) / n) ** 0.5, (agree, bound)
    assert agree <= 1 - tv + 4 * ((1 - tv) * tv / n) ** 0.5  # no coupling beats the optimal 1 - TV


def test_coupled_targets_are_one_hot_and_share_noise_by_position():
    V = 12
    p = torch.stack([_dist(s, V) for s in range(3)]).float().unsqueeze(0)  # [1, 3, V]
    same = coupled_targets(p.expand(1, 3, V).contiguous()[:, [0, 0, 0]], [9], [[4, 4, 5]])  # slots 0, 1: one race
    assert torch.equal(same.sum(-1), torch.ones(1, 3))
    assert torch.equal(same[0, 0], same[0, 1])
    win = race_winner(p[0, 0], keyed_exponentials(9, 4, V))
    assert int(same[0, 0].argmax()) == int(win)


def test_coupled_children_are_the_top_of_q_over_the_targets_noise():
    """The first child is q's race winner under the noise of the children's position (the coupled draw); the
    others the runners-up, distinct; tokens with q = 0 are no children; more children than tokens are invalid."""
    V = 12
    q = torch.stack([_dist(s, V, zeros=z) for s, z in ((1, 0), (2, 9), (3, 0))]).float()  # row 1: 3 tokens with mass
    kids, ok = coupled_children(q, [9, 9, 4], [4, 4, 7], 4)
    for m, (seed, pos) in enumerate(((9, 4), (9, 4), (4, 7))):
        exps = keyed_exponentials(seed, pos, V)
        assert int(kids[m, 0]) == int(race_winner(q[m], exps))
        score = (q[m].double() / exps).tolist()
        valid = kids[m][ok[m]].tolist()
        assert valid == sorted((x for x in range(V) if q[m, x] > 0), key=lambda x: -score[x])[:4]
    assert ok.tolist()[1] == [True, True, True, False]  # row 1: three tokens with mass
    assert int(coupled_draws(q, [9, 9, 4], [4, 4, 7], [True] * 3)[2]) == int(kids[2, 0])
    wide, ok_wide = coupled_children(q, [9, 9, 4], [4, 4, 7], V + 2)
    assert wide.shape == (3, V + 2) and not ok_wide[:, V:].any()


@pytest.mark.statistical
def test_kernel_certificate_passes_the_coupled_verifier_and_fails_unkeyed_noise():
    """At 10k steps per case: Gumbel-coupled verification PASSES the completed-sequence laws; the same race with
    one noise vector for every position of a step FAILS them (its emitted tokens are dependent)."""
    good = certify_kernel(gumbel_verifier, samples=10_000, laws="sequence")
    assert good.passed, good.to_markdown()
    bad = certify_kernel(broken_coupled_verifier("gumbel_position_unkeyed"), samples=10_000, laws="sequence")
    assert not bad.passed and bad.failing and not bad.errors
