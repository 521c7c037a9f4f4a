"""Goodness-of-fit statistics used by the tests and by `verispec certify`.

Chi-square goodness of fit against an exactly known distribution, with small bins merged so that every
bin's expected count is >= `min_expected` (the usual validity rule for the chi-square approximation).
An observation in a bin of probability exactly 0 is an impossible event: the p-value is 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy import stats

__all__ = ["GofResult", "chisquare_gof", "chisquare_power", "merge_small_bins"]


@dataclass(frozen=True)
class GofResult:
    statistic: float
    dof: int
    pvalue: float
    n: int  # number of observations
    impossible: int  # observations that fell on probability-0 outcomes

    def rejects(self, level: float) -> bool:
        return self.pvalue < level


def merge_small_bins(expected: np.ndarray, min_expected: float = 5.0) -> np.ndarray:
    """Group labels (len = len(expected)) so that every group's expected count is >= min_expected.

    Bins are taken in increasing order of expected count and pooled until the pool reaches the threshold;
    a final pool that stays short is folded into the smallest complete group. Zero-probability bins are
    not given a group (label -1): they are handled as impossible outcomes by the caller.
    """
    expected = np.asarray(expected, dtype=np.float64)
    labels = np.full(expected.shape, -1, dtype=np.int64)
    order = [i for i in np.argsort(expected, kind="stable") if expected[i] > 0]
    group, pool = 0, 0.0
    pending: list[int] = []
    for i in order:
        pending.append(i)
        pool += expected[i]
        if pool >= min_expected:
            labels[pending] = group
            group, pool, pending = group + 1, 0.0, []
    if pending:
        labels[pending] = max(group - 1, 0)
    return labels


def chisquare_gof(counts: np.ndarray, probs: np.ndarray, min_expected: float = 5.0) -> GofResult:
    """Chi-square goodness-of-fit of observed `counts` against exact outcome probabilities `probs`."""
    counts = np.asarray(counts, dtype=np.float64).ravel()
    probs = np.asarray(probs, dtype=np.float64).ravel()
    if counts.shape != probs.shape:
        raise ValueError(f"counts and probs differ in length: {counts.shape} vs {probs.shape}")
    if (probs < 0).any() or not np.isclose(probs.sum(), 1.0, atol=1e-6):
        raise ValueError("probs must be a probability vector")
    n = int(counts.sum())
    impossible = int(counts[probs <= 0].sum())
    if n == 0:
        return GofResult(0.0, 0, 1.0, 0, 0)
    if impossible:
        return GofResult(float("inf"), 0, 0.0, n, impossible)
    labels = merge_small_bins(probs * n, min_expected)
    n_groups = int(labels.max()) + 1
    obs = np.bincount(labels[labels >= 0], weights=counts[labels >= 0], minlength=n_groups)
    exp = np.bincount(labels[labels >= 0], weights=probs[labels >= 0] * n, minlength=n_groups)
    if n_groups < 2:
        return GofResult(0.0, 0, 1.0, n, 0)
    stat = float(((obs - exp) ** 2 / exp).sum())
    dof = n_groups - 1
    return GofResult(stat, dof, float(stats.chi2.sf(stat, dof)), n, 0)


def chisquare_power(probs: np.ndarray, alt_probs: np.ndarray, n: int, level: float,
                    min_expected: float = 5.0) -> float:
    """Power of `chisquare_gof` at sample size n when the data really follow `alt_probs`.

    Noncentral chi-square approximation on the same merged bins: lambda = n * sum (a - p)^2 / p.
    Mass that `alt_probs` puts on probability-0 outcomes is detected with probability 1 - (1 - m)^n.
    """
    probs = np.asarray(probs, dtype=np.float64).ravel()
    alt = np.asarray(alt_probs, dtype=np.float64).ravel()
    impossible_mass = float(alt[probs <= 0].sum())
    labels = merge_small_bins(probs * n, min_expected)
    n_groups = int(labels.max()) + 1
    if n_groups < 2:
        return 1.0 - (1.0 - impossible_mass) ** n
    p = np.bincount(labels[labels >= 0], weights=probs[labels >= 0], minlength=n_groups)
    a = np.bincount(labels[labels >= 0], weights=alt[labels >= 0], minlength=n_groups)
    dof = n_groups - 1
    lam = n * float(((a - p) ** 2 / p).sum())
    crit = stats.chi2.isf(level, dof)
    power_gof = float(stats.ncx2.sf(crit, dof, lam)) if lam > 0 else level
    return 1.0 - (1.0 - power_gof) * (1.0 - impossible_mass) ** n
