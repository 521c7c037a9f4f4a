"""The tree certificate (`certify kernel --tree`): verispec's verify_tree PASSES for every rule (mixed included),
every broken tree verifier FAILS at the default sample size, the lossless look-alikes PASS, and the false-positive
rate over many seeds stays within a binomial bound. Family-wise level DEFAULT_LEVEL = 0.01 (Holm over ~40 chi-square
tests per battery of rules). The broken mixed verifiers are also checked exactly, on one mixed root."""

from __future__ import annotations

import pytest
import torch
from scipy import stats

import verispec.sampling.tree as tree_module
from verispec.certify.bugs import TREE_BUGS, TREE_NON_BUGS, broken_tree_verifier
from verispec.certify.tree_kernel import (
    DEFAULT_TREE_SAMPLES,
    TreeCase,
    certify_tree_kernel,
    default_tree_cases,
    draft_trees,
    mixed_case,
    mixed_layout,
)
from verispec.cli import main
from verispec.sampling.tree import TREE_RULES, VERIFY_RULES, verify_tree

from ..helpers.mixed_root import MIX_P, mixed_root_law

# the rules whose cases each broken verifier is certified on: the mixed bugs break only rule "mixed" (the other
# rules' cases would only add cost); the older bugs on the three drafting rules, as before, the stale residual on
# every rule
BUG_RULES = {bug: ("mixed",) if bug.startswith("tree_mixed") else TREE_RULES for bug in TREE_BUGS}
BUG_RULES["tree_stale_residual"] = VERIFY_RULES
NON_BUG_RULES = {"tree_iid_as_deterministic": ("iid",), "tree_mixed_sampled_as_chosen": ("mixed",)}

# Sizes (rows per case, and the TV to which the first emitted token is then checked at power 0.99 in every case):
# the default certificate, DEFAULT_TREE_SAMPLES = 40k (TV 0.02), in the slow tier; 10k (TV 0.04) in the default
# tier, where every broken tree verifier still FAILS with Holm p-values below 1e-100 (tree_mixed_dedup: 1e-131, on
# mixed-ccss-cs; the others below 1e-200), at a quarter of the cost.
SIZES = [
    pytest.param(DEFAULT_TREE_SAMPLES, 0.02, marks=pytest.mark.slow, id="40k"),
    pytest.param(10_000, 0.04, id="10k"),
]


@pytest.mark.statistical
@pytest.mark.parametrize("samples, tv", SIZES)
def test_verispec_passes_every_rule(samples, tv):
    report = certify_tree_kernel(verify_tree, samples=samples)
    assert report.passed, report.to_markdown()
    assert report.samples_per_case == samples
    assert {c["name"].split("-")[0] for c in report.cases} == {"iid", "without_replacement", "deterministic", "mixed"}
    assert sum(c["name"].startswith("mixed-") for c in report.cases) == 5  # chosen and sampled children mixed
    first = [t.detectable_tv for t in report.tests if t.test.startswith("pos0")]
    assert max(first) < tv  # the first emitted token is checked to TV `tv` at power 0.99 in every case


@pytest.mark.statistical
@pytest.mark.parametrize("samples, tv", SIZES)
@pytest.mark.parametrize("bug", TREE_BUGS)
def test_broken_tree_verifiers_fail(bug, samples, tv):
    """Each broken tree verifier FAILS at the sizes at which verispec PASSES with the stated strength above."""
    report = certify_tree_kernel(broken_tree_verifier(bug), rules=BUG_RULES[bug], samples=samples)
    assert not report.passed and report.failing and not report.errors


@pytest.mark.statistical
@pytest.mark.parametrize("samples, tv", SIZES)
@pytest.mark.parametrize("bug", TREE_NON_BUGS)
def test_lossless_look_alike_passes(bug, samples, tv):
    """Sampled children verified with the deterministic (target-only) rule — all i.i.d. ones, or those of a mixed
    tree: lossless, only less accepted."""
    report = certify_tree_kernel(broken_tree_verifier(bug), rules=NON_BUG_RULES[bug], samples=samples)
    assert report.passed, report.to_markdown()


def _cheap(seed: int, draw: str) -> list[TreeCase]:
    g = torch.Generator().manual_seed(seed)
    C = 1 + 5 + 25
    p = torch.randn(C, 5, generator=g, dtype=torch.float64).mul(1.5).softmax(-1)
    q = torch.randn(C, 5, generator=g, dtype=torch.float64).mul(1.5).softmax(-1)
    if draw == "mixed":  # a chosen and a sampled child at the root, one child below each
        return [mixed_case("mixed-cheap", ("cs", "s/c"), p, q)]
    return [TreeCase(f"{draw}-cheap", (2, 1), draw, p, q)]


# ~4 s per rule on 2 cores: sampled children without replacement and the mixed layout in the default tier, iid and
# deterministic (whose tree certificates PASS at 10k in the default tier) in the slow tier
FPR_DEFAULT_RULES = ("without_replacement", "mixed")


@pytest.mark.statistical
@pytest.mark.parametrize(
    "draw", [d if d in FPR_DEFAULT_RULES else pytest.param(d, marks=pytest.mark.slow) for d in VERIFY_RULES]
)
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


