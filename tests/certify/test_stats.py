from __future__ import annotations

import numpy as np
import pytest

from verispec.certify.stats import chisquare_gof, chisquare_power, merge_small_bins


def test_merge_small_bins_reaches_threshold():
    exp = np.array([100.0, 1.0, 2.0, 3.0, 0.0, 50.0, 0.5])
    labels = merge_small_bins(exp, 5.0)
    assert labels[4] == -1  # zero-probability bin handled separately
    groups = {g: exp[labels == g].sum() for g in set(labels) if g >= 0}
    assert all(v >= 5 for v in groups.values())


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
