"""What a cross-vocabulary draft must survive (found by review): a request whose token options or grammar leave no
token of the intersection (the draft's q then sits on what the request allows, instead of failing the batch), rows of
different lengths growing the draft's cache, a row selected twice, and calibration timing one-draft-id tokens."""

from __future__ import annotations

import pytest
import torch

from verispec.crossvocab import BridgedRunner
from verispec.engine.adaptive import measure_cost_curve
from verispec.engine.config import SpecConfig
from verispec.engine.generator import SpeculativeGenerator
from verispec.model.fast import make_runner
from verispec.sampling import Constraint, SamplingParams

from ..helpers.cross_tok import SAMPLES, TARGET_VOCAB
from .fixed_pair import pair

TARGET_ONLY = [TARGET_VOCAB.index(t) for t in ("abc", "cd", "efg")]  # no draft token has these strings
CONFIGS = ["draft=model,gamma=3", "draft=model,gamma=3,tree=2-2,verify=iid", "draft=model,gamma=3,cross_vocab=slem"]


@pytest.mark.parametrize("spec", CONFIGS)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_token_options_that_leave_only_target_only_tokens(spec, temperature):
    """allowed_token_ids with no token of the intersection: decoding goes on (plain decoding's tokens at T = 0)."""
    target, draft = pair()
    params = SamplingParams(temperature=temperature, seed=1, allowed_token_ids=TARGET_ONLY)
    gen = SpeculativeGenerator(target, draft, config=SpecConfig.parse(spec))
    out = gen.generate([SAMPLES[0], SAMPLES[1]], params, max_new_tokens=8, ignore_eos=True)
    assert all(set(o.token_ids) <= set(TARGET_ONLY) and len(o.token_ids) == 8 for o in out)
    if temperature == 0:
        plain = SpeculativeGenerator(target, config=SpecConfig(draft="none")).generate(
            [SAMPLES[0], SAMPLES[1]], params, max_new_tokens=8
        )
        assert [o.token_ids for o in out] == [o.token_ids for o in plain]


@pytest.mark.parametrize("spec", CONFIGS[:2])
def test_a_grammar_of_target_only_tokens(spec):
    """A regex whose text only target-only tokens can start ('abc' / 'cd' / 'efg' are whole tokens on the target's
    side): constrained speculation runs and matches the constraint."""
    target, draft = pair()
    params = SamplingParams(temperature=1.0, seed=2, constraint=Constraint.regex("(abc|cd|efg){3}"))
    gen = SpeculativeGenerator(target, draft, config=SpecConfig.parse(spec))
    out = gen.generate([SAMPLES[0]] * 3, params, max_new_tokens=12)
    for o in out:
        assert o.finish_reason == "length" or o.text.replace("abc", "").replace("cd", "").replace("efg", "") == ""


def _bridged(capacity_rows: list[list[int]]):
    target, draft = pair()
    inner = make_runner(draft.model, len(draft.tokenizer), runner="hf")
    from verispec.crossvocab import VocabMap

    vmap = VocabMap.build(target.tokenizer, draft.tokenizer, len(target.tokenizer), len(draft.tokenizer))
    runner = BridgedRunner(inner, vmap, len(target.tokenizer))
    runner.fill(capacity_rows, capacity=max(len(r) for r in capacity_rows) + 1)
    return runner


@torch.inference_mode()
def test_the_draft_cache_grows_for_ragged_rows():
    """Row 0 at its capacity, row 1 short: a chunk for row 1 alone still needs the longest row's length plus the
    chunk (the cache's own rule), and a target token spelled by several draft ids needs more than one slot each."""
    target, _ = pair()
    long = target.tokenizer(SAMPLES[0] * 3)["input_ids"]
    runner = _bridged([long, long[:3]])
    spelled = [TARGET_VOCAB.index("Ã©")] * 40  # two draft ids each (byte fallback)
    for _ in range(3):
        runner.forward([[], spelled], logits_at="last")
        runner.forward([spelled[:1], []], logits_at="last")
    assert runner.lengths == [len(long) + 3, 3 + 120]


@torch.inference_mode()
def test_a_row_selected_twice_has_its_own_bookkeeping():
    target, _ = pair()
    ids = target.tokenizer(SAMPLES[0])["input_ids"]
    runner = _bridged([ids])
    runner.select([0, 0])
    runner.forward([ids[:2], []], logits_at="last")
    assert runner.lengths == [len(ids) + 2, len(ids)]


def test_calibration_times_tokens_of_the_intersection():
    runner = _bridged([[0, 1]])
    pool = set(runner.calibration_ids.tolist())
    assert pool and all(len(runner.map.spell(t)) == 1 for t in pool)
    before = runner.inner.tokens_computed
    measure_cost_curve(runner, runner.vocab_size, 1, batch=1, context=8, repeats=2)
    assert runner.inner.tokens_computed - before == 8 + 2  # one draft id per timed token
