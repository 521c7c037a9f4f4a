"""Bounded grammars (issue 43, "one request never hurts another"):

* a constraint whose language forces an endless text (a JSON schema whose object requires itself, `root ::= "a"
  root`) ends "length" at max_new_tokens: jump-forward walks the forced text a token at a time, at most the
  caller's limit and JUMP_CAP, where xgrammar's own `find_jump_forward_tokens` built the whole (endless) forced
  text first and grew memory until the process died. The risky calls run under an address-space cap (`capped`),
  so the old code fails these tests with a MemoryError-like RuntimeError (std::bad_alloc) within seconds instead of
  taking the machine down;
* jump-forward still proposes at least xgrammar's own tokens on a finite schema;
* JSON-schema features xgrammar 0.2.9 would compile without enforcing (a remote or anchor `$ref`, `format` beside
  `pattern`, formats it does not check, `allOf` of several schemas, `$ref` beside other keywords, a lookahead) are
  refused with a ConstraintError naming them, wherever they sit (under $defs, behind a local $ref).
"""

from __future__ import annotations

import contextlib
import json
import resource

import pytest
import torch
import xgrammar as xgr

from verispec.engine.config import SpecConfig
from verispec.engine.generator import SpeculativeGenerator
from verispec.model.loading import LoadedModel
from verispec.sampling import Constraint, ConstraintError, SamplingParams
from verispec.structured import Grammars
from verispec.structured.grammar import _FORMATS, JUMP_CAP

from ..helpers.grammar_law import fresh_mask
from ..helpers.json_tok import EOS, V, json_model, make_json_tokenizer
from ..helpers.tiny import noisy_copy

