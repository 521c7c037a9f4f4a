"""One request never hurts another inside an engine step (`BatchView.probs`, `GenerationSession._emit`): a row whose
distribution is no distribution (the model's NaN logits for its prompt) or whose own code raises (its detokenizer)
ends with finish_reason "error" and a RowFault, and every other row of the batch gets exactly the tokens it gets in
a batch without it. The poisoned row is real: token POISON's embedding is NaN, so the prompts holding it give NaN
logits in that row only (each row attends to its own cache), for the target's p and a draft model's q alike.
Every assertion is exact (greedy or seeded requests; fixed gamma)."""

from __future__ import annotations

import pytest
import torch

from verispec.engine import GenerationSession, Job, Request, SpeculativeGenerator
from verispec.engine.config import SpecConfig
from verispec.engine.rows import RowFault
from verispec.model.loading import LoadedModel
from verispec.rollout import RolloutEngine
from verispec.sampling import SamplingParams

from ..helpers.tiny import loaded, make_model, make_tokenizer

POISON = 30  # "x1": its embedding is NaN in the poisoned model
GOOD = [(3, 7, 7, 12, 3, 7), (5, 9, 11, 4), (8, 8, 9, 10)]
BAD = (5, POISON, 11, 4)


def _poisoned(seed: int = 0) -> LoadedModel:
    model = make_model(seed)
    with torch.no_grad():
        model.model.embed_tokens.weight[POISON] = float("nan")
    return LoadedModel(model, make_tokenizer(), "poisoned")


def _gen(drafter: str) -> SpeculativeGenerator:
    target = _poisoned()
    if drafter == "model":  # the draft reads the same NaN embedding: its q is no distribution either
        return SpeculativeGenerator(target, _poisoned(1), config=SpecConfig(draft="model", gamma=3))
    return SpeculativeGenerator(target, config=SpecConfig(draft=drafter, gamma=3))


def _requests(prompts, params: list[SamplingParams]) -> list[Request]:
    return [Request(p, params[i], max_new_tokens=12, ignore_eos=True, key=p, index=i) for i, p in enumerate(prompts)]


def _run(gen: SpeculativeGenerator, requests: list[Request]) -> dict:
    sess = GenerationSession(gen.core)
    sess.submit(Job(requests, key="job"))
    done = {}
    while not sess.idle:
        for e in sess.step():
            if e.completion is not None:
                done[e.key] = e.completion
    return done


NO_POISON = [[POISON]]  # the good rows never emit POISON (it would poison them too)
PARAMS = [
    SamplingParams(temperature=0.0, bad_words=NO_POISON),
    SamplingParams(temperature=1.0, seed=11, bad_words=NO_POISON),
    SamplingParams(temperature=0.8, top_p=0.9, seed=12, bad_words=NO_POISON),
    SamplingParams(temperature=1.0, seed=13),
]


@pytest.mark.parametrize("drafter", ["ngram", "model", "none"])
@pytest.mark.parametrize("where", [0, 1, 3])
def test_a_poisoned_row_fails_alone_and_the_others_keep_their_tokens(drafter, where):
    gen = _gen(drafter)
    alone = _run(gen, _requests(GOOD, PARAMS[:3]))
    prompts = list(GOOD)
    prompts.insert(where, BAD)
    params = list(PARAMS[:3])
    params.insert(where, PARAMS[3])
    mixed = _run(gen, _requests(prompts, params))
    bad = mixed.pop(BAD)
    assert bad.finish_reason == "error" and isinstance(bad.error, RowFault)
    assert "not a finite probability distribution" in str(bad.error)
    assert {k: c.token_ids for k, c in mixed.items()} == {k: c.token_ids for k, c in alone.items()}
    assert all(c.finish_reason == "length" and len(c.token_ids) == 12 for c in mixed.values())
    assert all(len(c.logprobs) == 12 and all(lp == lp for lp in c.logprobs) for c in mixed.values())


def test_a_row_whose_detokenizer_raises_fails_alone():
    """A fault in a row's own host code (here its tokenizer's decode raises on the row's tokens) fails that row."""
    gen = SpeculativeGenerator(loaded(0), config=SpecConfig(draft="ngram", gamma=2))
    alone = _run(gen, _requests(GOOD[:2], PARAMS[:2]))
    decode = gen.core.tokenizer.decode

    def picky(ids, *a, **kw):  # refuses "x2 x2": only the forced request's output holds it
        if len(ids) >= 2 and set(ids) == {31}:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "a broken byte")
        return decode(ids, *a, **kw)

    gen.core.tokenizer.decode = picky
    forced = SamplingParams(temperature=0.0, allowed_token_ids=[31])  # every token it emits is 31
    mixed = _run(gen, _requests([*GOOD[:2], (4, 5)], [*PARAMS[:2], forced]))
    bad = mixed.pop((4, 5))
    assert bad.finish_reason == "error" and isinstance(bad.error.__cause__, UnicodeDecodeError)
    assert {k: c.token_ids for k, c in mixed.items()} == {k: c.token_ids for k, c in alone.items()}


def test_the_library_raises_the_fault():
    """generate() and RolloutEngine.generate() raise the RowFault: a failed request is never a silent gap."""
    gen = _gen("ngram")
    with pytest.raises(RowFault, match="not a finite probability distribution"):
        gen.generate([list(GOOD[0]), list(BAD)], SamplingParams(temperature=0.0), max_new_tokens=4)
    eng = RolloutEngine(_poisoned(), config=SpecConfig(draft="ngram", stop_below=None, gamma=4, random="stream"))
    with pytest.raises(RowFault):
        eng.generate([list(BAD)], n=2, params=SamplingParams(temperature=1.0), max_new_tokens=4, seed=0)
