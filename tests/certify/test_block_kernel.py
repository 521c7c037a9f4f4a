"""The kernel certificate of block verification (`certify kernel --verify block`): verify_block PASSES the
completed-sequence laws that every lossless rule keeps, FAILS token-wise verification's one-step laws (which it is
not meant to keep: the sequence laws are needed), each injected block bug FAILS, and the sequence laws' false-positive
rate stays within a binomial bound of the stated level.

Levels: family-wise DEFAULT_LEVEL = 0.01 (Holm over ~130 chi-square tests), as the token-wise certificate.
"""

from __future__ import annotations

import pytest
import torch
from scipy import stats

from verispec.certify.bugs import BLOCK_BUGS, broken_block_verifier
from verispec.certify.kernel import (
    DEFAULT_SAMPLES,
    KernelCase,
    certify_kernel,
    default_cases,
)
from verispec.cli import main
from verispec.sampling import verify_block, verify_chain

# 100k steps per case (the default certificate) in the slow tier, 20k in the default tier: every block bug still
# FAILS there (Holm p <= 1e-12 at seed 0; checked at seeds 0-2 when the battery gained its two block cases)
SIZES = [pytest.param(DEFAULT_SAMPLES, 0.02, marks=pytest.mark.slow, id="100k"), pytest.param(20_000, 0.035, id="20k")]


@pytest.mark.statistical
@pytest.mark.parametrize("samples, tv", SIZES)
def test_block_verification_passes_the_sequence_laws(samples, tv):
    report = certify_kernel(verify_block, samples=samples, laws="sequence")
    assert report.passed, report.to_markdown()
    assert report.laws == "sequence" and "completed sequence" in report.to_markdown()
    assert report.headline_tv() < tv


@pytest.mark.slow
@pytest.mark.statistical
def test_token_wise_verification_passes_the_sequence_laws_too():
    """The sequence laws hold for every lossless rule, not only for block verification."""
    assert certify_kernel(verify_chain, samples=20_000, laws="sequence").passed


@pytest.mark.statistical
def test_block_verification_is_not_token_wise_in_one_step():
    """Its accepted counts follow another law than token-wise verification's: the step laws reject it, which is
    why it is certified by the sequence laws."""
    report = certify_kernel(verify_block, samples=20_000, laws="step")
    assert not report.passed and not report.errors
    assert any(t.test == "num_accepted" for t in report.failing)


# block_plain_residual also FAILS in the known-bugs suite's default run (power >= 0.99) and block_first_rejection in
# test_cli's (random-high-entropy-k4 at 20k): their full-battery 20k runs are slow-tier
@pytest.mark.statistical
@pytest.mark.parametrize("samples, tv", SIZES)
@pytest.mark.parametrize(
    "bug",
    [
        pytest.param(b, marks=pytest.mark.slow) if b in ("block_plain_residual", "block_first_rejection") else b
        for b in BLOCK_BUGS
    ],
)
def test_injected_block_bug_fails(bug, samples, tv):
    report = certify_kernel(broken_block_verifier(bug), samples=samples, laws="sequence")
    assert not report.passed and report.failing and not report.errors


def _cheap_case(seed: int) -> list[KernelCase]:
    g = torch.Generator().manual_seed(seed)
    p = torch.randn(3, 6, generator=g, dtype=torch.float64).softmax(-1)
    q = torch.randn(2, 6, generator=g, dtype=torch.float64).softmax(-1)
    return [KernelCase("cheap-k2", p, q, ragged=True)]


@pytest.mark.statistical
def test_sequence_laws_false_positive_rate_within_binomial_bound():
    """60 seeds of block verification at family-wise level 0.05: FAIL count <= the 99.9% binomial quantile."""
    level, seeds = 0.05, 60
    fails = sum(
        not certify_kernel(
            verify_block, cases=_cheap_case(s), samples=3000, level=level, seed=s, laws="sequence"
        ).passed
        for s in range(seeds)
    )
    assert fails <= stats.binom.ppf(0.999, seeds, level), fails


def test_unknown_laws_are_an_error():
    with pytest.raises(ValueError, match="laws"):
        certify_kernel(verify_chain, cases=default_cases()[:1], samples=1000, laws="block")


@pytest.mark.statistical
def test_cli(tmp_path, capsys):
    out = ["--out", str(tmp_path)]
    assert (
        main(["certify", "kernel", "--verify", "block", "--cases", "small-vocab-k2", "--samples", "20000", *out]) == 0
    )
    assert "PASS (verispec.sampling.block:verify_block)" in capsys.readouterr().out
    bug = ["--inject", "block_first_rejection", "--cases", "random-high-entropy-k4", "--samples", "20000"]
    assert main(["certify", "kernel", "--verify", "block", *bug, *out]) == 1
    assert "FAIL" in capsys.readouterr().out
    assert main(["certify", "kernel", "--inject", "block_first_rejection", *out]) == 2  # needs --verify block
    assert main(["certify", "kernel", "--verify", "block", "--inject", "swap_p_q", *out]) == 2
    assert main(["certify", "kernel", "--verify", "block", "--tree", "iid", *out]) == 2
    assert "applies to chains" in capsys.readouterr().err
    small = ["--cases", "small-vocab-k2", "--samples", "20000"]
    assert main(["certify", "kernel", "--coupling", "gumbel", *small, *out]) == 0
    assert "PASS (verispec.sampling.coupling:gumbel_verifier)" in capsys.readouterr().out
    assert main(["certify", "kernel", "--coupling", "gumbel", "--inject", "gumbel_position_unkeyed", *small, *out]) == 1
    assert main(["certify", "kernel", "--seeding", "position", *small, *out]) == 0
    assert "PASS (verispec.sampling.positional:positional_verifier)" in capsys.readouterr().out
    assert main(["certify", "kernel", "--seeding", "position", "--verify", "block", *out]) == 2
