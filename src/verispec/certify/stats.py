"""Goodness-of-fit statistics used by the tests and by `verispec certify`.

Chi-square goodness of fit against an exactly known distribution, with small bins merged so that every
bin's expected count is >= `min_expected` (the usual validity rule for the chi-square approximation).
An observation in a bin of probability exactly 0 is an impossible event: the p-value is 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy import stats

__all__ = ["GofResult", "LikelihoodResult", "UniformityResult", "chisquare_gof", "chisquare_power"]
__all__ += ["chisquare_two_sample", "detectable_tv", "holm", "loglik_test", "merge_small_bins", "pit_uniformity"]
__all__ += ["samples_to_detect", "tolerant_tv_test"]


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


def chisquare_power(probs: np.ndarray, alt_probs: np.ndarray, n: int, level: float, min_expected: float = 5.0) -> float:
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


# --- multiple testing and detectable effects ------------------------------------------------------------


def holm(pvalues) -> np.ndarray:
    """Holm's step-down adjusted p-values (family-wise error control, any dependence between the tests).

    Reject test i at family-wise level a iff adjusted[i] < a.
    """
    p = np.asarray(pvalues, dtype=np.float64).ravel()
    m = p.size
    if m == 0:
        return p
    order = np.argsort(p, kind="stable")
    adj_sorted = np.minimum(1.0, np.maximum.accumulate((m - np.arange(m)) * p[order]))
    adjusted = np.empty(m)
    adjusted[order] = adj_sorted
    return adjusted


def _ncx2_lambda_for_power(dof: int, level: float, power: float) -> float:
    """Noncentrality lambda at which a chi-square test with `dof` degrees of freedom at `level` has `power`."""
    from scipy.optimize import brentq

    crit = stats.chi2.isf(level, dof)
    hi = 1.0
    while stats.ncx2.sf(crit, dof, hi) < power:
        hi *= 2
    return float(brentq(lambda lam: stats.ncx2.sf(crit, dof, lam) - power, 1e-9, hi))


def detectable_tv(probs: np.ndarray, n: float, level: float, power: float = 0.99, min_expected: float = 5.0) -> float:
    """Smallest total-variation deviation from `probs` that `chisquare_gof` detects with `power` at `level`.

    Any alternative a with TV(a, p) = d on the merged bins has chi-square divergence sum (a - p)^2 / p >= 4 d^2
    (Cauchy-Schwarz), so its noncentrality n * divergence is at least 4 n d^2; the test reaches `power` once
    that exceeds lambda*(dof, level, power). The bound holds for every direction of deviation (worst case),
    measured on the merged bins. For two-sample tests pass the effective size n1 n2 / (n1 + n2).
    A law with a single possible outcome is the exception: any deviation puts mass d on impossible outcomes,
    seen with probability 1 - (1 - d)^n.

    Args:
        probs: The law under test (probabilities over the outcomes).
        n: The sample size (for a two-sample test: n1 n2 / (n1 + n2)).
        level: The test's significance level.
        power: The probability of detecting the deviation.
        min_expected: Bins expected to hold fewer samples are merged, as `chisquare_gof` merges them.

    Returns:
        The detectable TV, clipped at 1; inf when the test has no degrees of freedom (nothing can be detected).
    """
    probs = np.asarray(probs, dtype=np.float64).ravel()
    if n <= 0:
        return float("inf")
    if int((probs > 0).sum()) == 1:
        return float(1.0 - (1.0 - power) ** (1.0 / n))
    labels = merge_small_bins(probs * n, min_expected)
    dof = int(labels.max()) if labels.size and labels.max() >= 0 else 0
    if dof < 1:
        return float("inf")
    lam = _ncx2_lambda_for_power(dof, level, power)
    return float(min(1.0, 0.5 * np.sqrt(lam / n)))


def samples_to_detect(
    probs: np.ndarray, tv: float, level: float, power: float = 0.99, min_expected: float = 5.0, max_n: float = 1e12
) -> float:
    """Smallest n (to within 1%) at which `detectable_tv(probs, n, level, power)` is <= tv; inf beyond max_n."""
    if not 0 < tv <= 1:
        raise ValueError(f"tv must lie in (0, 1], got {tv}")
    lo, hi = 1.0, 16.0
    while detectable_tv(probs, hi, level, power, min_expected) > tv:
        lo, hi = hi, hi * 2
        if hi > max_n:
            return float("inf")
    while hi > 1.01 * lo:
        mid = np.sqrt(lo * hi)
        lo, hi = (lo, mid) if detectable_tv(probs, mid, level, power, min_expected) <= tv else (mid, hi)
    return float(np.ceil(hi))


# --- two-sample, PIT and likelihood tests (the generator certificate) -----------------------------------


def chisquare_two_sample(counts_a: np.ndarray, counts_b: np.ndarray, min_expected: float = 5.0) -> GofResult:
    """Chi-square test of homogeneity: are two count vectors (same outcome space) draws from one law?

    Outcomes are merged (by pooled frequency) until every expected cell count is >= min_expected.
    """
    a = np.asarray(counts_a, dtype=np.float64).ravel()
    b = np.asarray(counts_b, dtype=np.float64).ravel()
    if a.shape != b.shape:
        raise ValueError(f"count vectors differ in length: {a.shape} vs {b.shape}")
    na, nb = a.sum(), b.sum()
    if na == 0 or nb == 0:
        return GofResult(0.0, 0, 1.0, int(na + nb), 0)
    pooled = (a + b) / (na + nb)
    labels = merge_small_bins(pooled * min(na, nb), min_expected)
    g = int(labels.max()) + 1
    if g < 2:
        return GofResult(0.0, 0, 1.0, int(na + nb), 0)
    keep = labels >= 0
    table = np.stack(
        [
            np.bincount(labels[keep], weights=a[keep], minlength=g),
            np.bincount(labels[keep], weights=b[keep], minlength=g),
        ]
    )
    stat, pvalue, dof, _ = stats.chi2_contingency(table, correction=False)
    return GofResult(float(stat), int(dof), float(pvalue), int(na + nb), 0)


@dataclass(frozen=True)
class UniformityResult:
    statistic: float  # Kolmogorov-Smirnov distance of the PIT values from U(0, 1)
    pvalue: float
    n: int

    def detectable(self, level: float, power: float = 0.99) -> float:
        """Smallest sup-distance between the PIT law and U(0, 1) detected with `power` (DKW inequality)."""
        if self.n == 0:
            return float("inf")
        crit = stats.kstwo.isf(level, self.n)
        return float(min(1.0, crit + np.sqrt(np.log(2 / (1 - power)) / (2 * self.n))))


def pit_uniformity(u: np.ndarray) -> UniformityResult:
    u = np.asarray(u, dtype=np.float64).ravel()
    if u.size == 0:
        return UniformityResult(0.0, 1.0, 0)
    res = stats.kstest(u, "uniform")
    return UniformityResult(float(res.statistic), float(res.pvalue), int(u.size))


@dataclass(frozen=True)
class LikelihoodResult:
    z: float  # standardized sum of log p(x_t) - E[log p] (negative: the sampler emits less likely tokens)
    pvalue: float  # two-sided
    n: int  # tokens
    mean_excess: float  # mean over tokens of log p(x_t) - E_p[log p] (nats)
    sd_per_token: float  # sqrt(mean conditional variance)
    impossible: int  # tokens with p = 0

    def detectable(self, level: float, power: float = 0.99) -> float:
        """Smallest |mean shift| of log p per token (nats) detected with `power` at `level` (normal approx)."""
        if self.n == 0:
            return float("inf")
        return float((stats.norm.isf(level / 2) + stats.norm.isf(1 - power)) * self.sd_per_token / np.sqrt(self.n))


def loglik_test(logp: np.ndarray, expected: np.ndarray, variance: np.ndarray) -> LikelihoodResult:
    """Test that emitted tokens have the log-likelihood the target expects.

    logp[t] = log p_t(x_t), expected[t] = sum_x p_t(x) log p_t(x), variance[t] = Var_{x ~ p_t}[log p_t(x)].
    Under the null the terms logp - expected are martingale differences with the given conditional variances,
    so Z = sum(logp - expected) / sqrt(sum variance) is asymptotically N(0, 1). A sampler that sharpens the
    distribution (temperature too low) drives Z up, one that flattens it drives Z down.
    """
    logp = np.asarray(logp, dtype=np.float64).ravel()
    expected = np.asarray(expected, dtype=np.float64).ravel()
    variance = np.asarray(variance, dtype=np.float64).ravel()
    n = logp.size
    impossible = int(np.isneginf(logp).sum())
    if n == 0:
        return LikelihoodResult(0.0, 1.0, 0, 0.0, 0.0, 0)
    if impossible:
        return LikelihoodResult(float("-inf"), 0.0, n, float("-inf"), 0.0, impossible)
    total_var = float(variance.sum())
    excess = logp - expected
    if total_var <= 0:  # every conditional is one-hot: the tokens must be exactly those
        bad = bool(np.abs(excess).max() > 1e-9)
        return LikelihoodResult(0.0, 0.0 if bad else 1.0, n, float(excess.mean()), 0.0, 0)
    z = float(excess.sum() / np.sqrt(total_var))
    return LikelihoodResult(
        z, float(2 * stats.norm.sf(abs(z))), n, float(excess.mean()), float(np.sqrt(total_var / n)), 0
    )


@dataclass(frozen=True)
class ToleranceResult:
    """H0: TV(law of the samples, probs) <= tolerance. tv: the observed TV over the bins; slack: the bound on its
    sampling noise's mean, 0.5 sqrt(bins / n)."""

    tv: float
    pvalue: float
    n: int
    bins: int
    tolerance: float
    slack: float
    impossible: int

    def detectable(self, level: float, power: float = 0.99) -> float:
        """The TV (over the bins, so at least that in total) rejected with probability >= power at `level`."""
        if self.n == 0:
            return float("inf")
        eps = np.sqrt(np.log(1 / level) / (2 * self.n)) + np.sqrt(np.log(1 / (1 - power)) / (2 * self.n))
        return float(min(1.0, self.tolerance + 2 * self.slack + eps))


