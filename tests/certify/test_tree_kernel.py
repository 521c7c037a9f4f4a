"""The tree certificate (`certify kernel --tree`): verispec's verify_tree PASSES for every rule, every broken tree
verifier FAILS at the default sample size, the lossless look-alike PASSES, and the false-positive rate over many
seeds stays within a binomial bound. Family-wise level DEFAULT_LEVEL = 0.01 (Holm over ~40 chi-square tests)."""

from __future__ import annotations

import pytest
import torch
from scipy import stats

from verispec.certify.bugs import TREE_BUGS, TREE_NON_BUGS, broken_tree_verifier
from verispec.certify.tree_kernel import (
    DEFAULT_TREE_SAMPLES,
    TreeCase,
    certify_tree_kernel,
    default_tree_cases,
    verispec_tree_sampler,
)
from verispec.cli import main
from verispec.sampling.tree import TREE_RULES

# Sizes (rows per case, and the TV to which the first emitted token is then checked at power 0.99 in every case):
# the default certificate, DEFAULT_TREE_SAMPLES = 40k (TV 0.02), in the slow tier; 10k (TV 0.04) in the default
# tier, where every broken tree verifier still FAILS with Holm p-values below 1e-200, at a quarter of the cost.
SIZES = [
    pytest.param(DEFAULT_TREE_SAMPLES, 0.02, marks=pytest.mark.slow, id="40k"),
    pytest.param(10_000, 0.04, id="10k"),
]


@pytest.mark.statistical
@pytest.mark.parametrize("samples, tv", SIZES)
def test_verispec_passes_every_rule(samples, tv):
    report = certify_tree_kernel(verispec_tree_sampler, samples=samples)
    assert report.passed, report.to_markdown()
    assert report.samples_per_case == samples
    assert {c["name"].split("-")[0] for c in report.cases} == {"iid", "without_replacement", "deterministic"}
    first = [t.detectable_tv for t in report.tests if t.test.startswith("pos0")]
    assert max(first) < tv  # the first emitted token is checked to TV `tv` at power 0.99 in every case


@pytest.mark.statistical
@pytest.mark.parametrize("samples, tv", SIZES)
@pytest.mark.parametrize("bug", TREE_BUGS)
def test_broken_tree_verifiers_fail(bug, samples, tv):
    """Each broken tree verifier FAILS at the sizes at which verispec PASSES with the stated strength above."""
    report = certify_tree_kernel(broken_tree_verifier(bug), samples=samples)
    assert not report.passed and report.failing and not report.errors


@pytest.mark.statistical
@pytest.mark.parametrize("samples, tv", SIZES)
@pytest.mark.parametrize("bug", TREE_NON_BUGS)
def test_lossless_look_alike_passes(bug, samples, tv):
    """i.i.d. children verified with the deterministic (target-only) rule: lossless, only less accepted."""
    assert certify_tree_kernel(broken_tree_verifier(bug), rules=("iid",), samples=samples).passed


def _cheap(seed: int, draw: str) -> list[TreeCase]:
    g = torch.Generator().manual_seed(seed)
    C = 1 + 5 + 25
    p = torch.randn(C, 5, generator=g, dtype=torch.float64).mul(1.5).softmax(-1)
    q = torch.randn(C, 5, generator=g, dtype=torch.float64).mul(1.5).softmax(-1)
    return [TreeCase(f"{draw}-cheap", (2, 1), draw, p, q)]


@pytest.mark.statistical
@pytest.mark.parametrize("draw", TREE_RULES)
def test_false_positive_rate_within_binomial_bound(draw):
    """50 seeds of a correct verifier at family-wise level 0.05: FAIL count <= the 99.9% binomial quantile; and
    the same cheap setup catches the stale-residual bug on (almost) every seed."""
    level, seeds = 0.05, 50
    fails = sum(
        not certify_tree_kernel(cases=_cheap(s, draw), samples=2000, level=level, seed=s).passed for s in range(seeds)
    )
    assert fails <= stats.binom.ppf(0.999, seeds, level), fails
    caught = sum(
        not certify_tree_kernel(
            broken_tree_verifier("tree_stale_residual"), cases=_cheap(s, draw), samples=2000, level=level, seed=s
        ).passed
        for s in range(10)
    )
    assert caught >= 9


def test_crash_is_reported():
    def crashing(*args, **kwargs):
        raise RuntimeError("boom")

    report = certify_tree_kernel(crashing, cases=default_tree_cases()[:1], samples=200)
    assert not report.passed and "boom" in report.errors[0]


@pytest.mark.statistical
def test_cli_tree(tmp_path, capsys):
    assert main(["certify", "kernel", "--tree", "deterministic", "--samples", "2000", "--out", str(tmp_path)]) == 0
    assert "PASS" in capsys.readouterr().out
    assert (
        main(
            [
                "certify",
                "kernel",
                "--tree",
                "iid",
                "--inject",
                "tree_stale_residual",
                "--samples",
                "5000",
                "--out",
                str(tmp_path),
            ]
        )
        == 1
    )
    assert main(["certify", "kernel", "--tree", "iid", "--inject", "swap_p_q"]) == 2  # a chain bug: usage error
    assert "not a tree bug" in capsys.readouterr().err


def test_first_position_tests_give_the_tree_certificate_its_strength(tmp_path, capsys):
    """`certify kernel --tree iid --samples 3000` once said PASS with "detects ... TV >= inf": the tree's
    first-position tests ('pos0 | context') were not counted. They are: the stated TV is theirs, and finite."""
    report = certify_tree_kernel(rules=("iid",), samples=3000)
    first = [t.detectable_tv for t in report.tests if t.test == "pos0 | context"]
    assert len(first) == len(report.cases) == 4
    assert report.headline_tv() == max(first) < 0.1 and report.verdict == "PASS"
    md = report.to_markdown()
    assert r"| pos0 \| context |" in md  # the pipe in the test name does not split its cell
    assert {len(line.replace(r"\|", "").split("|")) for line in md.splitlines() if line.startswith("| iid")} == {11}
    assert main(["certify", "kernel", "--tree", "iid", "--samples", "3000", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "PASS" in out and "inf" not in out
