"""logit_bias (OpenAI's, string keys), allowed_token_ids and bad_words (vLLM's extra fields; strings tokenized by
the server) over the live server: the same tokens as the engine given the equivalent SamplingParams."""

from __future__ import annotations

import pytest

from verispec.engine.config import SpecConfig
from verispec.engine.generator import SpeculativeGenerator
from verispec.sampling import SamplingParams

from ..helpers.server import MODEL, LiveServer

# the tiny tokenizer: "a" .. "z" are ids 3 .. 28, one word per token; " b" tokenizes as "b"
OPTIONS = dict(logit_bias={"5": 3.0, "6": -2.0}, allowed_token_ids=[3, 4, 5, 6, 7], bad_words=["b", "c d"])
PARAMS = dict(logit_bias={5: 3.0, 6: -2.0}, allowed_token_ids=[3, 4, 5, 6, 7], bad_words=[[4], [5, 6]])


@pytest.fixture(scope="module")
def server(tiny_target, tiny_noisy):
    with LiveServer(
        SpeculativeGenerator(tiny_target, tiny_noisy, config=SpecConfig(draft="model", gamma=3)),
        max_batch=8,
        max_queue=64,
    ) as s:
        yield s


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_token_options_give_the_engines_tokens(server, tiny_target, temperature):
    body = dict(model=MODEL, prompt="a c e", max_tokens=12, temperature=temperature, seed=3)
    out = server.client().completions.create(
        **body, logit_bias=OPTIONS["logit_bias"], extra_body={k: OPTIONS[k] for k in ("allowed_token_ids", "bad_words")}
    )
    ids = SpeculativeGenerator(tiny_target, config=SpecConfig(draft="none")).encode("a c e")
    ref = SpeculativeGenerator(tiny_target, config=SpecConfig(draft="none")).generate(
        [ids], SamplingParams(temperature=temperature, seed=3, **PARAMS), max_new_tokens=12
    )[0]
    if temperature == 0.0:  # greedy: plain decoding's tokens exactly (sampled: the same law, other draws)
        assert out.choices[0].text == ref.text
    words = out.choices[0].text.split()
    assert words and set(words) <= {"a", "c", "d", "e"}  # allowed ("</s>" ends it), never "b"
    assert all((x, y) != ("c", "d") for x, y in zip(["e"] + words, words))


def test_chat_takes_them_too(server):
    out = server.client().chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "a b"}],
        max_tokens=8,
        temperature=0,
        extra_body={"allowed_token_ids": [3, 7], "bad_words": ["a"]},
    )
    assert set(out.choices[0].message.content.split()) <= {"e"}