def tolerant_tv_test(counts: np.ndarray, probs: np.ndarray, tolerance: float, max_bins: int = 32) -> ToleranceResult:
    """A test that tolerates a total-variation drift up to `tolerance` (e.g. another engine's numerics), valid for
    any sample law: H0 is TV(P, probs) <= tolerance, not P == probs.

    The outcomes are coarsened to at most `max_bins` bins (the most likely tokens alone, the rest pooled; a
    coarsening never increases TV, so H0 still holds on the bins). With T = TV(empirical, probs) over the bins,
    T <= TV(P, probs) + TV(empirical, P); E TV(empirical, P) <= 0.5 sum_b sqrt(P_b / n) <= 0.5 sqrt(bins / n)
    (Cauchy-Schwarz), and TV(empirical, P) moves by at most 1/n per sample, so McDiarmid gives
    P(T >= tolerance + slack + e) <= exp(-2 n e^2) under H0: the p-value. An observation on a probability-0
    outcome is reported but, under a tolerance, is not by itself a rejection."""
    counts = np.asarray(counts, dtype=np.float64)
    probs = np.asarray(probs, dtype=np.float64)
    n = int(counts.sum())
    if not 0 <= tolerance < 1:
        raise ValueError(f"tolerance must lie in [0, 1), got {tolerance}")
    order = np.argsort(-probs, kind="stable")
    head = order[: max_bins - 1]
    rest = np.ones(probs.shape, dtype=bool)
    rest[head] = False
    p_bins = np.append(probs[head], probs[rest].sum())
    c_bins = np.append(counts[head], counts[rest].sum())
    impossible = int(counts[probs <= 0].sum())
    if n == 0:
        return ToleranceResult(0.0, 1.0, 0, len(p_bins), tolerance, 0.0, 0)
    tv = float(0.5 * np.abs(c_bins / n - p_bins).sum())
    slack = float(0.5 * np.sqrt(len(p_bins) / n))
    excess = max(0.0, tv - tolerance - slack)
    return ToleranceResult(tv, float(np.exp(-2 * n * excess**2)), n, len(p_bins), tolerance, slack, impossible)
