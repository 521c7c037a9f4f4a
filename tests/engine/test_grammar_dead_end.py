"""A grammar state that no token of the vocabulary continues (a dead end) ends the request, "length", under plain
constrained decoding and under speculation alike — with the same law.

On the word-level tiny tokenizer the grammar `root ::= "a" "x0"` allows, after "a", both the token "x0" and the
token "x" (its text is a prefix of "x0"); after "x" the grammar needs "0", which no token is. So the outcomes are
exactly ([a, x0], "stop") and ([a, x], "length"), and P([a, x]) = p(x) / (p(x) + p(x0)) under the target after
prompt + [a]. Each method's count of the dead end is checked by an exact two-sided binomial test at alpha = 0.001;
with N = 1,000 a shift of the dead end's probability by 0.08 is detected with power > 0.99 (normal approximation
at the target's p ~ 0.5, the worst case)."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import binomtest

from verispec.engine.config import SpecConfig
from verispec.engine.generator import SpeculativeGenerator
from verispec.model.loading import LoadedModel
from verispec.sampling import Constraint, SamplingParams

from ..helpers.tiny import noisy_copy

ALPHA = 0.001
N = 1000
PROMPT = [1, 5, 9, 12]


@pytest.mark.statistical
@pytest.mark.parametrize("spec", ["draft=none", "draft=model,gamma=3", "draft=ngram,gamma=3,jump=4"])
def test_a_dead_end_ends_the_request_with_the_plain_law(spec, tiny_target):
    tok = tiny_target.tokenizer
    a, x, x0 = tok.convert_tokens_to_ids(["a", "x", "x0"])
    with torch.no_grad():
        logits = tiny_target.model(torch.tensor([PROMPT + [a]])).logits[0, -1]
    p_dead = float(torch.softmax(logits[[x, x0]], 0)[0])
    draft = LoadedModel(noisy_copy(tiny_target.model, 0.3), tok, "noisy") if "model" in spec else None
    gen = SpeculativeGenerator(tiny_target, draft, config=SpecConfig.parse(spec + ",random=stream"))
    c = Constraint.grammar('root ::= "a" "x0"')
    outs = gen.generate([PROMPT] * N, [SamplingParams(seed=i, constraint=c) for i in range(N)], max_new_tokens=8)
    seen = {(tuple(o.token_ids), o.finish_reason) for o in outs}
    assert seen <= {((a, x0), "stop"), ((a, x), "length")}, seen
    dead = sum(o.token_ids == [a, x] for o in outs)
    assert binomtest(dead, N, p_dead).pvalue > ALPHA, (dead, N, p_dead)


def test_an_engine_that_samples_on_past_a_dead_end_is_caught(tiny_target, monkeypatch):
    """A broken engine that keeps sampling past the dead end (nothing cut, the row not ended) gives outputs the
    grammar never allows, and the outcome check above catches them."""
    from verispec.structured.grammar import GrammarState

    monkeypatch.setattr(GrammarState, "stuck", property(lambda self: False))

    def advance(self, tokens):  # keeps every token: what was drawn past the dead end is emitted
        self._walk(())
        self._masks.clear()
        for t in tokens:
            if not self.matcher.is_terminated():
                self.matcher.accept_token(int(t))
        return len(tokens)

    monkeypatch.setattr(GrammarState, "advance", advance)
    tok = tiny_target.tokenizer
    a, x, x0 = tok.convert_tokens_to_ids(["a", "x", "x0"])
    gen = SpeculativeGenerator(tiny_target, None, config=SpecConfig.parse("draft=none,random=stream"))
    c = Constraint.grammar('root ::= "a" "x0"')
    outs = gen.generate([PROMPT] * 200, [SamplingParams(seed=i, constraint=c) for i in range(200)], max_new_tokens=8)
    seen = {(tuple(o.token_ids), o.finish_reason) for o in outs}
    assert not seen <= {((a, x0), "stop"), ((a, x), "length")}
