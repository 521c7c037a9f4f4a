"""Bad input to the generator and the session: a clear ValueError, before any model work."""

import pytest
import torch

from verispec.engine import SpeculativeGenerator
from verispec.engine.adaptive import MAX_GAMMA
from verispec.engine.config import SpecConfig
from verispec.sampling import SamplingParams, verify_chain

PROMPTS = [[3, 4, 5, 3, 4, 5, 3, 4], [9, 10]]

GREEDY = SamplingParams(temperature=0)


@pytest.fixture(scope="module")
def gen(tiny_target, tiny_draft):
    return SpeculativeGenerator(tiny_target, tiny_draft, config=SpecConfig(draft="model", gamma=2))


@pytest.mark.parametrize("prompts", [None, 5, [1.7, 2.2], [], "", [[]], [True, False], b"abc", [["a"]]])
def test_prompts_of_the_wrong_kind(gen, prompts):
    with pytest.raises(ValueError):
        gen.generate(prompts, GREEDY, max_new_tokens=2)


def test_chat_messages_need_role_and_content(gen):
    with pytest.raises(ValueError, match="role"):
        gen.generate([{"content": "a b"}], GREEDY, max_new_tokens=2)
    with pytest.raises(ValueError, match="content"):
        gen.generate([[{"role": "user", "content": 3}]], GREEDY, max_new_tokens=2)
    out = gen.generate([{"role": "user", "content": "a b"}], GREEDY, max_new_tokens=2)  # one conversation
    assert len(out) == 1 and out[0].prompt_token_ids == gen.encode("a b", chat=True)


def test_a_string_stop_is_one_stop_string(gen):
    """`stop="b c"` must stop at "b c", not at the first b, space or c (a string split into characters)."""
    free = gen.generate(PROMPTS[0], GREEDY, max_new_tokens=12)[0]
    words = free.text.split()
    assert len(words) >= 4
    target = " ".join(words[2:4])
    out = gen.generate(PROMPTS[0], GREEDY, max_new_tokens=12, stop=target)[0]
    assert out.finish_reason == "stop" and out.stop_reason == target
    assert out.text == free.text[: free.text.find(target)]
    assert gen.generate(PROMPTS[0], GREEDY, max_new_tokens=12, stop=None)[0].token_ids == free.token_ids
    with pytest.raises(ValueError, match="stop"):
        gen.generate(PROMPTS[0], GREEDY, max_new_tokens=2, stop=5)
    with pytest.raises(ValueError, match="non-empty"):
        gen.generate(PROMPTS[0], GREEDY, max_new_tokens=2, stop=[""])


@pytest.mark.parametrize("gamma", [10**6, MAX_GAMMA + 1, -1, 2.5, True, "4"])
def test_nonsense_gamma_is_refused(tiny_target, gamma):
    with pytest.raises(ValueError, match="gamma"):
        SpeculativeGenerator(tiny_target, config=SpecConfig(draft="ngram", gamma=gamma))


def test_per_request_gamma_is_checked_and_capped(gen):
    sess = gen.session()
    with pytest.raises(ValueError, match="gamma"):
        sess.add(PROMPTS[0], GREEDY, gamma=10**6)
    sess.add(PROMPTS[0], GREEDY, gamma=MAX_GAMMA, max_new_tokens=3)
    assert sess.pending[0].gamma == gen.core.controller.max_gamma == 2


def test_params_and_budget(gen):
    with pytest.raises(ValueError, match="SamplingParams"):
        gen.generate(PROMPTS[0], {"temperature": 0})
    with pytest.raises(ValueError, match="one per prompt"):
        gen.generate([PROMPTS[0], PROMPTS[1]], [GREEDY])
    with pytest.raises(ValueError, match="max_new_tokens"):
        gen.generate(PROMPTS[0], GREEDY, max_new_tokens=0)


def test_generators_must_be_generators():
    p = torch.full((2, 2, 4), 0.25)
    ids = torch.zeros((2, 1), dtype=torch.int64)
    with pytest.raises(ValueError, match=r"torch\.Generator"):
        verify_chain(p, ids, None, generators=[1, 2])
    with pytest.raises(ValueError, match="one entry per row"):
        verify_chain(p, ids, None, generators=torch.Generator())
