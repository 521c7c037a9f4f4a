"""The draft-length controller (`engine.adaptive`) and its step costs (`engine.costs`), on synthetic costs and
simulated drafters: no timing involved. The simulation runs the controller's own choices against a known cost curve
and a drafter whose acceptance is known, and compares the time taken with plain decoding and with the best fixed
gamma (the oracle)."""

from __future__ import annotations

import random

import pytest

from verispec.drafting import Signal
from verispec.engine import adaptive
from verispec.engine.adaptive import GammaController, expected_tokens
from verispec.engine.config import SpecConfig
from verispec.engine.costs import StepCosts
from verispec.sampling import expected_tokens_per_pass, speedup_cost_curve

MEMORY_BOUND = [1.0 + 0.06 * n for n in range(65)]  # T(n + 1): the fast runner at batch 1
COMPUTE_BOUND = [1.0 + 0.75 * n for n in range(65)]  # llama.cpp's Q4 kernels on 2 cores


def simulate(controller, curve, alpha, steps=3000, draft_cost=0.0, bucket=None, seed=0, depth=64):
    """Tokens per second of `steps` steps with the controller choosing (one row, batch 1): each drafted token is kept
    with probability alpha (a list: per bucket drawn per step) while the ones before it were; the step costs
    curve[g] + g * draft_cost, and the controller observes what happened. Plain decoding: 1 / curve[0]."""
    rng, row, tokens, seconds = random.Random(seed), {}, 0, 0.0
    for _ in range(steps):
        b = bucket(rng) if bucket else None
        a = alpha[b] if isinstance(alpha, dict) else alpha
        source, g = controller.choose(row, [Signal(b, depth)], cap=64)
        accepted = 0
        while accepted < g and rng.random() < a:
            accepted += 1
        cost = curve[g] + g * draft_cost
        if g:
            controller.observe_draft(g * draft_cost, g)
            controller.observe_acceptance(row, source, b, g, accepted)
        controller.observe_verify(g + 1, cost)
        tokens, seconds = tokens + accepted + 1, seconds + cost
    return tokens / seconds


def oracle(curve, alpha, draft_cost=0.0, gammas=(0, 1, 2, 4, 8)) -> float:
    """Tokens per second of the best fixed gamma, by theory."""
    return max(speedup_cost_curve(alpha, g, draft_cost, curve) / curve[0] if g else 1 / curve[0] for g in gammas)


def test_expected_tokens_is_the_theory_for_one_alpha():
    for a in (0.0, 0.3, 0.8):
        for g in (0, 1, 4, 8):
            assert expected_tokens([a] * 3, g) == pytest.approx(expected_tokens_per_pass(a, g))
    assert expected_tokens([0.5, 1.0, 1.0], 3) == pytest.approx(1 + 0.5 * 3)  # depth-wise alphas


@pytest.mark.parametrize("curve", [MEMORY_BOUND, COMPUTE_BOUND], ids=["memory-bound", "compute-bound"])
def test_a_drafter_that_shows_nothing_costs_at_most_a_few_percent(curve):
    """Never slower: alpha = 0 (a drafter whose drafts are never kept) runs at >= 0.97x plain decoding, from a cold
    start (no costs, no evidence) with the runner's prior slope."""
    c = GammaController("auto", slope=0.25 if curve is MEMORY_BOUND else 0.75)
    rate = simulate(c, curve, 0.0, steps=2000)
    assert rate >= 0.97 / curve[0]
    assert c.counters["probe_cost_s"] <= 0.02 * 2000 * curve[0] + curve[0]  # the probe budget held


def test_the_budget_bounds_probes_that_never_stop(monkeypatch):
    """A controller whose optimism never ends (a huge spread) still stays within the budget; without the budget the
    same controller loses more than 3% (the budget is what the never-slower test rests on, not luck)."""
    monkeypatch.setattr(adaptive, "Z_PROBE", 1e6)
    bounded = GammaController("auto", slope=0.75)
    assert simulate(bounded, COMPUTE_BOUND, 0.0, steps=2000) >= 0.97
    unbounded = GammaController("auto", slope=0.75, probe_budget=1.0)
    assert simulate(unbounded, COMPUTE_BOUND, 0.0, steps=2000) < 0.97


