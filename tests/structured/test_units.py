"""Structured outputs, the parts alone (fast, exact, no sampling): `Constraint` validation, compile errors, a
`GrammarState`'s masks against a fresh xgrammar matcher (rollback walks, dead paths, after a stop token, jump-forward),
`allowed_at_nodes` on trees, `probs_from_logits(allowed=)` and `fit_draft`.

The reference mask is `helpers.grammar_law.fresh_mask`: a new xgrammar matcher advanced along the path and xgrammar's
own `apply_token_bitmask_inplace`, so a walk that rolls back wrong (a stale or shifted state) shows as a different
mask."""

from __future__ import annotations

import random
import re

import pytest
import torch

from verispec.drafting.base import Draft
from verispec.drafting.grammar import fit_draft
from verispec.sampling import SamplingParams, probs_from_logits
from verispec.sampling.constraint import MAX_CONSTRAINT_CHARS, Constraint, ConstraintError
from verispec.structured import Grammars, allowed_at_nodes, root_allowed

from ..helpers.grammar_law import compile_ebnf, fresh_mask
from ..helpers.json_tok import EOS as JEOS
from ..helpers.json_tok import WORDS as JWORDS
from ..helpers.json_tok import V as JV
from ..helpers.json_tok import make_json_tokenizer
from ..helpers.tiny import EOS, WORDS, V, make_tokenizer

A, B_, C, D, E, X, X0 = (WORDS.index(w) for w in ("a", "b", "c", "d", "e", "x", "x0"))
G1 = 'root ::= ("a" | "b" | "c") ("a" | "b")? "d"'  # 9 outputs; masks {a,b,c}, {a,b,d}, {d}, {EOS}
G_LOOP = 'root ::= ("a" | "b" | "c")+ "d" ("e" | "d")*'


@pytest.fixture(scope="module")
def words():
    tok = make_tokenizer()
    return tok, Grammars(tok, V, [EOS])


@pytest.fixture(scope="module")
def chars():
    tok = make_json_tokenizer()
    return tok, Grammars(tok, JV, [JEOS])


def ids_of(mask: torch.Tensor) -> set[int]:
    return set(torch.nonzero(mask).flatten().tolist())


# --- Constraint ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "build, words_in_message",
    [
        (lambda: Constraint.json_schema(42), ["object", "int"]),
        (lambda: Constraint.json_schema([1, 2]), ["object", "list"]),
        (lambda: Constraint.json_schema("{not json"), ["not valid JSON"]),
        (lambda: Constraint.json_schema('"a string"'), ["object", "str"]),
        (lambda: Constraint.json_schema({"x": float("nan")}), ["cannot be written as JSON"]),
        (lambda: Constraint.json_schema({"x": object()}), ["cannot be written as JSON"]),
        (lambda: Constraint.regex(3), ["regex", "string"]),
        (lambda: Constraint.regex(""), ["regex", "empty"]),
        (lambda: Constraint.grammar(None), ["grammar", "string"]),
        (lambda: Constraint.grammar(""), ["grammar", "empty"]),
        (
            lambda: Constraint.grammar("root ::= " + '"a" ' * MAX_CONSTRAINT_CHARS),
            ["at most", str(MAX_CONSTRAINT_CHARS)],
        ),
        (lambda: Constraint.regex("a" * (MAX_CONSTRAINT_CHARS + 1)), ["at most"]),
        (lambda: Constraint.choice("yes"), ["list of strings", "str"]),
        (lambda: Constraint.choice([]), ["non-empty"]),
        (lambda: Constraint.choice(["yes", ""]), ["non-empty"]),
        (lambda: Constraint.choice(["yes", 3]), ["non-empty list of non-empty strings"]),
        (lambda: Constraint.choice(None), ["list of strings"]),
        (lambda: Constraint("yaml", "x"), ["kind", "yaml"]),
        (lambda: Constraint("regex", b"a+"), ["source must be a string", "bytes"]),
        (lambda: Constraint("json_object", "", whitespace=1), ["whitespace", "bool"]),
    ],
)
def test_constraint_validation(build, words_in_message):
    with pytest.raises(ConstraintError) as info:
        build()
    assert isinstance(info.value, ValueError)  # a 400 through the server's ValueError handling
    for w in words_in_message:
        assert w in str(info.value), (w, str(info.value))


