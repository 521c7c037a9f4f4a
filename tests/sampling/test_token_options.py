"""logit_bias, allowed_token_ids and bad_words: validation, exact probabilities on tiny vocabularies (expected
values computed by hand with math.exp, not with the code under test), their place in the processing order, the
per-node bad-word context of chains and trees, and SamplingMetadata built once and reused."""

from __future__ import annotations

import math

import pytest
import torch

from verispec.sampling import (
    ParamError,
    SamplingMetadata,
    SamplingParams,
    bad_words_from_text,
    counts_at_nodes,
    probs_from_logits,
    recent_at_nodes,
    recent_tokens,
)
from verispec.sampling.tree import chain_parents

INF = float("inf")


def P(*vals):
    return torch.tensor([list(vals)], dtype=torch.float64)


def softmax(xs):  # independent of torch: plain floats, -inf allowed
    m = max(xs)
    e = [math.exp(x - m) if x > -INF else 0.0 for x in xs]
    return [v / sum(e) for v in e]


# --- validation --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("logit_bias", {1: 100.5}, r"\[-100, 100\]"),
        ("logit_bias", {1: -101}, r"\[-100, 100\]"),
        ("logit_bias", {1: math.nan}, "finite"),
        ("logit_bias", {"1": 1.0}, "token ids"),
        ("logit_bias", {-1: 1.0}, "token ids"),
        ("logit_bias", {True: 1.0}, "token ids"),
        ("logit_bias", {1: "x"}, "number"),
        ("logit_bias", [1, 2], "entry"),
        ("logit_bias", "1:2", "map token ids"),
        ("allowed_token_ids", [], "empty"),
        ("allowed_token_ids", [1, -2], "token ids"),
        ("allowed_token_ids", [1.5], "token ids"),
        ("allowed_token_ids", "abc", "list of token ids"),
        ("allowed_token_ids", 3, "list of token ids"),
        ("bad_words", ["hello"], "tokenize"),
        ("bad_words", "hello", "list of token-id"),
        ("bad_words", [[]], "non-empty"),
        ("bad_words", [[1, -1]], "token ids"),
        ("bad_words", [[1]] * 1 + [[i, 1] for i in range(300)], "at most"),
        ("bad_words", [list(range(1100))], "at most"),
    ],
)
def test_invalid_token_options_name_the_field(field, value, match):
    with pytest.raises(ParamError, match=f"SamplingParams.{field} .*{match}") as e:
        SamplingParams(**{field: value})
    assert e.value.field == field


def test_token_options_are_normalised_frozen_and_hashable():
    sp = SamplingParams(logit_bias={3: 1, 1: -2.5}, allowed_token_ids=[5, 3, 3, 1], bad_words=[[1], [2, 3], [2, 3]])
    assert sp.logit_bias == ((1, -2.5), (3, 1.0)) and isinstance(sp.logit_bias[1][1], float)
    assert sp.allowed_token_ids == (1, 3, 5)
    assert sp.bad_words == ((1,), (2, 3))  # deduplicated, in order
    assert sp.banned_token_ids == (1,) and sp.bad_word_depth == 1 and sp.uses_token_options
    assert hash(sp) == hash(SamplingParams(logit_bias=[(1, -2.5), (3, 1.0)], allowed_token_ids=(1, 3, 5),
                                           bad_words=((1,), (2, 3))))  # fmt: skip
    assert not SamplingParams().uses_token_options and SamplingParams(logit_bias=None).logit_bias == ()
    assert sp.blocks(1) and sp.blocks(2) and not sp.blocks(3)  # 1: bad word; 2: not allowed
    with pytest.raises(AttributeError):
        sp.logit_bias = ()  # type: ignore[misc]