@pytest.mark.parametrize(
    "curve,alpha,draft_cost",
    [(MEMORY_BOUND, 0.8, 0.0), (MEMORY_BOUND, 0.5, 0.1), (COMPUTE_BOUND, 0.9, 0.0), (MEMORY_BOUND, 0.3, 0.0)],
)
def test_close_to_the_best_fixed_gamma(curve, alpha, draft_cost):
    """Close to the oracle: >= 0.9x the tokens/s of the best of plain and gamma 1, 2, 4, 8 (theory), from a cold
    start, over 3000 steps."""
    c = GammaController("auto", slope=0.25)
    rate = simulate(c, curve, alpha, draft_cost=draft_cost)
    assert rate >= 0.9 * oracle(curve, alpha, draft_cost)
    assert rate >= 0.97 / curve[0]


def test_buckets_separate_good_matches_from_bad():
    """A drafter whose signal tells good drafts (bucket "hit", alpha 0.95) from bad ones ("miss", alpha 0.02) on a
    compute-bound curve: drafts on hits, decodes plainly on misses, and beats both plain decoding and every fixed
    gamma (which sees one alpha for all steps: nothing pays at alpha 0.485)."""
    alpha = {"hit": 0.95, "miss": 0.02}

    def bucket(rng):
        return "hit" if rng.random() < 0.5 else "miss"

    c = GammaController("auto", slope=0.75)
    rate = simulate(c, COMPUTE_BOUND, alpha, bucket=bucket)
    assert oracle(COMPUTE_BOUND, 0.5 * 0.95 + 0.5 * 0.02) == 1.0  # plain is the best fixed choice
    informed = (0.5 * expected_tokens([0.95], 2) + 0.5) / (0.5 * COMPUTE_BOUND[2] + 0.5)  # hits at gamma 2: 1.1
    assert rate >= 0.95 * informed and rate >= 1.04
    row, c.probe_budget = {}, 0.0  # the estimates' choice (no probe)
    assert c.choose(row, [Signal("hit", 64)], cap=8)[1] >= 1
    assert c.choose(row, [Signal("miss", 64)], cap=8)[1] == 0


def test_plain_until_the_plain_step_is_measured_then_the_prior_prices_widths():
    c = GammaController("auto", slope=0.75)
    assert c.choose({}, None, cap=8) == (0, 0)  # T(1) unmeasured: a plain step measures it
    c.observe_verify(1, 1.0)
    assert c.costs.curve(1, 4) == pytest.approx([1.0, 1.75, 2.5, 3.25])
    assert c.choose({}, [None], cap=8) == (0, 0)  # no source can draft


def test_the_row_and_the_source_are_chosen_by_gain():
    """Two sources (e.g. prompt lookup, a draft model): the one whose evidence pays drafts; a source with nothing
    to draft is never chosen."""
    c = GammaController("auto", slope=0.1, cost_priors=(0.0, 0.2))
    c.seed_costs(1, MEMORY_BOUND[:9], None)
    c.seed_costs(1, [], 0.2, source=1)
    row = {}
    for _ in range(200):
        c.observe_acceptance(row, 0, "n3", 4, 4)  # source 0 in bucket n3: always kept
        c.observe_acceptance(row, 1, None, 4, 1)  # source 1: alpha ~ 0.25
    both = [Signal("n3", 8), Signal(None, 64)]
    assert c.choose(row, both, cap=8)[0] == 0
    assert c.choose(row, [None, Signal(None, 64)], cap=8)[0] == 1
    assert c.choose(row, [Signal("n3", 2), None], cap=8) == (0, 2)  # never deeper than the source can draft


def test_a_batch_drafts_only_where_the_whole_step_gains():
    """The step's width is its widest row's: one good row among three that cannot draft does not widen the pass for
    all (per row it would pay: E = 1.96 against T(3)/T(1) = 1.5; for the batch it would not: 4.96 tokens in 1.5 steps
    against 4 in 1); with every row good, the batch drafts."""
    c = GammaController("auto", slope=0.25)
    for batch in (1, 4):
        c.seed_costs(batch, [1.0 + 0.25 * n for n in range(9)], None)
    good = {}
    for _ in range(400):
        c.observe_acceptance(good, 0, None, 2, 1)  # alpha ~ 0.6 at the first position, 1 at the second
        c.observe_acceptance(good, 0, None, 2, 2)
    c.probe_budget = 0.0
    rows = [(good, [Signal(None, 8)], 8)] + [({}, [None], 8)] * 3
    assert c.plan(rows[:1], 1)[0][1] >= 2  # alone, it drafts
    assert [g for _, g in c.plan(rows, 4)] == [0, 0, 0, 0]
    assert all(g >= 1 for _, g in c.plan([rows[0]] * 4, 4))


