"""One request never hurts another, over HTTP against a live server on a tiny model (issue: degenerate numbers, fault
isolation, fair admission):

- a temperature, penalty or bias whose arithmetic degenerates is refused at validation with a 400 naming the field,
  on the OpenAI routes and /generate/ alike; a property test over floats near every boundary (subnormals, 1e-38,
  1e38, +-0) finds no 500 and no 200 reply with a missing or non-finite logprob;
- a request whose model distribution is NaN (its prompt holds a token whose embedding is NaN) fails alone with a
  500 and a request id, while concurrent requests get exactly the tokens they get alone (seeded);
- admission counts choices (prompts x n), not requests: a request larger than --max-batch + --max-queue is a 400
  naming `n`, and one whose waiting choices pass --max-queue a 429."""

from __future__ import annotations

import asyncio
import math

import httpx
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from verispec.engine import SpeculativeGenerator
from verispec.engine.config import SpecConfig
from verispec.model.loading import LoadedModel
from verispec.sampling import ParamError, SamplingParams

from ..helpers.server import LiveServer, wait_until
from ..helpers.tiny import loaded, make_model, make_tokenizer

POISON = 30


@pytest.fixture(scope="module")
def served():
    """A server on a tiny model: max_batch 4, max_queue 6 (choices)."""
    gen = SpeculativeGenerator(loaded(0), config=SpecConfig(draft="ngram", gamma=2))
    with LiveServer(gen, max_batch=4, max_queue=6, strict_on_policy=False) as s:
        yield s


@pytest.fixture(scope="module")
def poisoned():
    """A server whose model gives NaN logits after token POISON (its embedding is NaN), and only there."""
    model = make_model(0)
    with torch.no_grad():
        model.model.embed_tokens.weight[POISON] = float("nan")
    gen = SpeculativeGenerator(
        LoadedModel(model, make_tokenizer(), "poisoned"), config=SpecConfig(draft="ngram", gamma=2)
    )
    with LiveServer(gen, max_batch=4) as s:
        yield s


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", 1e-38),  # subnormal in float32
        ("temperature", 1e-45),
        ("temperature", 5e-324),
        ("temperature", 3.5e38),  # inf in float32
        ("temperature", 1e300),
        ("repetition_penalty", 1e-30),
        ("repetition_penalty", 1e30),
    ],
)
def test_degenerate_numbers_are_refused_naming_the_field(field, value):
    with pytest.raises(ParamError) as e:
        SamplingParams(**{field: value})
    assert e.value.field == field


def test_the_boundaries_themselves_are_accepted_and_negative_zero_is_zero():
    assert SamplingParams(temperature=1.2e-38).temperature == 1.2e-38
    assert SamplingParams(temperature=3.4e38).temperature == 3.4e38
    t = SamplingParams(temperature=-0.0)
    assert t.greedy and math.copysign(1.0, t.temperature) == 1.0
    assert SamplingParams(repetition_penalty=0.01).repetition_penalty == 0.01


edge = st.sampled_from(
    [0.0, -0.0, 5e-324, 1e-320, 1e-45, 1e-40, 1e-38, 1.2e-38, 1e-6, 1e-4, 0.5, 1.0, 2.0, 100.0, 1e4, 1e38, 3.5e38]
)
number = edge | st.floats(allow_nan=False, allow_infinity=False, width=64) | edge.map(lambda x: -x)
FIELDS = st.fixed_dictionaries(
    {},
    optional={
        "temperature": number,
        "top_p": number,
        "min_p": number,
        "presence_penalty": number,
        "frequency_penalty": number,
        "repetition_penalty": number,
        "logit_bias": st.dictionaries(st.sampled_from(["3", "5", "9"]), number, max_size=2),
    },
)


def _check_reply(r: httpx.Response, body: dict, route: str) -> None:
    assert r.status_code in (200, 400), (route, body, r.status_code, r.text)
    if r.status_code == 400:
        assert r.json()["error"]["message"]
        return
    out = r.json()
    if route == "/generate/":
        assert all(len(ids) == len(lps) > 0 for ids, lps in zip(out["completion_ids"], out["logprobs"]))
        lps = [x for row in out["logprobs"] for x in row]
    else:
        lp = out["choices"][0]["logprobs"]
        assert lp is not None and len(lp["token_logprobs"]) == len(lp["tokens"]) > 0, (body, out)
        lps = lp["token_logprobs"]
    assert all(isinstance(x, float) and math.isfinite(x) for x in lps), (body, lps)


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(fields=FIELDS, seeded=st.booleans())
def test_no_number_gives_a_500_or_a_reply_without_logprobs(served, fields, seeded):
    body = {"model": "tiny", "prompt": [3, 7, 7, 12], "max_tokens": 3, "logprobs": 1, **fields}
    if seeded:
        body["seed"] = 5
    r = httpx.post(served.url + "/v1/completions", json=body, timeout=60)
    _check_reply(r, body, "/v1/completions")
    rl = {"prompts": [[3, 7, 7, 12]], "n": 2, "max_tokens": 3, **{k: v for k, v in fields.items() if k != "logit_bias"}}
    r = httpx.post(served.url + "/generate/", json=rl, timeout=60)
    _check_reply(r, rl, "/generate/")