def test_constraint_canonical_forms():
    assert Constraint.json_schema({"b": 1, "a": [True]}) == Constraint.json_schema('{"b": 1, "a": [true]}')
    assert Constraint.json_schema({"b": 1, "a": 2}).source == '{"b":1,"a":2}'  # compact, keys in their given order
    assert Constraint.json_schema(True).source == "true"
    assert Constraint.choice(["yes", "no"]).choices == ["yes", "no"]
    assert Constraint.json_object().source == "" and Constraint.json_object().kind == "json_object"
    assert Constraint.regex("a" * MAX_CONSTRAINT_CHARS).source  # the limit itself is allowed
    assert Constraint.regex("a+").describe() == "regex 'a+'"


def test_sampling_params_refuse_a_non_constraint():
    with pytest.raises(ValueError, match="constraint"):
        SamplingParams(constraint='{"type": "object"}')
    assert SamplingParams(constraint=Constraint.json_object()).constraint.kind == "json_object"


# --- compile errors --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "constraint, problem",
    [
        (Constraint.json_schema({"type": "nonsense"}), "nonsense"),
        (Constraint.json_schema({"properties": {"a": {"$ref": "#/defs/x"}}}), "defs"),
        (Constraint.json_schema({"type": "string", "pattern": "("}), "parenthesis"),
        (Constraint.regex("("), "parenthesis"),
        (Constraint.regex("[z-a]"), "lower bound"),
        (Constraint.grammar('root ::= "a" | '), "Expect element"),
        (Constraint.grammar('start ::= "a"'), 'rule with name "root" is not found'),
        (Constraint.grammar("root ::= undefined_rule"), '"undefined_rule" is not defined'),
    ],
)
def test_compile_errors_name_the_problem(words, constraint, problem):
    _, grammars = words
    with pytest.raises(ConstraintError) as info:
        grammars.compile(constraint)
    msg = str(info.value)
    assert constraint.kind in msg and "does not compile" in msg and problem in msg, msg
    with pytest.raises(ConstraintError):  # and a state cannot be made of it either
        grammars.state(constraint)


def test_compile_error_messages_carry_no_xgrammar_log_prefix(words):
    """BUG (src/verispec/structured/grammar.py, Grammars.compile): the reason is xgrammar's log line as is, e.g.
    "[08:01:19] /project/cpp/json_schema_converter.cc:5082: Unsupported type ..." - a wall-clock time and a C++ source
    path in a message the server answers as a 400, and a message that differs from one second to the next. The
    reason should start at the problem ("Unsupported type ...")."""
    _, grammars = words
    for c in (Constraint.json_schema({"type": "nonsense"}), Constraint.regex("(")):
        with pytest.raises(ConstraintError) as info:
            grammars.compile(c)
        msg = str(info.value)
        assert not re.search(r"\[\d\d:\d\d:\d\d\]|\.cc:\d+", msg), msg


def test_compile_refuses_what_is_not_a_constraint(words):
    _, grammars = words
    with pytest.raises(ConstraintError, match="expected a Constraint"):
        grammars.compile({"type": "object"})


def test_every_kind_compiles(words, chars):
    _, g = chars
    for c in (
        Constraint.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}}),
        Constraint.json_object(),
        Constraint.json_object(whitespace=True),
        Constraint.regex("[a-c]+"),
        Constraint.choice(["true", "null", 'a"b']),
        Constraint.grammar('root ::= "{" "}"'),
    ):
        st = g.state(c)
        assert st.mask(()).any() and not st.mask(())[JEOS]  # nothing is complete before the first token


