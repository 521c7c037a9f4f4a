"""Certifying an OpenAI-compatible endpoint (`certify generate --method openai`).

A live `verispec serve` (tiny random models on disk, 127.0.0.1) PASSES with exact logprob parity and the token ids
it returns (return_tokens_as_token_ids); the same server with a deliberately broken verifier FAILS; the two-sample
test runs against a second endpoint with speculation off. The HTTP client's manners are tested on a mock transport
(no server): retries on 429 honouring Retry-After, an optional field the server refuses dropped and reported, a
refused sampling field an error. The drift-tolerant test is checked for its level and its power.
Sizes: N = 400 continuations of L = 4 tokens on one prompt, family-wise level 0.01 (the first-token law pinned to
TV < 0.2 at power 0.99, asserted); the broken verifier's first-token deviation at this draft is far above that.
"""

from __future__ import annotations

import json
import math

import httpx
import numpy as np
import pytest

from verispec.certify.endpoint import Endpoint, EndpointError, TokenMapper
from verispec.certify.generate import certify_generate
from verispec.certify.methods import MethodSpec, _load, build_method
from verispec.certify.mutants import mutant
from verispec.certify.stats import tolerant_tv_test
from verispec.cli import main
from verispec.engine.config import SpecConfig
from verispec.engine.generator import SpeculativeGenerator
from verispec.sampling import SamplingParams

from ..helpers.server import LiveServer

PROMPT = [3, 7, 7, 12, 3, 7]
PARAMS = SamplingParams(temperature=0.7, top_k=10)
N, L = 400, 4


def _server(models, inject=None, draft=True):
    target, draft_model = (_load(p, "float32") for p in models)
    cfg = SpecConfig(draft="model", gamma=3) if draft else SpecConfig(draft="none")
    if inject:  # the mutant's engine (certify.mutants)
        gen = mutant(inject, cfg).generator(target, draft_model, cfg)
    else:
        gen = SpeculativeGenerator(target, draft_model if draft else None, config=cfg)
    return LiveServer(gen, max_batch=8, max_queue=256)


def _spec(models, url) -> MethodSpec:
    return MethodSpec(method="openai", target=models[0], base_url=url, model_name="tiny", max_in_flight=8)


@pytest.mark.statistical
def test_verispec_server_passes_with_exact_logprobs_and_ids(models, tmp_path):
    """Through the CLI: PASS, every token id taken from token_id:N (none mapped from text), the returned raw
    logprobs equal the float32 recompute (max |diff| < 1e-4), every request's seed in the report."""
    with _server(models) as s:
        out = tmp_path / "out"
        argv = ["certify", "generate", "--method", "openai", "--base-url", s.url, "--model", "tiny"]
        argv += ["--target", models[0], "--temperature", "0.7", "--top-k", "10", "--samples", str(N)]
        argv += ["--length", str(L), "--two-sample-tokens", "1", "--out", str(out)]
        code = main(argv + ["--prompt", "a b c a b"])
    report = json.loads((out / "generate-certificate.json").read_text())
    assert code == 0 and report["verdict"] == "PASS", (out / "generate-certificate.md").read_text()
    first = [t for t in report["tests"] if t["kind"] == "first-token"]
    assert first and all(t["detectable"] < 0.2 for t in first)
    e = report["endpoint"]
    assert e["requests"] == N and e["mapped_by_text"] == 0 and e["unmappable"] == 0
    assert e["dropped_fields"] == ["repeat_penalty"]  # llama.cpp's name for the penalty, refused, neutral: dropped
    # no ignore_eos is sent (llama.cpp's would bias EOS away): the tiny target stops at EOS often, and those
    # continuations end with the EOS outcome appended, its logprob not compared
    # continuations end with the EOS outcome appended, its logprob not compared: every other token is
    pit_n = next(t["n"] for t in report["tests"] if t["kind"] == "pit")
    assert e["eos_appended"] > 0 and report["parity"]["tokens"] == pit_n - e["eos_appended"]
    assert e["speculation"]["draft_tokens"] > 0 and e["speculation"]["accepted_tokens"] > 0  # speculation was on
    assert report["parity"]["raw"]["max_abs"] < 1e-4, report["parity"]
    assert report["request_seeds"]["per_prompt_first_last"] == [[0, N - 1]]