def test_contradictions_and_vocabulary_are_refused():
    with pytest.raises(ParamError, match="ban every token of allowed_token_ids"):
        SamplingParams(allowed_token_ids=[2, 3], bad_words=[[2], [3], [4, 2]])
    SamplingParams(allowed_token_ids=[2, 3], bad_words=[[2], [3, 3]])  # a context ban may empty it: see fallback
    for kw, field in [
        (dict(logit_bias={7: 1.0}), "logit_bias"),
        (dict(allowed_token_ids=[1, 9]), "allowed_token_ids"),
        (dict(bad_words=[[1, 8]]), "bad_words"),
    ]:
        sp = SamplingParams(**kw)
        with pytest.raises(ParamError, match=rf"SamplingParams.{field} .*outside the vocabulary \[0, 6\)"):
            sp.check_vocab(6)
        with pytest.raises(ValueError, match="outside the vocabulary"):
            probs_from_logits(torch.zeros(1, 6), sp)
        with pytest.raises(ValueError, match="outside the vocabulary"):
            SamplingMetadata.build([sp], 6)
        sp.check_vocab(10)
    with pytest.raises(ParamError, match="every token of the vocabulary"):
        SamplingParams(bad_words=[[0], [1], [2]]).check_vocab(3)


# --- exact probabilities -----------------------------------------------------------------------------------


def test_logit_bias_is_added_to_the_logits():
    out = probs_from_logits(P(0.0, 1.0, 2.0, 0.5), SamplingParams(logit_bias={0: 1.5, 2: -1.0, 3: -100}))
    assert out[0].tolist() == pytest.approx(softmax([1.5, 1.0, 1.0, -99.5]), abs=1e-12)


def test_allowed_token_ids_keep_only_those_tokens():
    out = probs_from_logits(P(0.0, 1.0, 2.0, 3.0), SamplingParams(allowed_token_ids=[1, 3]))
    e1, e3 = math.exp(1.0), math.exp(3.0)
    assert out[0].tolist() == pytest.approx([0, e1 / (e1 + e3), 0, e3 / (e1 + e3)], abs=1e-12)
    assert out[0, 0] == 0 and out[0, 2] == 0  # exactly zero, not small


def test_one_token_bad_words_are_banned_everywhere():
    logits = torch.tensor([[[0.0, 1.0, 2.0], [2.0, 1.0, 0.0]]], dtype=torch.float64)  # two positions
    out = probs_from_logits(logits, SamplingParams(bad_words=[[1]]))
    assert out[0, 0].tolist() == pytest.approx(softmax([0.0, -INF, 2.0]), abs=1e-12)
    assert out[0, 1].tolist() == pytest.approx(softmax([2.0, -INF, 0.0]), abs=1e-12)


def test_multi_token_bad_words_ban_their_last_token_after_their_prefix():
    sp = SamplingParams(bad_words=[[3, 1], [2, 3, 0], [4, 4, 4, 2]])
    logits = torch.zeros((1, 5, 5), dtype=torch.float64)  # five positions with different contexts
    recent = torch.tensor([[[3, 2, 9], [1, 3, 2], [3, 2, -1], [4, 4, 4], [4, 4, -1]]])  # most recent first
    out = probs_from_logits(logits, sp, recent_tokens=recent)
    # ...2, 3 | : [3, 1] bans 1 (context ends with 3);  [2, 3, 0] bans 0 (ends with 2, 3)
    assert out[0, 0].tolist() == pytest.approx([0, 0, 1 / 3, 1 / 3, 1 / 3])
    assert out[0, 1].tolist() == pytest.approx([0.2] * 5)  # ends with 1: nothing
    assert out[0, 2].tolist() == pytest.approx([0, 0, 1 / 3, 1 / 3, 1 / 3])  # [2, 3] and a short context
    assert out[0, 3].tolist() == pytest.approx([0.25, 0.25, 0, 0.25, 0.25])  # 4, 4, 4 | bans 2
    assert out[0, 4].tolist() == pytest.approx([0.2] * 5)  # only two 4s: too short for [4, 4, 4, 2]
    with pytest.raises(ValueError, match="need recent_tokens"):
        probs_from_logits(logits, sp)
    with pytest.raises(ValueError, match="recent_tokens must have shape"):
        probs_from_logits(logits, sp, recent_tokens=recent[..., :2])  # fewer than the 3 tokens [4, 4, 4, 2] needs


