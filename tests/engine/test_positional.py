"""random=position in the engine: a seeded request's token ids are the same under gamma 1, 3, 8 and auto, alone
and in a batch of 8 unrelated requests (exact equality), and its output distribution is still the target's
(chi-square over the first 3 tokens, level 1e-4, as tests/engine/test_distribution.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from verispec.engine.config import SpecConfig
from verispec.engine.generator import SpeculativeGenerator
from verispec.sampling import SamplingParams

from ..helpers import sequences as dist

PROMPT = [3, 7, 7, 12, 3, 7]
OTHERS = [[5, 9, 3], [12, 12, 4, 8, 3], [7], [9, 3, 7, 7], [4, 4, 4, 4], [3, 12], [8, 8, 5, 9, 3, 7, 2]]
PARAMS = SamplingParams(temperature=1.0, top_p=0.9)
NEW = 16
GAMMAS = [1, 3, 8, "auto"]


def _gen(target, draft, gamma):
    # full chains (the tiny draft is rarely above the default confidence threshold, which would end every chain
    # after one draft: its step's last, never fed)
    return SpeculativeGenerator(
        target, draft, config=SpecConfig(draft="model", stop_below=None, gamma=gamma, random="position")
    )


# gamma 3 and auto in the default tier (each against gamma 1's output, alone and in a batch); gamma 1 itself (its
# batch invariance) and 8 in the slow tier
@pytest.mark.parametrize("gamma", [pytest.param(g, marks=[pytest.mark.slow] if g in (1, 8) else []) for g in GAMMAS])
def test_same_tokens_under_every_gamma_alone_and_in_a_batch(gamma, tiny_target, tiny_noisy):
    ref_gen = _gen(tiny_target, tiny_noisy, 1)
    seeds = range(8)
    ref = [ref_gen.generate([PROMPT], replace(PARAMS, seed=s), max_new_tokens=NEW, ignore_eos=True)[0] for s in seeds]
    gen = _gen(tiny_target, tiny_noisy, gamma)
    for s, r in zip(seeds, ref):
        alone = gen.generate([PROMPT], replace(PARAMS, seed=s), max_new_tokens=NEW, ignore_eos=True)[0]
        assert alone.token_ids == r.token_ids, (gamma, s)
        batch = [PROMPT] + OTHERS
        params = [replace(PARAMS, seed=s)] + [replace(PARAMS, seed=1000 + i) for i in range(len(OTHERS))]
        together = gen.generate(batch, params, max_new_tokens=NEW, ignore_eos=True)[0]
        assert together.token_ids == r.token_ids, (gamma, s)
        assert together.logprobs == pytest.approx(r.logprobs, abs=1e-5)
    assert gen.stats.accepted > 0 and ref_gen.stats.accepted > 0  # fed drafts were kept


@pytest.mark.statistical
def test_distribution_is_still_the_targets(tiny_target, tiny_draft):
    params = dist.SETTINGS["top_k_top_p"]
    gen = SpeculativeGenerator(
        tiny_target, tiny_draft, config=SpecConfig(draft="model", stop_below=None, gamma=2, random="position")
    )
    result = dist.gof(
        dist.sample_sequences(gen, params), dist.exact_sequence_probs(tiny_target.model, dist.PROMPT, params)
    )
    assert not result.rejects(dist.LEVEL), result
    assert gen.last_stats.accepted > 0 and gen.last_stats.accepted < gen.last_stats.drafted


def test_plain_decoding_with_position_seeding(tiny_target):
    gen = SpeculativeGenerator(tiny_target, config=SpecConfig(draft="none", random="position"))
    a = gen.generate([PROMPT, OTHERS[0]], [replace(PARAMS, seed=1), replace(PARAMS, seed=2)], max_new_tokens=8)
    b = gen.generate([PROMPT], replace(PARAMS, seed=1), max_new_tokens=8)
    assert a[0].token_ids == b[0].token_ids


def test_greedy_is_unchanged(tiny_target, tiny_noisy):
    greedy = SamplingParams(temperature=0.0)
    a = _gen(tiny_target, tiny_noisy, 3).generate([PROMPT], greedy, max_new_tokens=12, ignore_eos=True)[0]
    b = SpeculativeGenerator(tiny_target, config=SpecConfig(draft="none")).generate(
        [PROMPT], greedy, max_new_tokens=12, ignore_eos=True
    )[0]
    assert a.token_ids == b.token_ids


def test_rollout_groups_do_not_depend_on_gamma(tiny_target, tiny_noisy):
    from verispec.rollout import RolloutEngine

    def run(gamma):
        config = SpecConfig(draft="model", stop_below=None, gamma=gamma, random="position")
        eng = RolloutEngine(tiny_target, tiny_noisy, config=config)
        params = SamplingParams(temperature=1.0)  # rollouts refuse top-p (not what a trainer recomputes)
        out = eng.generate([PROMPT, OTHERS[1]], n=4, params=params, max_new_tokens=NEW, seed=5, ignore_eos=True)
        return [r.completion_token_ids for r in out]

    assert run(2) == run(6)