SELF_NESTED = {
    "$defs": {"n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}}, "required": ["c"]}},
    "$ref": "#/$defs/n",
}
ENDLESS = {
    "json_schema": (lambda: Constraint.json_schema(SELF_NESTED), '{"c": ' * 100),
    "ebnf": (lambda: Constraint.grammar('root ::= "a" root'), "a" * 200),
}
HEADROOM = 768 << 20  # bytes of address space the capped block may add (the old code passed it in ~3 s)


@contextlib.contextmanager
def capped(headroom: int = HEADROOM):
    """The process's address space capped at its current size plus `headroom` while the block runs (then restored):
    an allocation past it fails (std::bad_alloc -> RuntimeError) instead of growing until the OOM killer acts."""
    try:
        with open("/proc/self/status") as f:
            size = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    except (OSError, StopIteration):  # pragma: no cover - Linux exposes it
        pytest.skip("needs /proc/self/status to cap the address space")
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = size + headroom if hard == resource.RLIM_INFINITY else min(size + headroom, hard)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


@pytest.fixture(scope="module")
def grammars():
    tok = make_json_tokenizer()
    return tok, Grammars(tok, V, [EOS])


@pytest.fixture(scope="module")
def models():
    tok = make_json_tokenizer()
    target = LoadedModel(json_model(0), tok, "json-0")
    return target, LoadedModel(noisy_copy(target.model, 0.3), tok, "json-noisy")


# --- jump-forward is bounded -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", sorted(ENDLESS))
def test_jump_forward_on_an_endless_grammar_is_bounded(kind, grammars):
    tok, g = grammars
    make, text = ENDLESS[kind]
    st = g.state(make())
    before = st.mask(()).clone()
    with capped():
        first = st.jump([], 8)
        most = st.jump([], 10**6)
        later = st.jump(first, 5)
    assert len(first) == 8 and text.startswith(tok.decode(first))
    assert len(most) == JUMP_CAP and text.startswith(tok.decode(most))
    assert len(later) == 5 and text.startswith(tok.decode(first + later))
    assert st.accepts(most) == JUMP_CAP  # proposals the grammar accepts ...
    st.advance([])
    assert torch.equal(st.mask(()), before)  # ... walked and rolled back: the committed state did not move
    assert torch.equal(before, fresh_mask(g.compile(make()), V, []))


def test_jump_forward_proposes_at_least_xgrammars_forced_tokens(grammars):
    """Along a document of a finite schema, xgrammar's own forced tokens (safe here: the forced text is short) are a
    prefix of ours at every state: the bounded walk loses none of them (it may add the one token the vocabulary
    spells at the end of the forced text: '"' before an enum of strings)."""
    tok, g = grammars
    schema = {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green"]}, "ok": {"type": "boolean"}, "n": {"type": "integer"}},
        "required": ["color", "ok", "n"],
        "additionalProperties": False,
    }
    c = Constraint.json_schema(schema)
    ids = tok.encode(json.dumps({"color": "green", "ok": False, "n": 17})) + [EOS]
    st, ref = g.state(c), xgr.GrammarMatcher(g.compile(c), override_stop_tokens=[EOS])
    theirs = ours = 0
    for k in range(len(ids)):
        want, got = ref.find_jump_forward_tokens(), st.jump(ids[:k], 64)
        assert got[: len(want)] == want, (tok.decode(ids[:k]), want, got)
        theirs, ours = theirs + len(want), ours + len(got)
        assert ref.accept_token(ids[k])
    assert theirs > 20 and ours >= theirs


# --- end to end: "length" at max_new_tokens, memory bounded ----------------------------------------------------------
@pytest.mark.parametrize("spec", ["draft=ngram,gamma=4", "draft=model,gamma=3", "draft=ngram,jump=64"])
def test_endless_constraints_end_at_max_new_tokens(spec, models):
    target, noisy = models
    gen = SpeculativeGenerator(target, noisy if "model" in spec else None, config=SpecConfig.parse(spec))
    tok = target.tokenizer
    plain = Constraint.json_schema({"type": "object", "properties": {"k": {"type": "boolean"}}, "required": ["k"]})
    prompts = [tok.encode("ab"), tok.encode("{"), tok.encode("k")]
    with capped():
        [alone] = gen.generate([prompts[2]], SamplingParams(temperature=0.0, constraint=plain), max_new_tokens=16)
        for kind in sorted(ENDLESS):
            make, text = ENDLESS[kind]
            params = [SamplingParams(temperature=0.0, constraint=make()) for _ in range(2)]
            outs = gen.generate(prompts, [*params, SamplingParams(temperature=0.0, constraint=plain)], max_new_tokens=8)
            for o in outs[:2]:
                assert len(o.token_ids) == 8 and o.finish_reason == "length", (spec, kind, o)
                assert text.startswith(o.text), (spec, kind, o.text)
            assert outs[2].token_ids == alone.token_ids[:8]  # the row beside them is unharmed
    assert alone.finish_reason == "stop" and json.loads(alone.text)["k"] in (True, False)


# --- what xgrammar would not enforce is refused ----------------------------------------------------------------------
ASCII = xgr.TokenizerInfo([chr(i) for i in range(32, 127)] + ["</s>"], stop_token_ids=[95])  # one token a character


def xgrammar_accepts(schema: dict, text: str) -> bool:
    """Whether xgrammar 0.2.9 itself (no verispec check) compiles `schema` to a grammar that accepts `text`."""
    compiled = xgr.GrammarCompiler(ASCII, max_threads=1).compile_json_schema(json.dumps(schema), strict_mode=True)
    m = xgr.GrammarMatcher(compiled)
    return m.accept_string(text) and m.is_completed()


S = {"type": "string"}
REFUSED = [
    ({"$ref": "http://example.com/s.json"}, r"'\$ref': 'http://example.com/s.json'"),
    ({"$ref": "https://example.com/s.json#/$defs/x"}, r"'\$ref'"),
    ({"$ref": "file:///etc/passwd"}, r"'\$ref': 'file:///etc/passwd'"),
    ({"$ref": "other.json"}, r"'\$ref'"),
    ({"$defs": {"n": {**S, "$anchor": "a"}}, "$ref": "#a"}, r"'\$ref': '#a'"),
    ({"type": "array", "items": {"$ref": "https://x/y"}}, r"'\$ref'.*#/items"),
    ({**S, "pattern": "^\\d+$", "format": "uuid"}, "'format' beside 'pattern'"),
    ({**S, "format": "email", "maxLength": 8}, "'format' beside 'maxLength'"),
    ({"allOf": [{"type": "integer"}, {"minimum": 1}]}, "'allOf'"),
    ({"type": "integer", "allOf": [{"minimum": 1}]}, "'allOf'"),
    ({"$defs": {"n": {"type": "integer"}}, "$ref": "#/$defs/n", "minimum": 5}, "'\\$ref' beside 'minimum'"),
    ({"$dynamicRef": "#x"}, "'\\$dynamicRef'"),
    ({"$recursiveRef": "#"}, "'\\$recursiveRef'"),
    ({**S, "pattern": "^(?=.*\\d)[a-z0-9]+$"}, "lookahead"),
    # wherever they sit: under $defs / definitions, behind a local $ref to a non-keyword position, in any branch
    (
        {"$defs": {"u": {**S, "pattern": "^a+$", "format": "uuid"}}, "type": "integer"},
        "'format' beside 'pattern'.*#/\\$defs/u",
    ),
    ({"definitions": {"u": {"$ref": "http://a/b"}}, "$ref": "#/definitions/u"}, "'\\$ref': 'http://a/b'"),
    ({"x": {"y": {**S, "pattern": "^a+$", "format": "uuid"}}, "$ref": "#/x/y"}, "'format' beside 'pattern'.*#/x/y"),
    ({"type": "object", "additionalProperties": {**S, "format": "uri", "maxLength": 9}}, "#/additionalProperties"),
    ({"anyOf": [{"type": "null"}, {**S, "pattern": "^a+$", "format": "uuid"}]}, "#/anyOf/1"),
    ({"type": "array", "prefixItems": [{**S, "pattern": "(?!a)b"}]}, "#/prefixItems/0"),
]


@pytest.mark.parametrize("schema, words", REFUSED, ids=[str(i) for i in range(len(REFUSED))])
def test_unenforced_schema_features_are_refused(schema, words, grammars):
    _, g = grammars
    with pytest.raises(ConstraintError, match=words):
        g.compile(Constraint.json_schema(schema))


def test_what_is_refused_is_what_xgrammar_would_not_enforce():
    """The refusals are needed: xgrammar alone accepts text that breaks each of these schemas."""
    uuid = '"123e4567-e89b-12d3-a456-426614174000"'
    assert xgrammar_accepts({**S, "pattern": "^\\d+$", "format": "uuid"}, uuid)  # the pattern dropped
    assert xgrammar_accepts({"$ref": "https://example.com/int.json"}, '"any value"')  # unconstrained
    assert xgrammar_accepts({"allOf": [{"type": "integer"}, {"minimum": 1}]}, "0")
    assert xgrammar_accepts({**S, "pattern": "^(?!a)[a-z]+$"}, '"ab"')
    for fmt in ("idn-email", "iri", "regex", "byte", "no-such-format"):
        assert xgrammar_accepts({**S, "format": fmt}, '"x y"'), fmt


@pytest.mark.parametrize("fmt", _FORMATS)
def test_the_formats_kept_are_enforced(fmt, grammars):
    _, g = grammars
    g.compile(Constraint.json_schema({**S, "format": fmt}))  # not refused ...
    assert not xgrammar_accepts({**S, "format": fmt}, '"x y"')  # ... because xgrammar checks it


def test_what_the_grammar_enforces_is_still_accepted(grammars):
    _, g = grammars
    for schema in [
        SELF_NESTED,  # a local recursive $ref (endless: bounded by max_new_tokens, see above)
        {"definitions": {"n": {"type": "integer"}}, "$ref": "#/definitions/n", "description": "d", "title": "t"},
        {"$defs": {"n": {"type": "integer"}}, "allOf": [{"$ref": "#/$defs/n"}], "description": "a pydantic v1 field"},
        {"type": ["string", "null"], "format": "date-time"},
        {"type": "object", "properties": {"format": S, "$ref": S, "allOf": S}},  # property names, not keywords
        {**S, "pattern": "^\\(?=x$"},  # an escaped parenthesis, not a lookahead
        # formats xgrammar does not check, or on non-strings: annotations (JSON Schema's default), as pydantic and
        # OpenAPI write them (SecretStr's password, bytes' binary, int32)
        {**S, "format": "password"},
        {**S, "format": "no-such-format"},
        {"type": "integer", "format": "int32"},
        {"format": "uuid"},
    ]:
        g.compile(Constraint.json_schema(schema))
    with pytest.raises(ConstraintError, match=r"(?i)lookahead"):  # a regex constraint: xgrammar refuses it itself
        g.compile(Constraint.regex("a(?=b)b"))
