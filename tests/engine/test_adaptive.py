"""The adaptive draft-length rule, on synthetic costs (no timing involved)."""

from __future__ import annotations

import pytest

from verispec.engine.adaptive import GammaController
from verispec.engine.config import SpecConfig
from verispec.sampling import optimal_gamma_cost_curve


def controller(curve, draft_cost, successes=0, failures=0):
    c = GammaController("auto", max_gamma=8)
    for n, t in enumerate(curve, 1):
        c.observe_verify(n, t)
    c.observe_draft(draft_cost)
    c.observe_acceptance(successes, failures)
    return c


def test_good_draft_flat_curve_drafts_long():
    c = controller([1.0] * 9, 0.05, successes=900, failures=50)
    assert c.choose(95, 5, cap=8, step=1) >= 6


def test_matches_the_theory_optimum():
    curve = [1.0, 1.9, 2.8, 1.9, 2.0, 2.1, 2.9, 2.0, 2.4]  # a measured CPU-like curve (M = 2, 3 slow)
    c = controller(curve, 0.1, successes=800, failures=200)
    alpha = (80 + 4 * (803 / 1004)) / (100 + 4)
    expect, _ = optimal_gamma_cost_curve(alpha, 0.1, curve, max_gamma=8)
    assert c.choose(80, 20, cap=8, step=1) == expect
    assert c.choose(80, 20, cap=2, step=1) <= 2


def test_unprofitable_draft_decodes_plainly_but_probes():
    c = controller([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0], 0.5, successes=10, failures=90)
    assert [c.choose(1, 9, cap=8, step=s) for s in range(1, 8)] == [0] * 7
    assert c.choose(1, 9, cap=8, step=8) >= 1  # probe step keeps alpha measured


def test_no_plain_decoding_before_evidence():
    c = GammaController("auto", max_gamma=8)
    for n in (2, 5):
        c.observe_verify(n, 3.0)
    c.observe_draft(0.5)
    assert c.choose(0, 1, cap=8, step=3) >= 1  # T(1) unmeasured, no pooled evidence: keep drafting


def test_interpolation_is_optimistic_beyond_measurements():
    c = GammaController("auto", max_gamma=6)
    c.observe_verify(1, 1.0)
    c.observe_verify(3, 2.0)
    assert c.curve() == pytest.approx([1.0, 1.5, 2.0, 2.0, 2.0, 2.0, 2.0])


def test_fixed_and_bad_values():
    assert GammaController(3).choose(0, 0, cap=2) == 2
    with pytest.raises(ValueError):
        GammaController("fast")
    with pytest.raises(ValueError):
        GammaController("auto", max_gamma=0)


def test_costs_are_kept_per_batch_size():
    """A batch of 4 rows makes each verify pass costlier: batch-4 costs must not leak into batch-1 choices."""
    c = GammaController("auto", max_gamma=8)
    for n in range(1, 10):
        c.observe_verify(n, 1.0 + 0.02 * n, batch=1)  # batch 1: nearly flat curve
        c.observe_verify(n, 1.0 + 0.5 * n, batch=4)  # batch 4: cost grows fast with n
    c.observe_draft(0.05, batch=1)
    c.observe_draft(0.15, batch=4)
    c.observe_acceptance(800, 200)
    assert c.choose(80, 20, cap=8, step=1, batch=1) >= 5
    assert c.choose(80, 20, cap=8, step=1, batch=4) <= 2
    assert c.curve(batch=3) == c.curve(batch=4)  # unmeasured batch size: the nearest measured one


def test_plain_cost_is_measured_once_per_batch_size():
    c = GammaController("auto", max_gamma=8)
    assert not c.wants_plain_probe(4)  # nothing measured yet: warm up by drafting
    c.observe_draft(0.1, batch=4)
    c.observe_verify(5, 2.0, batch=4)
    assert c.wants_plain_probe(4)  # drafting costs known, T(1) at batch 4 not: probe plain decoding
    c.observe_verify(1, 1.0, batch=4)
    assert not c.wants_plain_probe(4)
    assert not GammaController(3).wants_plain_probe(1)  # a fixed gamma never probes


def test_seeded_costs_set_gamma_per_batch_size_from_the_first_step():
    """Costs measured before any step (calibrate): each batch size gets the draft length its own curve favours."""
    c = GammaController("auto", max_gamma=8)
    c.seed_costs(1, [1.0 + 0.02 * n for n in range(1, 10)], 0.05)
    c.seed_costs(8, [1.0 + 0.5 * n for n in range(1, 10)], 0.15)
    assert not c.wants_plain_probe(8)  # T(1) is measured
    assert c.choose(0, 0, cap=8, batch=1) >= 5 and c.choose(0, 0, cap=8, batch=8) <= 2


def test_generator_calibrate_measures_every_batch_size(tiny_target, tiny_draft):
    from verispec.engine.generator import SpeculativeGenerator
    from verispec.sampling import SamplingParams

    gen = SpeculativeGenerator(
        tiny_target, tiny_draft, config=SpecConfig(draft="model", gamma="auto", max_gamma=3, runner="hf")
    )
    out = gen.calibrate((1, 2), context=8, repeats=1)
    assert set(out) == {1, 2} and all(len(v["curve"]) == 4 and v["draft_step"] > 0 for v in out.values())
    assert set(gen.core.controller.verify_costs) == {1, 2} and set(gen.core.controller.draft_costs) == {1, 2}
    fixed = SpeculativeGenerator(tiny_target, tiny_draft, config=SpecConfig(draft="model", gamma=2, runner="hf"))
    fresh = SpeculativeGenerator(tiny_target, tiny_draft, config=SpecConfig(draft="model", gamma=2, runner="hf"))
    fixed.calibrate((2,), context=8, repeats=1)

    def run(g):
        return [c.token_ids for c in g.generate(["a b c", "d e"], SamplingParams(seed=0), max_new_tokens=6)]

    assert run(fixed) == run(fresh)  # the calibration's cache contents do not leak into generation
    with pytest.raises(ValueError, match="batches"):
        gen.calibrate([0])