def test_a_stale_calibration_is_measured_again():
    """A calibration taken under a 3x load: once it is STALE passes old, the widths are priced as unmeasured and the
    drafter, good on the idle machine, drafts again (probes re-measure the widths)."""
    c = GammaController("auto", slope=0.1)
    c.seed_costs(1, [3.0 * (1.0 + 0.5 * n) for n in range(9)], None)  # under load, and a steep curve
    rate = simulate(c, [1.0 + 0.05 * n for n in range(65)], 0.8, steps=1000)
    assert rate >= 0.9 * oracle([1.0 + 0.05 * n for n in range(65)], 0.8)


def test_fixed_gamma_and_bad_values():
    assert GammaController(3).choose({}, None, cap=2) == (0, 2)
    assert GammaController(3).choose({}, [None, Signal(None, 64)], cap=8) == (1, 3)  # the first source that drafts
    for bad in ("fast", -1, 65, 1.5, True):
        with pytest.raises(ValueError):
            GammaController(bad)
    with pytest.raises(ValueError):
        GammaController("auto", max_gamma=0)
    with pytest.raises(ValueError):
        GammaController("auto", probe_budget=2.0)


def test_costs_follow_a_busy_neighbour_and_recover():
    """A window's low quantile: a few slow steps (a neighbour) move nothing; a lasting change is followed within a
    window, both ways."""
    costs = StepCosts(slope=0.25, window=16)
    for _ in range(16):
        costs.observe_verify(1, 1.0, 1)
    for _ in range(3):
        costs.observe_verify(1, 5.0, 1)  # a neighbour steals the core for three steps
    assert costs.curve(1, 1) == [1.0]
    for _ in range(16):
        costs.observe_verify(1, 2.0, 1)  # load doubles for good
    assert costs.curve(1, 1) == [2.0]
    for _ in range(16):
        costs.observe_verify(1, 1.0, 1)  # and goes away
    assert costs.curve(1, 1) == [1.0]


def test_costs_interpolate_borrow_shape_and_keep_batch_sizes_apart():
    costs = StepCosts(slope=1.0)
    assert costs.curve(1, 3) is None  # no T(1): no curve
    costs.seed(1, [1.0, 1.2, 1.4, 1.6], None)
    costs.observe_verify(1, 2.0, 4)
    costs.observe_verify(3, 3.0, 4)
    assert costs.curve(4, 3) == pytest.approx([2.0, 2.5, 3.0])  # measured, linear between
    assert costs.curve(4, 4) == pytest.approx([2.0, 2.5, 3.0, 3.2])  # beyond: batch 1's shape, T(4)/T(1) = 1.6
    assert costs.curve(1, 6) == pytest.approx([1.0, 1.2, 1.4, 1.6, 2.6, 3.6])  # beyond every measurement: the slope
    assert costs.curve(2, 2) is None  # T_2(1) unmeasured: not borrowed (a plain step measures it)
    costs.observe_draft(0, 0.1, 1)
    costs.observe_draft(0, 0.3, 8)
    assert costs.draft_cost(0, 2) == 0.1 and costs.draft_cost(0, 6) == 0.3 and costs.draft_cost(1, 1) is None


def test_generator_calibrate_measures_every_batch_size(tiny_target, tiny_draft):
    from verispec.engine.generator import SpeculativeGenerator
    from verispec.sampling import SamplingParams

    gen = SpeculativeGenerator(
        tiny_target, tiny_draft, config=SpecConfig(draft="model", gamma="auto", max_gamma=3, runner="hf")
    )
    out = gen.calibrate((1, 2), context=8, repeats=1)
    assert set(out) == {1, 2} and all(len(v["curve"]) == 4 and v["draft_step"] > 0 for v in out.values())
    costs = gen.core.controller.costs
    assert costs.batches() == [1, 2] and all(costs.draft_cost(0, b) == out[b]["draft_step"] for b in (1, 2))
    fixed = SpeculativeGenerator(tiny_target, tiny_draft, config=SpecConfig(draft="model", gamma=2, runner="hf"))
    fresh = SpeculativeGenerator(tiny_target, tiny_draft, config=SpecConfig(draft="model", gamma=2, runner="hf"))
    fixed.calibrate((2,), context=8, repeats=1)

    def run(g):
        return [c.token_ids for c in g.generate(["a b c", "d e"], SamplingParams(seed=0), max_new_tokens=6)]

    assert run(fixed) == run(fresh)  # the calibration's cache contents do not leak into generation
    with pytest.raises(ValueError, match="batches"):
        gen.calibrate([0])