@pytest.mark.statistical
def test_broken_server_fails_and_two_sample_against_a_reference_endpoint(models):
    """A server whose verifier redraws from p at a rejection (the seed's §8 mistake) FAILS; the two-sample test
    against a second endpoint (plain decoding) is part of the run and the reference endpoint's samples are drawn
    through the same client."""
    spec_off = _server(models, draft=False)
    with _server(models, inject="resample_from_p") as bad, spec_off as ref:
        ref_fn = build_method(_spec(models, ref.url))
        r = certify_generate(
            _spec(models, bad.url),
            [PROMPT],
            PARAMS,
            samples=N,
            length=L,
            two_sample_tokens=1,
            reference_fn=ref_fn,
            show_progress=False,
        )
    assert not r.passed, r.to_markdown()
    assert {t.kind for t in r.tests} >= {"first-token", "two-sample"}
    two = [t for t in r.tests if t.kind == "two-sample"]
    assert two and two[0].n == 2 * N
    assert min(t.holm_pvalue for t in r.tests if t.kind == "first-token") < 1e-4
    first = next(t for t in r.tests if t.kind == "first-token")
    dev = first.deviations[0]  # the report says how: the token whose frequency is furthest from its probability
    assert abs(dev["observed"] - dev["expected"]) > 0.03 and "Where it deviates" in r.to_markdown()


# --- the client, on a mock transport -------------------------------------------------------------------------


class _Tok:
    """A 4-token tokenizer: ids 0..3 print as 'a', 'b', 'c', and 'a' again (shared by ids 0 and 3)."""

    def __len__(self):
        return 4

    def batch_decode(self, ids):
        return ["abca"[i[0]] for i in ids]


def _mock(handler):
    return Endpoint("http://mock", "m", transport=httpx.MockTransport(handler), backoff_s=0.0)


def _choice(tokens, lps=None, finish="length"):
    lp = {"tokens": tokens, "token_logprobs": lps or [-1.0] * len(tokens)}
    return httpx.Response(200, json={"choices": [{"text": "", "logprobs": lp, "finish_reason": finish}]})


def test_client_retries_429_and_drops_a_refused_optional_field():
    calls = []

    def handler(request):
        body = json.loads(request.content)
        calls.append(body)
        if len(calls) == 1:
            return httpx.Response(429, headers={"Retry-After": "0"}, json={"error": "busy"})
        if "return_tokens_as_token_ids" in body:
            return httpx.Response(400, json={"error": "unknown field return_tokens_as_token_ids"})
        return _choice(["b", "c"])

    ep = _mock(handler)
    tokens, lps = ep.draw([1, 2], SamplingParams(top_k=3), [5, 6], 2, TokenMapper(_Tok()))
    assert tokens == [[1, 2], [1, 2]] and lps == [[-1.0, -1.0], [-1.0, -1.0]]
    assert ep.log.retries == 1 and ep.log.dropped_fields == ["return_tokens_as_token_ids"]
    assert ep.log.mapped_by_text == 4 and ep.log.requests == 2
    assert calls[-1]["seed"] in (5, 6) and calls[-1]["top_k"] == 3 and calls[-1]["prompt"] == [1, 2]
    assert calls[-1]["min_p"] == 0.0 and calls[-1]["repeat_penalty"] == 1.0  # neutral knobs sent explicitly