def test_choice_allows_exactly_its_strings(chars):
    tok, g = chars
    st = g.state(Constraint.choice(["true", "tab"]))
    enc = [tok.convert_tokens_to_ids(t) for t in ("t", "tr", "tru", "true")]
    assert {JWORDS[i] for i in ids_of(st.mask(()))} == {"t", "tr", "tru", "true"}  # 'tab' only through 't'
    assert ids_of(st.mask([enc[3]])) == {JEOS}
    assert {JWORDS[i] for i in ids_of(st.mask([enc[0]]))} == {"a", "ab", "r"}


# --- GrammarState ----------------------------------------------------------------------------------------------------
def test_masks_after_paths(words):
    _, g = words
    st = g.state(Constraint.grammar(G1))
    assert ids_of(st.mask(())) == {A, B_, C}
    assert ids_of(st.mask([C])) == {A, B_, D}
    assert ids_of(st.mask([C, A])) == {D}
    assert ids_of(st.mask([C, D])) == {EOS}
    assert ids_of(st.mask([C, A, D])) == {EOS}
    assert not st.matcher.is_terminated()


def random_paths(compiled, vocab: int, eos: int, n: int, depth: int, rng: random.Random) -> list[list[int]]:
    """n random live paths (each token drawn among the fresh matcher's allowed ones, EOS included), sharing prefixes."""
    paths: list[list[int]] = [[]]
    for _ in range(n):
        path = list(rng.choice(paths))
        for _ in range(rng.randint(1, depth)):
            allowed = sorted(ids_of(fresh_mask(compiled, vocab, path)))
            if not allowed or (path and path[-1] == eos):
                break
            path.append(rng.choice(allowed))
        paths.append(path)
    return paths


@pytest.mark.parametrize("kind", ["words", "json"])
def test_rollback_walks_equal_fresh_matchers(kind, words, chars):
    """Paths in a shuffled order (each walk rolls back to the common prefix of the last and goes on), and the same
    after `advance` has committed a prefix: every mask equals a fresh matcher's along the whole path."""
    rng = random.Random(7)
    if kind == "words":
        tok, g = words
        vocab, eos, constraint = V, EOS, Constraint.grammar(G_LOOP)
        compiled = compile_ebnf(tok, V, EOS, G_LOOP)
    else:
        tok, g = chars
        vocab, eos = JV, JEOS
        schema = {"type": "object", "properties": {"k": {"type": "boolean"}, "n": {"type": "array"}}}
        constraint = Constraint.json_schema(schema)
        compiled = g.compile(constraint)  # the same compiled grammar; the matchers differ
    st = g.state(constraint)
    paths = random_paths(compiled, vocab, eos, 40, 6, rng)
    rng.shuffle(paths)
    for path in paths + paths[::-1]:  # the second pass: every mask from the cache
        assert torch.equal(st.mask(path), fresh_mask(compiled, vocab, path)), path
        assert st.accepts(path) == len(path)
    committed = max(paths, key=len)[:3]
    st.advance(committed)
    for path in paths:
        if path[:3] == committed:
            rest = path[3:]
            assert torch.equal(st.mask(rest), fresh_mask(compiled, vocab, path)), path
    assert torch.equal(st.mask(()), fresh_mask(compiled, vocab, committed))


def test_dead_paths_take_their_longest_live_prefix(words):
    _, g = words
    st = g.state(Constraint.grammar(G1))
    assert st.accepts([C, E, A]) == 1  # e is refused after c
    assert torch.equal(st.mask([C, E]), st.mask([C]))
    assert torch.equal(st.mask([C, E, A, A]), st.mask([C]))
    assert torch.equal(st.mask([E]), st.mask(()))
    assert torch.equal(st.mask([C, 99]), st.mask([C]))  # an id beyond the vocabulary is refused like any
    assert ids_of(st.mask([C, A])) == {D}  # the walks leave the committed state where it was
    assert st.accepts([]) == 0


def test_after_a_stop_token_every_token_is_allowed(words):
    _, g = words
    st = g.state(Constraint.grammar(G1))
    assert bool(st.mask([C, D, EOS]).all())
    assert bool(st.mask([C, D, EOS, A, B_]).all())
    assert st.accepts([C, D, EOS, A]) == 3
    st.advance([C, D, EOS, A])  # tokens after the stop token are not the grammar's
    assert st.matcher.is_terminated() and bool(st.mask(()).all())