async def _complete(c: httpx.AsyncClient, prompt: list[int], seed: int, **kw) -> httpx.Response:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 16, "seed": seed, "ignore_eos": True, **kw}
    return await c.post("/v1/completions", json=body)


def test_a_request_whose_distribution_is_nan_fails_alone(poisoned):
    served = poisoned
    good = [([3, 7, 7, 12], 1), ([5, 9, 11, 4], 2), ([8, 8, 9, 10], 3)]

    async def run(with_bad: bool):
        async with httpx.AsyncClient(base_url=served.url, timeout=120) as c:
            calls = [_complete(c, p, s, temperature=1.0, logit_bias={str(POISON): -100}) for p, s in good]
            if with_bad:
                calls.insert(1, _complete(c, [5, POISON, 11, 4], 4, temperature=1.0))
            return await asyncio.gather(*calls)

    alone = asyncio.run(run(False))
    mixed = asyncio.run(run(True))
    bad = mixed.pop(1)
    assert bad.status_code == 500 and "request id" in bad.json()["error"]["message"]
    assert [r.status_code for r in mixed] == [200, 200, 200]
    assert [r.json()["choices"][0]["text"] for r in mixed] == [r.json()["choices"][0]["text"] for r in alone]


def test_a_tiny_temperature_in_a_batch_is_a_400_and_the_others_succeed(served):
    async def run():
        async with httpx.AsyncClient(base_url=served.url, timeout=120) as c:
            return await asyncio.gather(
                _complete(c, [3, 7, 7, 12], 1, temperature=1.0, stream=True),
                _complete(c, [3, 7, 7, 12], 2, temperature=1e-40, logprobs=1),
                _complete(c, [5, 9, 11, 4], 3, temperature=0.7, stream=True),
            )

    ok1, tiny, ok2 = asyncio.run(run())
    assert tiny.status_code == 400 and tiny.json()["error"]["param"] == "temperature"
    assert ok1.status_code == ok2.status_code == 200 and "[DONE]" in ok1.text and "error" not in ok1.text
    r = httpx.post(served.url + "/generate/", json={"prompts": [[3, 4]], "temperature": 1e-40}, timeout=60)
    assert r.status_code == 400 and "temperature" in r.text


def test_admission_counts_choices(served):
    """max_batch 4 + max_queue 6: 11 choices are a 400 naming n at once; with a long request holding every row, 7
    waiting choices are a 429 and 6 are let in."""
    r = httpx.post(served.url + "/v1/completions", json={"model": "tiny", "prompt": "a b", "n": 11}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "n" and "--max-queue" in r.text
    r = httpx.post(served.url + "/generate/", json={"prompts": [[3, 4]] * 6, "n": 2, "max_tokens": 2}, timeout=60)
    assert r.status_code == 400 and "12 choices" in r.text
    engine = served.engine

    async def run():
        async with httpx.AsyncClient(base_url=served.url, timeout=300) as c:
            hold = asyncio.ensure_future(
                c.post(
                    "/v1/completions",
                    json={"model": "tiny", "prompt": [3, 4], "n": 4, "max_tokens": 200, "ignore_eos": True},
                )
            )
            await asyncio.to_thread(wait_until, lambda: engine.num_running == 4, "the long request to hold every row")
            seven = await c.post("/v1/completions", json={"model": "tiny", "prompt": [3, 4], "n": 7, "max_tokens": 2})
            six = await c.post("/v1/completions", json={"model": "tiny", "prompt": [3, 4], "n": 6, "max_tokens": 2})
            return seven, six, await hold

    seven, six, hold = asyncio.run(run())
    assert seven.status_code == 429 and "choices are waiting" in seven.json()["error"]["message"]
    assert six.status_code == 200 and len(six.json()["choices"]) == 6
    assert hold.status_code == 200