def test_client_sends_text_to_a_server_refusing_token_ids_and_checks_its_prompt_length():
    def handler(request):
        body = json.loads(request.content)
        if isinstance(body["prompt"], list):
            return httpx.Response(422, json={"detail": "prompt: Input should be a valid string"})
        r = _choice(["b"])
        return httpx.Response(200, json=json.loads(r.content) | {"usage": {"prompt_tokens": len(body["prompt"])}})

    ep = _mock(handler)
    tokens, _ = ep.draw([0, 1], SamplingParams(), [0], 1, TokenMapper(_Tok()), prompt_text="ab")
    assert tokens == [[1]] and ep.log.dropped_fields == ["prompt as token ids"]
    with pytest.raises(EndpointError, match="into 3 tokens, the certifier's tokenizer into 2"):
        _mock(handler).draw([0, 1], SamplingParams(), [0], 1, TokenMapper(_Tok()), prompt_text="abc")


def test_client_refused_sampling_field_is_an_error_and_shared_text_is_reported():
    ep = _mock(lambda r: httpx.Response(422, json={"detail": "extra field top_k not permitted"}))
    with pytest.raises(EndpointError, match="refused 'top_k'"):
        ep.draw([1], SamplingParams(top_k=2), [0], 2, TokenMapper(_Tok()))
    ep = _mock(lambda r: _choice(["token_id:2", "a"], finish="stop"))
    tokens, lps = ep.draw([1], SamplingParams(), [0], 3, TokenMapper(_Tok()), eos=[1])
    assert tokens == [None] and lps == [None]  # 'a' is the text of ids 0 and 3: no sample, no made-up token
    assert len(ep.log.unmappable) == 1 and "'a'" in ep.log.unmappable[0] and ep.log.eos_appended == 0


def test_client_writes_every_eos_id_as_one_outcome_and_appends_it_after_a_stop():
    replies = iter([_choice(["token_id:2", "token_id:3", "token_id:0"]), _choice(["b"], finish="stop")])
    ep = _mock(lambda r: next(replies))
    ep.max_in_flight = 1
    tokens, lps = ep.draw([1], SamplingParams(), [0, 1], 3, TokenMapper(_Tok()), eos=[0, 3])
    assert tokens == [[2, 0], [1, 0]]  # a returned EOS id (3) written as the set's first, cut after it; appended
    assert lps[0][0] == -1.0 and all(math.isnan(x[-1]) for x in lps) and ep.log.eos_appended == 1


def test_openai_method_needs_an_endpoint():
    with pytest.raises(ValueError, match="base_url and model_name"):
        MethodSpec(method="openai", target="x")
    with pytest.raises(ValueError, match="http"):
        Endpoint("localhost:8000", "m")


# --- the drift-tolerant test ----------------------------------------------------------------------------------


def _drifted(p: np.ndarray, tv: float) -> np.ndarray:
    """(1 - a) p + a onehot(argmin p), a chosen so that its TV from p is `tv`."""
    j = int(np.argmin(p))
    a = tv / (1 - p[j])
    return (1 - a) * p + a * np.eye(len(p))[j]


@pytest.mark.statistical
def test_tolerant_tv_test_level_and_power():
    """At drift exactly the tolerance (the boundary of H0) the test rejects at most at its level (200 runs,
    level 0.05: at most 10 + a binomial margin; conservative by construction); a drift of its stated detectable
    TV is rejected in at least 99 of 100 runs, as the power statement says. 20 tokens: each its own bin."""
    rng = np.random.default_rng(0)
    p = rng.dirichlet(np.ones(20))
    tol, n, level = 0.05, 4000, 0.05
    at_boundary = _drifted(p, tol)
    rejected = sum(tolerant_tv_test(rng.multinomial(n, at_boundary), p, tol).pvalue < level for _ in range(200))
    assert rejected <= 10 + 3 * np.sqrt(200 * level)
    d = tolerant_tv_test(rng.multinomial(n, p), p, tol).detectable(level, 0.99)
    assert tol < d < 0.2
    far = _drifted(p, d)
    hits = sum(tolerant_tv_test(rng.multinomial(n, far), p, tol).pvalue < level for _ in range(100))
    assert hits >= 99