def test_request_stop_ids_end_like_eos(words):
    _, g = words
    st = g.state(Constraint.grammar(G1), stop_ids=[WORDS.index("z")])
    z = WORDS.index("z")
    assert ids_of(st.mask([C, D])) == {EOS, z}
    assert bool(st.mask([C, D, z]).all())


def test_advance_commits_and_keeps_what_the_grammar_accepts(words):
    _, g = words
    st = g.state(Constraint.grammar(G1))
    before = st.mask([C])
    st.advance([C])
    assert torch.equal(st.mask(()), before)  # the cache was cleared: the root is the old path [c]
    assert ids_of(st.mask([A])) == {D}
    assert st.advance([A, E, D]) == 1  # how many it kept: those before the first refused token (a dead end's cut)
    assert ids_of(st.mask(())) == {D}  # the state after c a


def test_masks_are_cached_per_step(words):
    _, g = words
    st = g.state(Constraint.grammar(G1))
    st.mask([C])
    st.mask([C, A])
    filled = st.masks_filled
    st.mask([C])
    st.mask([C, A])
    st.mask([C, E])  # dead: its live prefix's cached mask
    assert st.masks_filled == filled
    st.advance([C])
    st.mask(())
    assert st.masks_filled == filled + 1


def test_jump_forward(words, chars):
    _, g = words
    st = g.state(Constraint.grammar('root ::= "a" "x0" ("b" | "c")'))
    assert st.jump([], 8) == [A, X0]  # the forced text "ax0", xgrammar's greedy tokenization
    assert st.jump([], 1) == [A]
    assert st.jump([], 0) == []
    assert st.jump([A], 8) == [X0]
    assert st.jump([A, X0], 8) == []  # a choice next: nothing forced
    assert st.jump([B_], 8) == []  # a dead path
    assert st.jump([A, X0, C, EOS], 8) == []  # after the end
    assert ids_of(st.mask(())) == {A}  # jumps walk and roll back like any path
    tok, jg = chars
    jst = jg.state(
        Constraint.json_schema({"type": "object", "properties": {"k": {"type": "boolean"}}, "required": ["k"]})
    )
    forced = jst.jump([], 16)
    assert tok.decode(forced) == '{"k": '  # keys of a required field are forced text
    assert jst.accepts(forced) == len(forced)


def test_a_tokenizer_larger_than_the_engine_vocabulary_is_masked_to_it():
    tok = make_tokenizer()
    g = Grammars(tok, 30, [EOS])  # the engine samples 30 ids: x1 (30) and x2 (31) are never allowed
    st = g.state(Constraint.grammar('root ::= ("x0" | "x1" | "x2") "a"'))
    m = st.mask(())
    assert m.shape == (30,) and ids_of(m) == {X, X0}  # 'x' starts each of them
    assert st.accepts([30]) == 0


# --- masks at nodes --------------------------------------------------------------------------------------------------
def test_allowed_at_nodes_on_a_tree(words):
    tok, g = words
    compiled = compile_ebnf(tok, V, EOS, G1)
    st = g.state(Constraint.grammar(G1))
    #           node:    0   1   2   3   4    5 (pad)
    ids = torch.tensor([[C, A, E, D, D, -1], [A, A, A, A, A, A]])
    par = torch.tensor([[-1, -1, 0, 1, 0, -1], [-1, 0, 1, 2, 3, 4]])
    out = allowed_at_nodes([st, None], ids, par, V)
    assert out.shape == (2, 7, V) and out.dtype == torch.bool
    paths = [[], [C], [A], [C], [A, D], [C, D], []]  # slot 3: c e is dead -> c's; slot 6: padding -> the root's
    for s, path in enumerate(paths):
        assert torch.equal(out[0, s], fresh_mask(compiled, V, path)), (s, path)
    assert bool(out[1].all())  # a row without a grammar allows everything
    assert allowed_at_nodes([None, None], ids, par, V) is None
    assert root_allowed([None], V, "cpu") is None
    assert torch.equal(root_allowed([None, st], V, "cpu")[1], fresh_mask(compiled, V, []))


