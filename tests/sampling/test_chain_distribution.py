"""Distributional tests of verify_chain: chi-square goodness of fit per emitted position.

Significance: every single chi-square test rejects at LEVEL = 1e-4 (bins merged to expected counts >= 5).
A case runs ~12 tests, the file ~150, so a correct sampler fails the file with probability <= 1.5% over
seeds; the seeds are fixed, so the outcome is reproducible.
Power: `test_sample_size_has_power` computes, for the broken rules whose output law is known in closed
form, the power of the position-0 test at the sample size used here (>= 0.99 required), and
`test_broken_samplers_fail` shows each broken rule failing the very same test battery.
"""

from __future__ import annotations

import zlib

import pytest
import torch
import torch.nn.functional as F

from verispec.certify.stats import chisquare_power, detectable_tv
from verispec.sampling import SamplingParams, probs_from_logits, verify_chain

from ..helpers.chain_harness import LEVEL, broken_verify, failing, position_tests, run_case

V = 16
N = 200_000


def correct(target, ids, draft_probs, num_draft):
    return verify_chain(target, ids, draft_probs, num_draft)


def dist(logits: torch.Tensor) -> torch.Tensor:
    return logits.softmax(-1)


def make_case(name: str, k: int, v: int = V, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    p = dist(2 * torch.randn(k + 1, v, generator=g))
    q = dist(2 * torch.randn(k, v, generator=g))
    onehot = None
    if name == "random":
        pass
    elif name == "adversarial":  # q proportional to 1/p: the draft prefers what the target dislikes
        q = (1 / p[:k]) / (1 / p[:k]).sum(-1, keepdim=True)
    elif name == "disjoint_zeros":  # q = 0 where p > 0 and p = 0 where q > 0, on different tokens
        p[:, : v // 4] = 0
        q[:, v // 4 : v // 2] = 0
        p, q = p / p.sum(-1, keepdim=True), q / q.sum(-1, keepdim=True)
    elif name == "equal":
        q = p[:k].clone()
    elif name == "onehot":  # deterministic drafts: a likely token, a p = 0 token, an unlikely one, ...
        zero_pos = min(1, k - 1)
        p[zero_pos, 3] = 0
        p = p / p.sum(-1, keepdim=True)
        choices = [int(p[0].argmax()), 3, int(p[min(2, k)].argmin()), 5, 7, 9, 11, 13][:k]
        choices[zero_pos] = 3
        onehot = torch.tensor(choices)
        q = None
    elif name == "truncated":  # top-k / top-p applied to both, with the same params and function
        params = SamplingParams(temperature=0.8, top_k=8, top_p=0.9)
        p = probs_from_logits(2 * torch.randn(1, k + 1, v, generator=g), params)[0]
        q = probs_from_logits(2 * torch.randn(1, k, v, generator=g), params)[0]
    else:
        raise ValueError(name)
    return p, q, onehot


CASES = [
    ("random", 4, False),
    ("random", 1, False),
    ("random", 4, True),
    ("adversarial", 4, False),
    ("disjoint_zeros", 4, False),
    ("disjoint_zeros", 1, True),
    ("equal", 4, False),
    ("equal", 4, True),
    ("onehot", 4, False),
    ("onehot", 1, True),
    ("truncated", 4, False),
    ("truncated", 4, True),
]


@pytest.mark.statistical
@pytest.mark.parametrize("name,k,ragged", CASES, ids=[f"{c}-k{k}{'-ragged' if r else ''}" for c, k, r in CASES])
def test_emitted_tokens_follow_target(name, k, ragged):
    p, q, onehot = make_case(name, k)
    n = N if (name, k, ragged) == ("random", 4, False) else N // 4
    tok, na, nd = run_case(
        correct, p, q, n, onehot_ids=onehot, ragged=ragged, seed=zlib.crc32(name.encode()) % 1000 + k
    )
    results = position_tests(p, q, tok, na, nd, onehot_ids=onehot)
    assert failing(results) == []
    assert all(r.impossible == 0 for r in results.values())


@pytest.mark.statistical
def test_larger_vocabulary():
    p, q, _ = make_case("random", 4, v=64, seed=3)
    tok, na, nd = run_case(correct, p, q, N, seed=11)
    assert failing(position_tests(p, q, tok, na, nd)) == []


BUGS = ["resample_from_p", "resample_from_abs_diff", "swap_p_q", "reuse_accept_uniform"]


@pytest.mark.statistical
def test_harness_control_passes():
    """The test-side reimplementation without a bug passes: failures below are the bugs, not the harness."""
    p, q, _ = make_case("random", 4)
    tok, na, nd = run_case(lambda t, i, d, n: broken_verify(None)(t, i, d, n), p, q, N, seed=5)
    assert failing(position_tests(p, q, tok, na, nd)) == []


@pytest.mark.statistical
@pytest.mark.parametrize("bug", BUGS)
def test_broken_samplers_fail(bug):
    p, q, _ = make_case("random", 4)
    tok, na, nd = run_case(lambda t, i, d, n: broken_verify(bug)(t, i, d, n), p, q, N, seed=5)
    assert failing(position_tests(p, q, tok, na, nd)) != []


def _analytic_output(p, q, bug):  # position-0 output law of a broken rule, p [V], q [V] (float64)
    if bug == "swap_p_q":
        acc = q * torch.minimum(torch.ones_like(q), q / p.clamp_min(1e-300))
        w = (q - p).clamp_min(0)
    else:
        acc = torch.minimum(p, q)
        w = p if bug == "resample_from_p" else (p - q).abs()
    return acc + (1 - acc.sum()) * w / w.sum()


@pytest.mark.parametrize("bug", ["resample_from_p", "resample_from_abs_diff", "swap_p_q"])
def test_sample_size_has_power(bug):
    p, q, _ = make_case("random", 4)
    p0, q0 = p[0].double(), q[0].double()
    alt = _analytic_output(p0, q0, bug)
    assert (alt - p0).abs().sum() > 0.01  # the bug is a real deviation on this case
    assert chisquare_power(p0.numpy(), alt.numpy(), N, LEVEL) >= 0.99
    assert chisquare_power(p0.numpy(), p0.numpy(), N, LEVEL) == pytest.approx(LEVEL, rel=1e-6)


@pytest.mark.statistical
def test_emitted_count_matches_theory():
    """Mean tokens per step equals (1 - a^(k+1)) / (1 - a) when every position has acceptance a."""
    from verispec.sampling import acceptance_rate, expected_tokens_per_pass

    p, q, _ = make_case("random", 4, seed=7)
    q = p[0:1].expand(4, V).clone()  # same q at every position ...
    p = p[0:1].expand(5, V).clone() * 0 + q[0:1] * 0.5 + dist(torch.zeros(1, V)) * 0.5  # ... and same p
    a = float(acceptance_rate(p[0], q[0]))
    _, na, _ = run_case(correct, p, q, N, seed=9)
    emitted = (na + 1).double()
    tau = expected_tokens_per_pass(a, 4)
    se = float(emitted.std()) / N**0.5
    assert abs(float(emitted.mean()) - tau) < 5 * se


def test_greedy_target_is_exact_match():
    """A one-hot target (temperature 0) accepts exactly the drafts equal to its argmax, for any uniforms."""
    g = torch.Generator().manual_seed(1)
    B, k = 512, 4
    logits = torch.randn(B, k + 1, V, generator=g)
    p = probs_from_logits(logits, SamplingParams(temperature=0))
    argmax = logits.argmax(-1)  # [B, k+1]
    ids = torch.where(torch.rand(B, k, generator=g) < 0.7, argmax[:, :k], torch.randint(0, V, (B, k), generator=g))
    q = F.one_hot(ids, V).float() * 0.6 + 0.4 / V  # a sampling draft: q(t) > 0 everywhere
    out = verify_chain(p, ids, q)
    match = (ids == argmax[:, :k]).long().cumprod(1).sum(1)
    assert torch.equal(out.num_accepted, match)
    for b in range(B):
        n = int(match[b])
        assert out.token_ids[b, : n + 1].tolist() == argmax[b, : n + 1].tolist()


@pytest.mark.slow
@pytest.mark.statistical
def test_large_sample_large_vocabulary():
    """Slow tier, verify_chain's full-power law test: V = 128, k = 8, 2M trials (the first position's law checked to
    TV 0.004 at power 0.99, asserted). The adversarial and truncated cases are the default tier's (above, and the
    kernel certificate's adversarial-k4 and truncated-k4)."""
    p, q, onehot = make_case("random", 8, v=128, seed=21)
    n = 2_000_000
    assert detectable_tv(p[0].double().numpy(), n, LEVEL, 0.99) < 0.0041
    tok, na, nd = run_case(correct, p, q, n, onehot_ids=onehot, seed=23)
    assert failing(position_tests(p, q, tok, na, nd, onehot_ids=onehot)) == []
