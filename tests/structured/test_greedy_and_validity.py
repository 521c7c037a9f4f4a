"""Structured outputs, exactly and at scale:

* greedy: speculative constrained greedy decoding (draft models, prompt lookup with jump-forward, trees, block
  verification, batches) gives exactly the tokens of plain constrained greedy decoding written here (full forwards
  of the target, the mask of a fresh xgrammar matcher on the logits, argmax; no verispec runner or processor), on
  the word-level tiny model and on the character-level JSON model;
* validity: 1000 sampled outputs (temperature 1) of a JSON schema on the JSON model: every output that ends "stop"
  parses and validates against the schema (jsonschema); "length" ones are counted apart (never claimed complete).
"""

from __future__ import annotations

import json
from collections import Counter

import jsonschema
import pytest
import torch
import xgrammar as xgr

from verispec.engine.config import SpecConfig
from verispec.engine.generator import SpeculativeGenerator
from verispec.model.loading import LoadedModel
from verispec.sampling import Constraint, ConstraintError, SamplingParams

from ..helpers.grammar_law import compile_ebnf, fresh_mask
from ..helpers.json_tok import EOS as JEOS
from ..helpers.json_tok import V as JV
from ..helpers.json_tok import json_model, make_json_tokenizer
from ..helpers.tiny import EOS, V, noisy_copy
from .test_bounded import xgrammar_accepts

G_WORDS = 'root ::= ("a" | "b" | "c")+ "d" ("e" | "f" "g" "h")* "i"'
SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": -5, "maximum": 120},
        "tag": {"type": "string", "pattern": "^[a-z]{1,3}$"},
    },
    "required": ["color", "ok", "n", "tag"],
    "additionalProperties": False,
}
SPECS = [
    "draft=model,gamma=3",
    "draft=model,gamma=5,stop_below=none",
    "draft=model,gamma=3,stop_below=none,verify=block",
    "draft=model,tree=2-2-1",
    "draft=model,tree=3-1,verify=iid",
    "draft=ngram,gamma=4",
    "draft=ngram,gamma=4,jump=0",
    "draft=model,gamma=3,stop_below=none,random=position",
]


def generator(target, draft, spec: str) -> SpeculativeGenerator:
    cfg = SpecConfig.parse(spec)
    return SpeculativeGenerator(target, draft if cfg.draft == "model" else None, config=cfg)


@torch.no_grad()
def constrained_greedy(model, compiled, vocab: int, eos: int, prompt: list[int], n: int) -> tuple[list[int], str]:
    """Plain constrained greedy decoding: full forwards, a fresh matcher's mask first, argmax (lowest id on ties); at a
    dead end (an incomplete output no token continues) the output ends, "length"."""
    out: list[int] = []
    while len(out) < n:
        logits = model(torch.tensor([prompt + out])).logits[0, -1].double()
        mask = fresh_mask(compiled, vocab, out)
        if not mask.any():
            return out, "length"
        t = int(logits.masked_fill(~mask, float("-inf")).argmax())
        if t == eos:
            return out, "stop"
        out.append(t)
    return out, "length"


@pytest.fixture(scope="module")
def json_models():
    tok = make_json_tokenizer()
    target = LoadedModel(json_model(0), tok, "json-0")
    return target, LoadedModel(noisy_copy(target.model, 0.3), tok, "json-noisy")


@pytest.mark.parametrize("spec", SPECS)
def test_greedy_equals_plain_constrained_greedy_words(spec, tiny_target, tiny_noisy, tiny_draft):
    prompts = [[1, 3, 4, 6, 3, 4], [1, 5, 5, 7, 6, 9], [3, 4, 6, 7, 10, 11, 12], [1, 20, 21, 3]]
    compiled = compile_ebnf(tiny_target.tokenizer, V, EOS, G_WORDS)
    want = [constrained_greedy(tiny_target.model, compiled, V, EOS, p, 12) for p in prompts]
    c = Constraint.grammar(G_WORDS)
    for draft in (tiny_noisy, tiny_draft) if "draft=model" in spec else (None,):
        gen = generator(tiny_target, draft, spec)
        outs = gen.generate(prompts, SamplingParams(temperature=0.0, constraint=c), max_new_tokens=12)
        assert [(o.token_ids, o.finish_reason) for o in outs] == want, (spec, draft)
        assert gen.last_stats.drafted > 0
        for p, (tokens, _) in zip(prompts, want):  # alone as in a batch
            [o] = gen.generate([p], SamplingParams(temperature=0.0, constraint=c), max_new_tokens=12)
            assert o.token_ids == tokens