def test_mixed_layout():
    """mixed_layout: per depth the children's kinds ('S/C': below sampled / chosen nodes), breadth-first or with
    the sampled nodes first (CombinedProposer's numbering)."""
    assert mixed_layout(("scc", "s/c")) == (
        [-1, -1, -1, 0, 1, 2],
        [True, False, False, True, False, False],
        [-1, 0, 1, -1, 0, 0],
    )
    assert mixed_layout(("scc", "s/c"), sampled_first=True)[:2] == (
        [-1, 0, -1, -1, 2, 3],
        [True, True, False, False, False, False],
    )
    with pytest.raises(ValueError, match="hangs below a chosen one"):
        mixed_layout(("cs", "s"), sampled_first=True)
    for bad in (("s/c",), ("sx",), ("s", "s/c/s")):
        with pytest.raises(ValueError, match="kinds are"):
            mixed_layout(bad)
    with pytest.raises(ValueError, match="kinds per depth"):
        TreeCase("bad", (2,), "mixed", torch.ones(7, 6) / 6, torch.ones(7, 6) / 6)


def test_mixed_cases_draw_the_declared_trees():
    """Each mixed case's trees: the layout's parents and kinds; the root's chosen children are the top of q (or the
    case's fixed ranking), the same in every row; sampled children repeat a chosen sibling in a good share of the
    rows; q only for the sampled nodes' slots under CombinedProposer's order."""
    shared = {}
    for case in (c for c in default_tree_cases() if c.draw == "mixed"):
        tree = draft_trees(case, 3000, torch.Generator().manual_seed(0))
        ids = tree["draft_token_ids"]
        parents, kinds, _ = mixed_layout(case.mix, case.sampled_first)
        assert tree["parents"][0].tolist() == parents and tree["sampled"][0].tolist() == kinds
        assert ids.shape[1] == case.num_nodes
        S = max(p + 2 for p, k in zip(parents, kinds) if k) if case.sampled_first else len(parents) + 1
        assert tree["draft_probs"].shape[1] == S
        order = case.q[0].argsort(descending=True) if case.ranking is None else case.ranking[0]
        chosen = [n for n, (p, k) in enumerate(zip(parents, kinds)) if p == -1 and not k]
        drawn = [n for n, (p, k) in enumerate(zip(parents, kinds)) if p == -1 and k]
        assert ids[:, chosen].tolist() == [order[: len(chosen)].tolist()] * len(ids)
        twin = (ids[:, drawn].unsqueeze(2) == ids[:, chosen].unsqueeze(1)).any(2).any(1)
        shared[case.name] = float(twin.double().mean())
    assert len(shared) == 5 and min(shared.values()) > 0.05, shared


def test_the_sampler_gets_sampled_for_mixed_cases_only():
    calls = []

    def spy(*args, rule, **kw):
        calls.append((rule, kw.get("sampled")))
        return verify_tree(*args, rule=rule, **kw)

    cases = [c for c in default_tree_cases() if c.name in ("iid-4-1", "mixed-ccss-cs")]
    assert certify_tree_kernel(spy, cases=cases, samples=500).passed
    assert [(rule, s is None) for rule, s in calls] == [("iid", True), ("mixed", False)]
    assert calls[1][1].shape == (500, 12) and calls[1][1].dtype == torch.bool


def _with_uniforms(bug: str, monkeypatch):
    """A broken tree verifier driven by explicit uniforms (mixed_root_law's), through verify_tree's draw."""
    verify = broken_tree_verifier(bug)

    def run(target, ids, parents, draft, nn, sampled, accept_u, final_u):
        monkeypatch.setattr(tree_module, "draw_uniforms", lambda *args: (accept_u, final_u))
        return verify(target, ids, parents, draft, nn, rule="mixed", sampled=sampled)

    return run


@pytest.mark.parametrize(
    "bug, lossless",
    [
        ("tree_mixed_dedup", {True: False, False: True}),  # drops only a sampled child after a chosen twin
        ("tree_mixed_chosen_as_sampled", {True: False, False: False}),
        ("tree_mixed_sampled_as_chosen", {True: True, False: True}),  # not a bug
    ],
)
def test_broken_mixed_verifiers_exactly(bug, lossless, monkeypatch):
    """The exact law of the first token on a mixed root (a chosen and a sampled child, which share their token
    with probability q(0)): p for verispec (tests/sampling/test_tree.py), and here for each broken verifier — p
    exactly when it is lossless on that order (chosen first / sampled first)."""
    for chosen_first in (True, False):
        law = mixed_root_law(_with_uniforms(bug, monkeypatch), chosen_first=chosen_first)
        assert sum(law) == 1 and (law == list(MIX_P)) == lossless[chosen_first], (chosen_first, law)


@pytest.mark.statistical
def test_cli_tree_mixed(tmp_path, capsys):
    assert main(["certify", "kernel", "--tree", "mixed", "--samples", "2000", "--out", str(tmp_path)]) == 0
    assert "PASS" in capsys.readouterr().out
    for bug in ("tree_mixed_dedup", "tree_mixed_chosen_as_sampled"):
        argv = ["certify", "kernel", "--tree", "mixed", "--inject", bug, "--samples", "4000", "--out", str(tmp_path)]
        assert main(argv) == 1
        assert "FAIL" in capsys.readouterr().out
