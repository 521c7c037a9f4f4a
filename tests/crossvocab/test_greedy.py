"""Greedy speculation with a draft of another tokenizer is the target's greedy decoding, token for token: token-level
intersection (chains, block verification, trees) and string-level exact match, on a batch of prompts of different
lengths in one call, with EOS ending some outputs mid-way and the budget others; and on chat prompts (chat=True),
where the draft reads the target's templated text, spelled in its own ids.
"""

from __future__ import annotations

import pytest

from verispec.crossvocab import BridgedRunner
from verispec.engine.config import SpecConfig
from verispec.engine.generator import SpeculativeGenerator
from verispec.sampling import SamplingParams

from ..helpers.cross_tok import SAMPLES
from .fixed_pair import pair

GREEDY = SamplingParams(temperature=0.0)
MAX_NEW = 24
# the target's greedy output ends with EOS after 7, 3, 5, 9, 3 and 2 tokens for the first six, runs to the budget for
# the others
PROMPTS = ["ecé", "b.h,c", " h", "hé", "cgccé", "é", SAMPLES[0], SAMPLES[6], SAMPLES[3], "ecé"]
CHATS = [
    [{"role": "user", "content": "abc abd"}],
    [{"role": "user", "content": "é"}, {"role": "assistant", "content": "f a"}, {"role": "user", "content": "hé"}],
    [{"role": "user", "content": SAMPLES[3]}],
    [{"role": "user", "content": ""}],
]
CONFIGS = {
    "auto": "draft=model,gamma=4",  # cross_vocab=auto: the tokenizers differ, so tli
    "tli-chain": "draft=model,cross_vocab=tli,gamma=4,stop_below=none",
    "tli-block": "draft=model,cross_vocab=tli,gamma=4,stop_below=none,verify=block",
    "tli-tree": "draft=model,cross_vocab=tli,tree=3-2-1",
    "tli-tree-iid": "draft=model,cross_vocab=tli,tree=2-2,verify=iid",
    "slem": "draft=model,cross_vocab=slem,gamma=4",
}


def _outcomes(completions):
    return [(c.token_ids, c.finish_reason, c.text) for c in completions]


@pytest.fixture(scope="module")
def plain():
    """The target's own greedy outputs (plain decoding) of PROMPTS and CHATS."""
    target, _ = pair(0, True)
    gen = SpeculativeGenerator(target, config=SpecConfig(draft="none"))
    return (
        _outcomes(gen.generate(PROMPTS, GREEDY, max_new_tokens=MAX_NEW)),
        _outcomes(gen.generate(CHATS, GREEDY, max_new_tokens=MAX_NEW, chat=True)),
    )


def test_prompts_cover_eos_and_length(plain):
    outs, chats = plain
    stops = [len(t) for t, reason, _ in outs if reason == "stop"]
    assert stops == [7, 3, 5, 9, 3, 2, 7]
    assert sum(reason == "length" for _, reason, _ in outs) == 3
    assert all(reason == "length" and len(t) == MAX_NEW for t, reason, _ in chats)


@pytest.mark.parametrize("agree", [True, False], ids=["agreeing", "independent"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_equals_plain(name, agree, plain):
    target, draft = pair(0, agree)
    gen = SpeculativeGenerator(target, draft, config=SpecConfig.parse(CONFIGS[name]))
    assert isinstance(gen.core.proposer.runner, BridgedRunner)
    assert _outcomes(gen.generate(PROMPTS, GREEDY, max_new_tokens=MAX_NEW)) == plain[0]
    stats = gen.last_stats
    assert stats.drafted > 0  # speculation happened ...
    if agree:  # ... and drafts were kept (the independent random draft's greedy guesses never are)
        assert stats.accepted > 0


@pytest.mark.parametrize("name", ["tli-chain", "tli-tree", "slem"])
def test_greedy_chat_equals_plain(name, plain):
    """chat=True: the target's template is applied, and the draft reads that text (its runner is filled with the
    target's templated prompt spelled in draft ids: the same text, the specials by content)."""
    target, draft = pair(0, True)
    gen = SpeculativeGenerator(target, draft, config=SpecConfig.parse(CONFIGS[name]))
    runner = gen.core.proposer.runner
    filled = []
    fill = runner.inner.fill

    def recording(seqs, capacity):
        filled.extend(list(s) for s in seqs)
        return fill(seqs, capacity)

    runner.inner.fill = recording
    assert _outcomes(gen.generate(CHATS, GREEDY, max_new_tokens=MAX_NEW, chat=True)) == plain[1]
    assert gen.last_stats.drafted > 0 and gen.last_stats.accepted > 0
    texts = [target.tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m in CHATS]
    assert texts == [draft.tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m in CHATS]
    prompts = [gen.encode(m, chat=True) for m in CHATS]
    assert [target.tokenizer.decode(p) for p in prompts] == texts
    # the draft's rows: each prompt but its pending token, as draft ids, decoding to the target's templated text
    want = {draft.tokenizer.decode([d for t in p[:-1] for d in runner.map.spell(t)]) for p in prompts}
    assert {draft.tokenizer.decode(ids) for ids in filled} == want
    assert want == {target.tokenizer.decode(p[:-1]) for p in prompts}
    assert all("<|im_start|>" in w and "<|im_end|>" in w for w in want)