def test_a_context_ban_that_would_leave_nothing_keeps_the_static_bans():
    sp = SamplingParams(allowed_token_ids=[1, 2], bad_words=[[0, 1], [0, 2], [2]])
    out = probs_from_logits(P(5.0, 0.0, 1.0, 0.0), sp, recent_tokens=torch.tensor([[0]]))
    assert out[0].tolist() == [0.0, 1.0, 0.0, 0.0]  # 2 and 0, 3 stay banned; the context's ban on 1 gives way


def test_options_come_before_penalties_and_temperature():
    """vLLM's order: allowed / bad words / bias, then penalties, then temperature, then top-k."""
    sp = SamplingParams(
        logit_bias={0: 1.0, 2: 2.0}, allowed_token_ids=[0, 1, 2], repetition_penalty=2.0, temperature=0.5
    )
    prompt = torch.tensor([[True, False, True, False]])
    out = probs_from_logits(P(1.0, 0.5, -1.0, 3.0), sp, prompt_mask=prompt)
    x = [(1.0 + 1.0) / 2.0, 0.5, (-1.0 + 2.0) / 2.0, -INF]  # bias first, then the penalty divides it
    assert out[0].tolist() == pytest.approx(softmax([v / 0.5 for v in x]), abs=1e-12)
    greedy = probs_from_logits(P(1.0, 0.5, 0.0, 3.0), SamplingParams(temperature=0, logit_bias={2: 3.5}))
    assert greedy[0].tolist() == [0, 0, 1, 0]  # greedy takes the argmax after the bias
    top1 = probs_from_logits(P(1.0, 0.5, 0.0, 3.0), SamplingParams(top_k=1, allowed_token_ids=[1, 2]))
    assert top1[0].tolist() == [0, 1, 0, 0]  # top-k among the allowed tokens


def test_per_row_options_in_one_batch():
    logits = torch.randn(3, 2, 6, dtype=torch.float64)
    rows = [SamplingParams(logit_bias={1: 3.0}), SamplingParams(), SamplingParams(bad_words=[[4, 5]], top_k=3)]
    recent = torch.tensor([[-1], [-1], [4]])
    out = probs_from_logits(logits, rows, recent_tokens=recent)
    for b, sp in enumerate(rows):
        assert torch.equal(out[b : b + 1], probs_from_logits(logits[b : b + 1], sp, recent_tokens=recent[b : b + 1]))
    assert (out[2, :, 5] == 0).all() and torch.equal(out[1], logits[1].softmax(-1))


# --- per-node context -------------------------------------------------------------------------------------


def test_recent_tokens_of_sequences():
    r = recent_tokens([[1, 2, 3, 4], [7]], 3)
    assert r.tolist() == [[4, 3, 2], [7, -1, -1]]
    assert recent_tokens([[1], [2]], 0).shape == (2, 0)


def test_recent_at_nodes_of_a_chain():
    root = torch.tensor([[5, 6, 7]])  # the context ends ..., 7, 6, 5
    r = recent_at_nodes(root, torch.tensor([[1, 2, -1]]), chain_parents(1, 3))
    assert r.tolist() == [[[5, 6, 7], [1, 5, 6], [2, 1, 5], [5, 6, 7]]]  # the padding node's slot: the root's


def test_recent_at_nodes_of_a_tree_follow_each_path():
    root = torch.tensor([[9, 8]])
    tokens = torch.tensor([[1, 2, 3, 4]])  # 0 and 1 below the root, 2 below 1, 3 below 2
    parents = torch.tensor([[-1, -1, 1, 2]])
    r = recent_at_nodes(root, tokens, parents)
    assert r.tolist() == [[[9, 8], [1, 9], [2, 9], [3, 2], [4, 3]]]