@pytest.mark.parametrize("spec", ["draft=model,gamma=4", "draft=ngram,gamma=4", "draft=model,tree=2-2-1"])
def test_greedy_equals_plain_constrained_greedy_json(spec, json_models):
    target, noisy = json_models
    tok = target.tokenizer
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=JV, stop_token_ids=[JEOS])
    compiled = xgr.GrammarCompiler(info, max_threads=1).compile_json_schema(
        json.dumps(SCHEMA), any_whitespace=False, strict_mode=True
    )
    prompts = [tok.encode(s) for s in ('{"color": "red", "ok": true', "the n is 42, tag ab", "blue false 7 xyz")]
    want = [constrained_greedy(target.model, compiled, JV, JEOS, p, 48) for p in prompts]
    gen = generator(target, noisy, spec)
    outs = gen.generate(
        prompts, SamplingParams(temperature=0.0, constraint=Constraint.json_schema(SCHEMA)), max_new_tokens=48
    )
    assert [(o.token_ids, o.finish_reason) for o in outs] == want, spec
    for o, (_, reason) in zip(outs, want):
        if reason == "stop":
            jsonschema.validate(json.loads(o.text), SCHEMA)


@pytest.mark.statistical
@pytest.mark.parametrize("each", [150, pytest.param(500, marks=pytest.mark.slow, id="1000")])
def test_sampled_json_is_valid_at_scale(each, json_models):
    """2 x `each` outputs (the slow tier: 1000) at temperature 1 (seeded; prompt lookup with jump-forward and a draft model chain, 500 each in one
    batch; ~25 s on 2 busy cores, the grammar's per-row mask work dominating): every "stop" output parses and
    validates; the schema bounds every output's length (enum, boolean, bounded integer, 1-3 letter tag; at most ~52
    tokens), so all end "stop" within the budget of 64 ("length" would be counted apart, never validated)."""
    target, noisy = json_models
    c = Constraint.json_schema(SCHEMA)
    prompts = [target.tokenizer.encode(s) for s in ("{", "a b", "color ok n tag", '{"n": 3}')]
    reasons: Counter = Counter()
    for k, spec in enumerate(["draft=ngram,gamma=4", "draft=model,gamma=4"]):
        gen = generator(target, noisy, spec)
        params = [SamplingParams(temperature=1.0, seed=1000 * k + i, constraint=c) for i in range(each)]
        outs = gen.generate([prompts[i % 4] for i in range(each)], params, max_new_tokens=64)
        for o in outs:
            reasons[o.finish_reason] += 1
            if o.finish_reason == "stop":
                jsonschema.validate(json.loads(o.text), SCHEMA)
    assert sum(reasons.values()) == 2 * each and set(reasons) <= {"stop", "length"}
    assert reasons["stop"] >= 0.99 * 2 * each, reasons


@pytest.mark.parametrize(("bound", "breaking"), [({"maxLength": 2}, "abc"), ({"minLength": 1}, "")])
def test_a_pattern_beside_a_length_bound_is_refused_before_any_output(bound, breaking, json_models):
    """xgrammar 0.2.9 compiles a pattern beside minLength / maxLength and drops the bound (it only logs "pattern
    combined with minLength/maxLength is not supported; ignoring minLength/maxLength"), so an output ending "stop" -
    claimed complete - could break the schema. The generator refuses such a schema with a ConstraintError naming the
    keyword and where it sits, before it produces anything; the refusal is needed: xgrammar alone accepts a value
    that breaks the bound."""
    schema = {
        "type": "object",
        "properties": {"tag": {"type": "string", "pattern": "^[a-z]*$", **bound}},
        "required": ["tag"],
        "additionalProperties": False,
    }
    text = json.dumps({"tag": breaking})
    assert xgrammar_accepts(schema, text)  # the bound dropped ...
    with pytest.raises(jsonschema.ValidationError):  # ... though the value breaks it
        jsonschema.validate(json.loads(text), schema)
    target, _ = json_models
    gen = SpeculativeGenerator(target, config=SpecConfig(draft="none"))
    params = [SamplingParams(temperature=1.0, seed=i, constraint=Constraint.json_schema(schema)) for i in range(4)]
    with pytest.raises(ConstraintError, match=rf"'pattern' beside '{next(iter(bound))}' \(at #/properties/tag\)"):
        gen.generate([[3]] * 4, params, max_new_tokens=40)


def test_a_dead_end_ends_the_request_as_plain_decoding_does(tiny_target):
    """'x' is a prefix of "x0" on the word-level tokenizer, so the grammar's mask allows it after 'a', and nothing
    continues it (there is no token "0"): a dead end, which the target's greedy choice walks into. Plain constrained
    decoding ends there ("length"); speculation - prompt lookup proposing 'x' and more after 'a' (the prompt holds
    "a x e g"), with and without jump-forward, and a draft model - scores slots at and past the dead end and must end
    the request the same way, with the same tokens, not fail."""
    grammar = 'root ::= "a" ("x0" | "x1") "b"'
    c = Constraint.grammar(grammar)
    prompt = [3, 26, 7, 9]  # a x e g
    want = constrained_greedy(
        tiny_target.model, compile_ebnf(tiny_target.tokenizer, V, EOS, grammar), V, EOS, prompt, 6
    )
    assert want == ([3, 26], "length")
    for spec in ("draft=none", "draft=ngram,gamma=3,jump=0", "draft=ngram,gamma=3", "draft=model,gamma=3"):
        gen = generator(tiny_target, tiny_target, spec)
        [o] = gen.generate([prompt], SamplingParams(temperature=0.0, constraint=c), max_new_tokens=6)
        assert (o.token_ids, o.finish_reason) == want, spec
