"""Regression tests for the review of the structured-output change: each case was reproduced before its fix."""

from __future__ import annotations

import pytest
import torch

from verispec.engine.config import SpecConfig
from verispec.engine.generator import SpeculativeGenerator
from verispec.engine.session import GenerationSession
from verispec.model.loading import LoadedModel
from verispec.sampling import Constraint, ConstraintError, ParamError, SamplingParams, probs_from_logits

from ..helpers.json_tok import json_model, make_json_tokenizer
from ..helpers.tiny import noisy_copy


@pytest.fixture(scope="module")
def models():
    tok = make_json_tokenizer()
    target = LoadedModel(json_model(0), tok, "json-0")
    return target, LoadedModel(noisy_copy(target.model, 0.3), tok, "json-noisy")


def test_a_long_forced_run_beside_a_row_near_its_budget_fits_the_cache(models):
    """Row A fills most of the context with a small budget, row B's grammar forces 40 characters with a large one:
    the jump-forward tokens appended to B's chain must fit the batch's KV cache (its slack used to ignore them:
    'KV cache capacity exceeded' on the first step)."""
    target, _ = models
    gen = SpeculativeGenerator(target, None, config=SpecConfig.parse("draft=ngram,jump=32"))
    session = GenerationSession(gen.core)
    a = session.add([3 + i % 40 for i in range(240)], SamplingParams(seed=0), max_new_tokens=4)
    b = session.add([3, 4, 5], SamplingParams(seed=1, constraint=Constraint.regex("ab" * 20)), max_new_tokens=64)
    done = {}
    while not session.idle:
        for event in session.step():
            if event.completion is not None:
                done[event.key] = event.completion
    assert set(done) == {a, b} and done[b].text == "ab" * 20 and done[b].finish_reason == "stop"


def test_position_seeding_does_not_depend_on_gamma_under_a_grammar(models):
    """random=position promises a seed's tokens whatever gamma; forced one-hot proposals would break that, so jump-
    forward is off under it."""
    target, draft = models
    c = Constraint.json_schema({"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]})
    runs = []
    for gamma in (1, 2, 4):
        gen = SpeculativeGenerator(target, draft, config=SpecConfig.parse(f"draft=model,gamma={gamma},random=position"))
        outs = gen.generate([[3, 4]] * 12, [SamplingParams(seed=s, constraint=c) for s in range(12)], max_new_tokens=24)
        runs.append([o.token_ids for o in outs])
    assert runs[0] == runs[1] == runs[2]


def test_token_options_beside_a_constraint_are_refused():
    c = Constraint.regex("ab")
    with pytest.raises(ParamError, match="allowed_token_ids or bad_words"):
        SamplingParams(constraint=c, allowed_token_ids=[3, 4])
    with pytest.raises(ParamError, match="allowed_token_ids or bad_words"):
        SamplingParams(constraint=c, bad_words=[[3]])
    SamplingParams(constraint=c, logit_bias={3: 1.0})  # a bias removes no token


def test_the_keyword_check_reads_keyword_positions_only(models):
    target, _ = models
    gen = SpeculativeGenerator(target, config=SpecConfig(draft="none"))
    grammars = gen.core.grammars
    named = {"type": "object", "properties": {"if": {"type": "integer"}, "not": {"type": "boolean"}}}
    grammars.compile(Constraint.json_schema(named))  # property names, not keywords
    for schema, word in [
        ({"type": "object", "dependencies": {"a": ["b"]}}, "dependencies"),
        ({"type": "object", "properties": {"a": {"type": "integer", "multipleOf": 3}}}, "multipleOf"),
        ({"type": "array", "items": {"type": "string", "pattern": "^a+$", "maxLength": 2}}, "pattern"),
        ({"anyOf": [{"type": "string"}, {"not": {"type": "string"}}]}, "not"),
    ]:
        with pytest.raises(ConstraintError, match=word):
            grammars.compile(Constraint.json_schema(schema))


def test_malformed_constraints_are_clear_errors(models):
    with pytest.raises(ConstraintError, match="JSON constraints"):
        Constraint("regex", "ab", whitespace=True)
    with pytest.raises(ConstraintError, match="nested too deeply"):
        Constraint.json_schema("[" * 5000 + "]" * 5000)
    target, _ = models
    gen = SpeculativeGenerator(target, config=SpecConfig(draft="none"))
    with pytest.raises(ConstraintError, match="temperature attribute"):  # xgrammar would read it, we would not
        gen.core.grammars.compile(Constraint.grammar('root ::= a "b"\na[temperature=0.1] ::= "a"'))
    with pytest.raises(ConstraintError, match="cannot be met"):  # the tokenizer has no upper-case letters
        gen.generate([[3]], SamplingParams(constraint=Constraint.regex("ZZ")), max_new_tokens=4)


def test_probs_from_logits_refuses_a_constraint_without_its_mask():
    params = SamplingParams(constraint=Constraint.regex("ab"))
    with pytest.raises(ValueError, match="allowed"):
        probs_from_logits(torch.zeros(1, 8), params)
    p = probs_from_logits(torch.zeros(1, 8), params, allowed=torch.tensor([[True, False] * 4]))
    assert torch.equal(p, torch.tensor([[0.25, 0.0] * 4]))
