"""`verispec certify known-bugs`: every reproduced engine bug FAILS, every verispec control PASSES.

Each bug row is a real hypothesis test at family-wise level 0.01 (Holm over the kernel certificate's chi-square
tests; the tail test is one exact binomial test), sized per bug so that its power to FAIL is >= 0.99 (stated in
verispec.certify.known_bugs: every chain bug >= 0.9999 at its default size, the tail test 0.9927); the slow tier
re-estimates those powers from a run at 5x the default sizes and runs the full sizes.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from scipy import stats

from verispec.certify.bugs import EXP_FLOOR, broken_verifier, fp32_exponential_race, raw_q
from verispec.certify.kernel import TestRow as Row
from verispec.certify.kernel import certify_kernel, default_cases
from verispec.certify.known_bugs import (
    KNOWN_BUGS,
    TAIL,
    TAIL_DRAWS,
    KnownBugRow,
    binomial_power,
    estimated_power,
    run_known_bugs,
    tail_test,
)
from verispec.cli import main
from verispec.sampling import verify_chain

BUG_NAMES = [b.name for b in KNOWN_BUGS if b.expected == "FAIL"]
CONTROL_NAMES = [b.name for b in KNOWN_BUGS if b.expected == "PASS"]
# The float64 race is a second exact control of the tail test (12-30 s on 2 cores); the default tier keeps
# sample_from_weights as the tail test's exact control and leaves the float64 race to the slow tier's full run.
DEFAULT_TIER = [b.name for b in KNOWN_BUGS if b.name != "race_winner_fp64"]


@pytest.fixture(scope="module")
def default_report():
    return run_known_bugs(only=DEFAULT_TIER)


@pytest.mark.statistical
def test_default_run_every_bug_fails_and_every_control_passes(default_report):
    r = default_report
    assert r.ok, r.to_markdown()
    assert [row.name for row in r.rows] == DEFAULT_TIER
    assert len(BUG_NAMES) == 10 and len(CONTROL_NAMES) == 6
    for row in r.rows:
        assert row.verdict == row.expected, row
        if row.expected == "FAIL":
            assert not row.errors and row.min_holm_pvalue < r.level  # a statistical rejection, not a crash
        else:
            assert row.min_holm_pvalue >= r.level
    tail = next(row for row in r.rows if row.name == "fp32_exponential_race").tail
    assert tail["draws"] == TAIL_DRAWS and tail["expected_hits"] == pytest.approx(12.94, abs=0.01)
    assert tail["power"] == pytest.approx(0.9927, abs=1e-4)


def test_default_report_markdown_and_strict_json(default_report, tmp_path):
    from verispec.certify.known_bugs import write_report

    md, js = write_report(default_report, tmp_path)
    text = md.read_text()
    assert "| bug | engine | reference | expected | verdict | p-value | samples |" in text
    assert "[huggingface/transformers#47932](https://github.com/huggingface/transformers/issues/47932)" in text
    data = json.loads(js.read_text(), parse_constant=_no_constant)
    assert data["ok"] is True and len(data["rows"]) == len(DEFAULT_TIER)


def _no_constant(name):
    raise AssertionError(f"invalid JSON constant {name}")


def test_cli_only_two_entries(tmp_path, capsys):
    argv = ["certify", "known-bugs", "--only", "wrong_q_raw_logits,verify_chain", "--out", str(tmp_path)]
    assert main(argv) == 0
    data = json.loads((tmp_path / "known-bugs.json").read_text(), parse_constant=_no_constant)
    assert [(r["name"], r["verdict"], r["ok"]) for r in data["rows"]] == [
        ("wrong_q_raw_logits", "FAIL", True),
        ("verify_chain", "PASS", True),
    ]
    assert data["ok"] is True
    assert "wrong_q_raw_logits" in capsys.readouterr().out  # the printed table
    # an underpowered override: the bug no longer FAILS (a PASS or INCONCLUSIVE where FAIL was expected), exit 1
    argv = ["certify", "known-bugs", "--only", "fp32_exponential_race", "--tail-draws", "200", "--out", str(tmp_path)]
    assert main(argv) == 1
    row = json.loads((tmp_path / "known-bugs.json").read_text())["rows"][0]
    assert row["verdict"] == "INCONCLUSIVE" and not row["ok"]


def test_unknown_only_name_is_a_clear_usage_error(capsys, tmp_path):
    assert main(["certify", "known-bugs", "--only", "verify_chain,not_a_bug", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "unknown known-bugs entry not_a_bug" in err and "known: resample_from_p" in err
    with pytest.raises(SystemExit) as e:  # below 100 steps per case: argparse's own error
        main(["certify", "known-bugs", "--samples", "10"])
    assert e.value.code == 2
    with pytest.raises(ValueError, match="unknown known-bugs"):
        run_known_bugs(only=["nope"])


def _random_step(seed: int, B: int = 64, k: int = 4, V: int = 12, zeros: bool = True):
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(2 * torch.randn(B, k + 1, V, generator=g, dtype=torch.float64), -1)
    q = torch.softmax(2 * torch.randn(B, k, V, generator=g, dtype=torch.float64), -1)
    if zeros:  # top-k-like: q = 0 outside each row's 6 most likely tokens
        q = torch.where(q >= q.topk(6, -1).values[..., -1:], q, 0.0)
        q = q / q.sum(-1, keepdim=True)
    ids = torch.multinomial(q.reshape(-1, V), 1, generator=g).view(B, k)
    nd = torch.randint(0, k + 1, (B,), generator=g)
    return p, ids, q, nd


@pytest.mark.parametrize("bug", ["bonus_ignores_temperature", "wrong_q_raw_logits"])
@pytest.mark.parametrize("onehot", [False, True])
def test_new_bug_samplers_have_verify_chain_output_structure(bug, onehot):
    p, ids, q, nd = _random_step(1)
    q = None if onehot else q
    gens = [torch.Generator().manual_seed(10 + b) for b in range(len(nd))]
    out = broken_verifier(bug)(p, ids, q, nd, generators=gens)
    ref = verify_chain(p, ids, q, nd, generators=[torch.Generator().manual_seed(10 + b) for b in range(len(nd))])
    assert type(out) is type(ref)
    assert out.token_ids.shape == ref.token_ids.shape and out.token_ids.dtype == torch.int64
    assert out.num_accepted.shape == ref.num_accepted.shape and out.num_accepted.dtype == torch.int64
    na, tok = out.num_accepted, out.token_ids
    assert bool(((na >= 0) & (na <= nd)).all())
    pos = torch.arange(ids.shape[1] + 1)
    assert bool((tok[:, :-1][pos[:-1] < na.unsqueeze(1)] == ids[pos[:-1] < na.unsqueeze(1)]).all())
    assert bool((tok[pos > na.unsqueeze(1)] == -1).all())
    final = tok.gather(1, na.unsqueeze(1)).squeeze(1)
    assert bool(((final >= 0) & (final < p.shape[-1])).all())
    if bug == "bonus_ignores_temperature":  # the same uniforms: accepted / recovered positions as verify_chain's
        torch.testing.assert_close(na, ref.num_accepted)
        rejected = na < nd
        torch.testing.assert_close(tok[rejected], ref.token_ids[rejected])


def test_raw_q_moves_mass_to_the_tokens_top_k_cut():
    q = _random_step(2)[2]
    r = raw_q(q)
    torch.testing.assert_close(r.sum(-1), torch.ones_like(r.sum(-1)))  # q has zeros: raw q is a distribution
    torch.testing.assert_close(r[q > 0], 0.8 * q[q > 0])
    full = torch.softmax(torch.randn(3, 7, dtype=torch.float64), -1)
    torch.testing.assert_close(raw_q(full), 0.8 * full)  # no zeros: sub-normalised, as the rule only reads q_raw


def test_fp32_race_floor_and_shape():
    w = torch.rand(50, 9, dtype=torch.float64)
    w[:, 3] = 0
    tok = fp32_exponential_race(w)
    assert tok.shape == (50,) and tok.dtype == torch.int64 and not bool((tok == 3).any())
    assert TAIL.ratio < EXP_FLOOR and TAIL.floored_mass / TAIL.exact_mass == pytest.approx(5 * math.exp(-4), rel=1e-3)


def test_estimated_power_formulas():
    rows = [
        Row("c", "pos0", 1000, 131.0, 31, 1e-9, 0, 0.1),  # noncentrality 0.1 per sample
        Row("c", "recovered0", 100, float("inf"), 0, 0.0, 5, 0.1),  # 5 impossible outcomes in 1000 samples
    ]
    chi = stats.ncx2.sf(stats.chi2.isf(0.01, 31), 31, 0.1 * 400)  # one test: the level itself
    assert estimated_power(rows[:1], 400, samples=1000, level=0.01) == pytest.approx(chi)
    per_test = 0.01 / 2  # two tests: Holm's first step
    assert estimated_power(rows, 100, samples=1000, level=0.01) == pytest.approx(
        max(1 - 0.995**100, stats.ncx2.sf(stats.chi2.isf(per_test, 31), 31, 10))
    )
    with pytest.raises(ValueError, match="samples="):
        estimated_power(rows, 100)
    report = certify_kernel(broken_verifier("resample_from_p"), cases=default_cases()[3:4], samples=500)
    assert estimated_power(report, 500) > 0.999
    tail = KnownBugRow(
        "t",
        "e",
        "r",
        "w",
        "tail",
        "FAIL",
        "FAIL",
        0.0,
        10,
        0.0,
        True,
        0.01,
        tail=tail_test(lambda w: w[:, 0].long(), 10),
    )
    assert estimated_power(tail, TAIL_DRAWS) == pytest.approx(
        binomial_power(TAIL_DRAWS, TAIL.exact_mass, TAIL.floored_mass, 0.01)
    )
    assert binomial_power(1000, 0.5, 0.5, 0.01) < 0.01  # no effect: power is the test's size


# --- slow tier -------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.statistical
def test_default_sizes_have_power_estimated_at_five_times_the_size():
    """From a run at 5x each bug's default size, the estimated power at the default size is >= 0.99 for every bug
    (chain bugs: noncentral chi-square / impossible-outcome rates; the tail: exact binomial power against the
    floored race, whose derived tail mass the 5x run must also agree with)."""
    report = run_known_bugs(only=BUG_NAMES, scale=5)
    assert report.ok, report.to_markdown()
    defaults = {b.name: b.samples for b in KNOWN_BUGS}
    for row in report.rows:
        assert estimated_power(row, defaults[row.name]) >= 0.99, row.name
    t = next(row for row in report.rows if row.name == "fp32_exponential_race").tail
    assert stats.binomtest(t["hits"], t["draws"], TAIL.floored_mass).pvalue > 1e-3  # the derived floored mass


@pytest.mark.slow
@pytest.mark.statistical
def test_full_sizes():
    report = run_known_bugs(full=True)
    assert report.ok, report.to_markdown()
    assert [row.name for row in report.rows] == [b.name for b in KNOWN_BUGS]  # the float64 race control included
    assert all(len(r.cases) == len(default_cases()) for r in report.rows if r.kind != "tail")