# --- probs_from_logits(allowed=) -------------------------------------------------------------------------------------
def test_probs_apply_the_mask_first():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 16, generator=g)
    allowed = torch.rand(2, 3, 16, generator=g) < 0.4
    allowed[..., 5] = True
    for params in (
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.0, top_k=2),
        SamplingParams(temperature=1.0, top_p=0.5),
        SamplingParams(temperature=1.0, min_p=0.3),
        SamplingParams(temperature=1.2, repetition_penalty=1.3, logit_bias={5: -3.0}),
        SamplingParams(temperature=0.0),
    ):
        p = probs_from_logits(logits, params, allowed=allowed, output_counts=torch.ones(2, 3, 16))
        assert bool((p[~allowed] == 0).all()), params
        assert torch.allclose(p.sum(-1), torch.ones(2, 3))
        ref = probs_from_logits(logits.masked_fill(~allowed, float("-inf")), params, output_counts=torch.ones(2, 3, 16))
        assert torch.allclose(p, ref), params  # the same as -inf logits before any processing
    # top_k after the mask: the 2 best *allowed* tokens survive, not the 2 best overall
    x = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0]])
    p = probs_from_logits(x, SamplingParams(top_k=2), allowed=torch.tensor([[False, True, False, True, True]]))
    assert (p[0] > 0).tolist() == [False, True, False, True, False]
    # greedy: the best allowed token
    p = probs_from_logits(x, SamplingParams(temperature=0.0), allowed=torch.tensor([[False, False, True, True, True]]))
    assert p[0].tolist() == [0, 0, 1, 0, 0]
    # a [B, V] mask broadcasts over positions
    p = probs_from_logits(logits, SamplingParams(), allowed=allowed[:, 0])
    assert bool((p[~allowed[:, :1].expand_as(p)] == 0).all())


@pytest.mark.parametrize(
    "allowed, match",
    [
        (torch.ones(2, 16, dtype=torch.int64), "bool"),
        ([[True] * 16] * 2, "bool"),
        (torch.ones(3, 16, dtype=torch.bool), "shape"),
        (torch.ones(2, 15, dtype=torch.bool), "shape"),
        (torch.ones(2, 2, 16, dtype=torch.bool), "shape"),  # T = 3 logits, 2 masks
        (torch.ones(2, 3, 16, 1, dtype=torch.bool), "shape"),
        (torch.ones(16, dtype=torch.bool), "shape"),
    ],
)
def test_probs_refuse_bad_masks(allowed, match):
    with pytest.raises(ValueError, match=match):
        probs_from_logits(torch.randn(2, 3, 16), SamplingParams(), allowed=allowed)


def test_probs_refuse_a_mask_that_leaves_nothing():
    allowed = torch.ones(2, 8, dtype=torch.bool)
    allowed[1] = False
    with pytest.raises(ValueError, match="every token a row allows"):
        probs_from_logits(torch.randn(2, 8), SamplingParams(), allowed=allowed)
    allowed[1, 3] = True  # the only allowed token has logit -inf (a token option): nothing left either
    with pytest.raises(ValueError, match="every token a row allows"):
        probs_from_logits(torch.randn(2, 8), SamplingParams(allowed_token_ids=[0, 1]), allowed=allowed)


# --- fit_draft -------------------------------------------------------------------------------------------------------
def chain(rows: list[list[int]], probs: bool):
    k = max(len(r) for r in rows)
    ids = torch.full((len(rows), k), -1, dtype=torch.int64)
    for b, r in enumerate(rows):
        ids[b, : len(r)] = torch.tensor(r)
    q = torch.softmax(torch.randn(len(rows), k + 1, V), -1) if probs else None
    return Draft.chain_of(ids, q, [len(r) for r in rows])