def test_draft_positions_see_the_drafts_before_them():
    """A chain [3, 1]: the bad word [3, 1] bans 1 at slot 1 (after the draft 3), nowhere else; p and q alike."""
    sp = SamplingParams(bad_words=[[3, 1]])
    logits = torch.zeros((1, 3, 4), dtype=torch.float64)
    drafts = torch.tensor([[3, 1]])
    recent = recent_at_nodes(recent_tokens([[0, 2]], sp.bad_word_depth), drafts, chain_parents(1, 2))
    out = probs_from_logits(logits, sp, recent_tokens=recent)
    assert out[0, 1, 1] == 0 and out[0, 0, 1] == 0.25 and out[0, 2, 1] == 0.25
    for j in range(3):  # each position alone, as a drafter computes it
        assert torch.equal(out[:, j], probs_from_logits(logits[:, j], sp, recent_tokens=recent[:, j]))


# --- metadata ----------------------------------------------------------------------------------------------


def test_metadata_is_built_once_and_gives_the_per_call_result():
    g = torch.Generator().manual_seed(0)
    V = 12
    rows = [
        SamplingParams(temperature=0.7, top_k=4, logit_bias={1: 2.0, 3: -1.0}),
        SamplingParams(temperature=0),
        SamplingParams(top_p=0.8, min_p=0.05, allowed_token_ids=range(8), bad_words=[[2], [5, 6, 7]]),
        SamplingParams(frequency_penalty=0.5, repetition_penalty=1.3, bad_words=[[6, 7]]),
    ]
    meta = SamplingMetadata.build(rows, V)
    logits = torch.randn(4, 3, V, generator=g)
    counts = counts_at_nodes(torch.zeros(4, V), torch.tensor([[6, 5, 1]] * 4)[:, :2], chain_parents(4, 2))
    recent = recent_at_nodes(recent_tokens([[6, 1]] * 4, 2), torch.tensor([[6, 5]] * 4), chain_parents(4, 2))
    kw = dict(output_counts=counts, recent_tokens=recent, prompt_mask=torch.zeros(4, V, dtype=torch.bool))
    a = probs_from_logits(logits, meta, **kw)
    assert torch.equal(a, probs_from_logits(logits, rows, **kw))
    assert torch.equal(probs_from_logits(logits, meta, **kw), a)  # reused: the same again
    assert a[3, 1, 7] == 0 and a[3, 0, 7] > 0 and a[3, 2, 7] > 0  # [6, 7]: only right after the draft 6
    assert (a[2, :, 2] == 0).all() and (a[2, :, 8:] == 0).all()
    sub = meta.select([2, 0])
    assert sub.params == (rows[2], rows[0])
    kw2 = {k: v[[2, 0]] for k, v in kw.items()}
    assert torch.equal(probs_from_logits(logits[[2, 0]], sub, **kw2), a[[2, 0]])
    with pytest.raises(ValueError, match="4 rows over 12 tokens"):
        probs_from_logits(logits[:2], meta)


def test_bad_words_from_text_like_vllm():
    vocab = {"foo": [10], " foo": [11], "bar baz": [12, 13], " bar baz": [14, 13], "x": [7], " x": [7],
             "a b": [1, 2], " a b": [3]}  # fmt: skip
    ids = bad_words_from_text(["foo", "  bar baz", "x", "a b"], lambda s: vocab[s])
    # "foo" and " foo" differ: both; " x" has the same first token: once; " a b" has another length: once
    assert ids == [[10], [11], [12, 13], [14, 13], [7], [1, 2]]
    with pytest.raises(ParamError, match="gives no tokens"):
        bad_words_from_text([""], lambda s: [])
    with pytest.raises(ParamError, match="list of strings"):
        bad_words_from_text("foo", lambda s: [1])
