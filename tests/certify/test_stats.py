"""The statistics behind the certificates (verispec.certify.stats), against scipy, hand-computed values, and
broken input that each test must reject."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats as sps

from verispec.certify.stats import (
    chisquare_gof,
    chisquare_power,
    chisquare_two_sample,
    detectable_tv,
    holm,
    loglik_test,
    merge_small_bins,
    pit_uniformity,
    samples_to_detect,
)


def test_merge_small_bins_reaches_threshold():
    exp = np.array([100.0, 1.0, 2.0, 3.0, 0.0, 50.0, 0.5])
    labels = merge_small_bins(exp, 5.0)
    assert labels[4] == -1  # zero-probability bin handled separately
    groups = {g: exp[labels == g].sum() for g in set(labels) if g >= 0}
    assert all(v >= 5 for v in groups.values())


@pytest.mark.statistical
def test_gof_pvalue_uniform_under_null_and_impossible_outcomes():
    rng = np.random.default_rng(0)
    p = rng.dirichlet(np.ones(20))
    pvals = [chisquare_gof(rng.multinomial(5000, p), p).pvalue for _ in range(400)]
    # under H0 the p-values are ~U(0, 1): a level-0.05 test rejects ~5% (binomial 400, 0.05: 3 sigma ~ 13)
    assert abs(sum(pv < 0.05 for pv in pvals) - 20) < 14
    counts = rng.multinomial(1000, p)
    p0 = p.copy()
    p0[0] = 0
    p0 /= p0.sum()
    counts[0] = 1
    r = chisquare_gof(counts, p0)
    assert r.pvalue == 0.0 and r.impossible == 1
    with pytest.raises(ValueError):
        chisquare_gof(counts, p * 2)


@pytest.mark.statistical
def test_power_monotone_in_n_and_detects():
    p = np.full(10, 0.1)
    alt = p.copy()
    alt[0] += 0.02
    alt[1] -= 0.02
    small, big = chisquare_power(p, alt, 500, 1e-3), chisquare_power(p, alt, 50_000, 1e-3)
    assert small < 0.5 < 0.99 < big
    rng = np.random.default_rng(1)
    rejections = sum(chisquare_gof(rng.multinomial(50_000, alt), p).rejects(1e-3) for _ in range(50))
    assert rejections >= 48


# --- direct tests of the other helpers: hand-computed values, scipy, and broken input that must be rejected ---


def test_holm_hand_computed():
    # sorted 0.005, 0.01, 0.03, 0.04 times 4, 3, 2, 1 = 0.02, 0.03, 0.06, 0.04 -> running max 0.02, 0.03, 0.06, 0.06
    np.testing.assert_allclose(holm([0.01, 0.04, 0.03, 0.005]), [0.03, 0.06, 0.06, 0.02], rtol=1e-12)
    np.testing.assert_allclose(holm([0.5, 0.6]), [1.0, 1.0])  # clipped at 1
    np.testing.assert_allclose(holm([0.2]), [0.2])
    assert holm([]).size == 0
    adjusted = holm([1e-4, 0.02, 0.3])
    assert (adjusted >= [1e-4, 0.02, 0.3]).all() and adjusted[0] == pytest.approx(3e-4)


def test_two_sample_chi_square_against_scipy():
    a, b = np.array([30, 20, 50]), np.array([40, 40, 20])
    r = chisquare_two_sample(a, b)
    stat, pvalue, dof, _ = sps.chi2_contingency(np.stack([a, b]), correction=False)
    assert r.statistic == pytest.approx(stat) and r.pvalue == pytest.approx(pvalue) and r.dof == dof == 2
    assert r.n == 200 and r.rejects(0.01)  # these two samples do come from different laws
    # small cells are pooled (expected counts >= 5) before the test: the three rare outcomes (expected 1.5, 0.5,
    # 0.5) do not reach 5 together, so they join the next smallest outcome: 2 cells left, dof 1
    r = chisquare_two_sample(np.array([50, 50, 1, 1, 0]), np.array([48, 52, 2, 0, 1]))
    pooled = np.array([[50 + 1 + 1 + 0, 50], [48 + 2 + 0 + 1, 52]])
    assert r.dof == 1 and r.statistic == pytest.approx(sps.chi2_contingency(pooled, correction=False)[0])
    assert not r.rejects(0.01)
    assert chisquare_two_sample(np.zeros(3), np.array([1, 2, 3])).pvalue == 1.0  # nothing to compare
    with pytest.raises(ValueError, match="differ in length"):
        chisquare_two_sample(np.ones(3), np.ones(4))


@pytest.mark.statistical
def test_two_sample_chi_square_null_and_alternative():
    rng = np.random.default_rng(3)
    p = rng.dirichlet(np.ones(12))
    q = 0.8 * p + 0.2 * rng.dirichlet(np.ones(12))
    same = [chisquare_two_sample(rng.multinomial(3000, p), rng.multinomial(3000, p)).pvalue for _ in range(200)]
    assert sum(pv < 0.05 for pv in same) <= 20  # ~10 expected under H0 (binomial 200, 0.05: 3 sigma ~ 9)
    assert chisquare_two_sample(rng.multinomial(20_000, p), rng.multinomial(20_000, q)).pvalue < 1e-6


def _law_terms(p: np.ndarray) -> tuple[float, float]:
    logp = np.log(p)
    e = float((p * logp).sum())
    return e, float((p * logp**2).sum() - e**2)


def test_loglik_test_hand_computed():
    p = np.array([0.5, 0.25, 0.25])
    e, var = _law_terms(p)  # e = -1.5 log 2 ... = -1.0397, var = 0.5 (log 2)^2 / 2 = 0.1201
    assert e == pytest.approx(-1.5 * np.log(2)) and var == pytest.approx(0.25 * np.log(2) ** 2)
    r = loglik_test(np.log([0.5, 0.25]), [e, e], [var, var])
    z = (np.log(0.5) + np.log(0.25) - 2 * e) / np.sqrt(2 * var)
    assert r.z == pytest.approx(z) and r.pvalue == pytest.approx(2 * sps.norm.sf(abs(z)))
    assert r.n == 2 and r.mean_excess == pytest.approx((np.log(0.5) + np.log(0.25)) / 2 - e)
    assert r.sd_per_token == pytest.approx(np.sqrt(var))
    assert r.detectable(0.01, 0.99) == pytest.approx((sps.norm.isf(0.005) + sps.norm.isf(0.01)) * np.sqrt(var / 2))
    imp = loglik_test([np.log(0.5), -np.inf], [e, e], [var, var])
    assert imp.pvalue == 0.0 and imp.impossible == 1
    one_hot = loglik_test([0.0, 0.0], [0.0, 0.0], [0.0, 0.0])  # greedy: every token is the only possible one
    assert one_hot.pvalue == 1.0


def _loglik_of(tokens: np.ndarray, p: np.ndarray):
    e, var = _law_terms(p)
    n = tokens.size
    return loglik_test(np.log(p[tokens]), np.full(n, e), np.full(n, var))


@pytest.mark.statistical
def test_loglik_test_catches_a_sharpened_or_flattened_sampler():
    rng = np.random.default_rng(0)
    p = rng.dirichlet(np.ones(10))
    assert not _loglik_of(rng.choice(10, 5000, p=p), p).pvalue < 0.01
    sharp = p**2 / (p**2).sum()  # temperature 0.5
    r = _loglik_of(rng.choice(10, 5000, p=sharp), p)
    assert r.pvalue < 1e-6 and r.z > 0  # more likely tokens than p emits
    flat = np.sqrt(p) / np.sqrt(p).sum()  # temperature 2
    r = _loglik_of(rng.choice(10, 5000, p=flat), p)
    assert r.pvalue < 1e-6 and r.z < 0


def _pit(tokens: np.ndarray, p: np.ndarray, rng) -> np.ndarray:
    """Randomized PIT, as certify generate computes it: F(x-) + v p(x), v ~ U(0, 1)."""
    cdf_before = np.concatenate([[0.0], np.cumsum(p)[:-1]])
    return cdf_before[tokens] + rng.random(tokens.size) * p[tokens]


@pytest.mark.statistical
def test_pit_uniformity_against_scipy_and_a_wrong_law():
    rng = np.random.default_rng(1)
    p = rng.dirichlet(np.ones(6))
    u = _pit(rng.choice(6, 4000, p=p), p, rng)
    r = pit_uniformity(u)
    ks = sps.kstest(u, "uniform")
    assert r.statistic == pytest.approx(ks.statistic) and r.pvalue == pytest.approx(ks.pvalue) and r.n == 4000
    assert r.pvalue > 0.01  # tokens from p: uniform PIT
    q = np.roll(p, 1)  # tokens from another law, transformed under p: not uniform
    assert pit_uniformity(_pit(rng.choice(6, 4000, p=q), p, rng)).pvalue < 1e-6
    assert pit_uniformity([]).pvalue == 1.0 and pit_uniformity([]).detectable(0.01) == float("inf")
    d = r.detectable(0.01, 0.99)
    assert sps.kstwo.isf(0.01, 4000) < d < 0.1


def test_detectable_tv_single_outcome_and_no_degrees_of_freedom():
    # a law with one possible outcome: a deviation d shows as an impossible outcome with probability 1 - (1 - d)^n
    d = detectable_tv(np.array([1.0, 0.0, 0.0]), 100, 1e-3, 0.99)
    assert d == pytest.approx(1 - 0.01 ** (1 / 100)) and 1 - (1 - d) ** 100 == pytest.approx(0.99)
    assert detectable_tv(np.full(32, 1 / 32), 8, 1e-3) == float("inf")  # 8 samples, 32 outcomes: one merged bin
    assert detectable_tv(np.full(4, 0.25), 0, 1e-3) == float("inf")


def test_samples_to_detect_is_the_smallest_such_size():
    p = np.random.default_rng(2).dirichlet(np.ones(16))
    n = samples_to_detect(p, 0.05, 1e-3)
    assert detectable_tv(p, n, 1e-3) <= 0.05 < detectable_tv(p, 0.98 * n, 1e-3)
    assert samples_to_detect(np.array([1.0, 0.0]), 0.05, 1e-3) == pytest.approx(np.log(0.01) / np.log(0.95), rel=0.02)
    with pytest.raises(ValueError, match="tv must lie"):
        samples_to_detect(p, 0.0, 1e-3)