def rows_of(d: Draft) -> list[list[int]]:
    return [d.token_ids[b, :n].tolist() for b, n in enumerate(d.num_nodes)]


def test_fit_draft_cuts_chosen_chains_before_refused_tokens_and_jumps(words):
    _, g = words
    grammar = 'root ::= ("a" | "b") "x0" "c" "d" ("a" | "b")'
    st = [g.state(Constraint.grammar(grammar)) for _ in range(4)]
    draft = chain([[A, E, A], [A, X0, C, D], [B_, X0, C, A], [E, A]], False)
    out = fit_draft(draft, st, room=[8, 8, 8, 8], jump=16)
    assert out.chain and out.rule == "deterministic" and out.probs is None
    assert rows_of(out) == [
        [A, X0, C, D],  # cut after a (e refused), then the forced x0 c d
        [A, X0, C, D],  # all accepted; then a choice: nothing forced
        [B_, X0, C, D],  # cut before a (after b x0 c only d), then the forced d
        [],  # e refused at the root, and the root is a choice: nothing forced
    ]
    assert out.num_nodes == [4, 4, 4, 0]


def test_fit_draft_never_cuts_a_sampled_chain_and_jumps_only_after_a_live_one(words):
    """A sampled chain keeps its refused drafts (verified as drawn: p = 0 rejects them; a cut would change the law of
    the drafts kept); forced tokens follow a chain the grammar accepts whole, with one-hot q."""
    _, g = words
    grammar = 'root ::= ("a" | "b") "x0" "c" "d" ("a" | "b")'
    st = [g.state(Constraint.grammar(grammar)) for _ in range(3)]
    draft = chain([[A, E, A], [A], [E, A]], True)
    out = fit_draft(draft, st, room=[8, 8, 8], jump=16)
    assert out.chain and out.rule == "iid"
    assert rows_of(out) == [[A, E, A], [A, X0, C, D], [E, A]]
    q = out.probs
    assert torch.equal(q[0, :3], draft.probs[0, :3]) and torch.equal(q[2, :2], draft.probs[2, :2])
    assert torch.equal(q[1, 0], draft.probs[1, 0])  # the sampled draft keeps its q
    for j in (1, 2, 3):  # forced tokens: one-hot q on them
        assert q[1, j].sum() == 1 and q[1, j, out.token_ids[1, j]] == 1


def test_fit_draft_respects_room_and_jump(words):
    _, g = words
    grammar = 'root ::= "a" "x0" "c" "d" "e"'
    mk = lambda: g.state(Constraint.grammar(grammar))  # noqa: E731
    draft = chain([[A], [A], [A], [A]], False)
    out = fit_draft(draft, [mk(), mk(), mk(), mk()], room=[3, 1, 0, 8], jump=2)
    assert rows_of(out) == [[A, X0, C], [A], [A], [A, X0, C]]  # room 3 -> 2 jumped; room 1 -> none; jump 2
    out = fit_draft(chain([[A, E]], False), [mk()], room=[0], jump=16)
    assert rows_of(out) == [[A, E]]  # room 0: the row as it is (it is not verified this step)


def test_fit_draft_leaves_other_drafts_alone(words):
    _, g = words
    st = g.state(Constraint.grammar(G1))
    draft = chain([[C, A, D], [E, E]], True)
    out = fit_draft(draft, [st, None], room=[8, 8], jump=16)
    assert out is draft  # nothing cut (c a d is live), nothing forced after it (EOS is not jumped), no grammar on row 1
    assert fit_draft(draft, [None, None], [8, 8], 16) is draft
    tree = Draft.tree_of([[E, A], [A]], [[-1, -1], [-1]], None, "deterministic", torch.device("cpu"))
    assert fit_draft(tree, [st, st], [8, 8], 16) is tree  # trees: a refused node has p = 0 and is rejected
    empty = Draft.empty(2, torch.device("cpu"))
    out = fit_draft(empty, [st, None], [8, 8], 16)
    assert rows_of(out) == [[], []]  # nothing forced at G1's root
