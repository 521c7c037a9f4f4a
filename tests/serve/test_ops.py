"""Operator features of `verispec serve` on a live server over tiny models: API key, CORS, tokenizer routes,
/version, /v1/models/{id}."""

from __future__ import annotations

import httpx
import openai
import pytest

import verispec
from verispec.engine.config import SpecConfig
from verispec.engine.generator import SpeculativeGenerator
from verispec.rollout.client import RolloutClient, RolloutServerError

from ..helpers.server import MODEL, LiveServer
from ..helpers.tiny import EOS

KEY = "s3cret"
ORIGIN = "https://dash.example"


@pytest.fixture(scope="module")
def locked(tiny_target, tiny_draft):
    gen = SpeculativeGenerator(tiny_target, tiny_draft, config=SpecConfig(draft="model", gamma=3))
    with LiveServer(gen, max_batch=4, api_key=KEY, cors_origins=[ORIGIN]) as s:
        yield s


def test_the_api_key_guards_every_route_but_health_version_metrics(locked):
    url = locked.url
    for path in ("/health", "/health/", "/version", "/metrics"):
        assert httpx.get(url + path).status_code == 200, path
    for method, path in [("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/generate/"),
                         ("POST", "/update_weights_from_tensor"), ("POST", "/tokenize")]:  # fmt: skip
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": KEY}):
            r = httpx.request(method, url + path, headers=headers, json={})
            assert r.status_code == 401, (path, headers)
            assert r.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        locked.client().models.list()
    good = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
    assert [m.id for m in good.models.list().data] == [MODEL]
    text = "".join(
        c.choices[0].text for c in good.completions.create(model=MODEL, prompt="a b", max_tokens=6, stream=True)
    )
    assert isinstance(text, str)
    with RolloutClient(url, api_key=KEY) as c:
        assert len(c.generate([[3, 7]], n=2, max_tokens=4, seed=0)["completion_ids"]) == 2
    with RolloutClient(url) as c, pytest.raises(RolloutServerError) as e:
        c.weight_version()
    assert e.value.status == 401


def test_cors_preflight_and_headers(locked):
    pre = httpx.options(
        locked.url + "/v1/completions",
        headers={"origin": ORIGIN, "access-control-request-method": "POST",
                 "access-control-request-headers": "authorization,content-type"},
    )  # fmt: skip
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == ORIGIN
    r = httpx.get(locked.url + "/version", headers={"origin": ORIGIN})
    assert r.headers["access-control-allow-origin"] == ORIGIN
    other = httpx.options(
        locked.url + "/v1/completions",
        headers={"origin": "https://elsewhere.example", "access-control-request-method": "POST"},
    )
    assert "access-control-allow-origin" not in other.headers


def test_tokenize_detokenize_version_and_model_card(locked, tiny_target):
    auth = {"authorization": f"Bearer {KEY}"}
    tok = tiny_target.tokenizer
    r = httpx.post(locked.url + "/tokenize", headers=auth, json={"model": MODEL, "prompt": "a b c"}).json()
    assert r["tokens"] == tok("a b c")["input_ids"] and r["count"] == len(r["tokens"]) and r["max_model_len"]
    chat = httpx.post(locked.url + "/tokenize", headers=auth, json={"messages": [{"role": "user", "content": "a"}]})
    expected = tok.apply_chat_template([{"role": "user", "content": "a"}], add_generation_prompt=True, tokenize=True)
    assert chat.json()["tokens"] == list(expected["input_ids"] if hasattr(expected, "keys") else expected)
    d = httpx.post(locked.url + "/detokenize", headers=auth, json={"tokens": r["tokens"]}).json()
    assert d["prompt"] == tok.decode(r["tokens"])
    for path, body, param in [
        ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "a"}]}, "prompt"),
        ("/tokenize", {}, "prompt"),
        ("/detokenize", {"tokens": [EOS, 999]}, "tokens"),
        ("/tokenize", {"prompt": "a", "extra": 1}, "extra"),
    ]:
        err = httpx.post(locked.url + path, headers=auth, json=body)
        assert err.status_code == 400 and err.json()["error"]["param"] == param, (path, body)
    assert httpx.post(locked.url + "/tokenize", headers=auth, json={"model": "other", "prompt": "a"}).status_code == 404
    assert httpx.get(locked.url + "/version").json() == {"version": verispec.__version__}
    card = httpx.get(locked.url + f"/v1/models/{MODEL}", headers=auth).json()
    assert card["id"] == MODEL and card["object"] == "model"
    assert httpx.get(locked.url + "/v1/models/nope", headers=auth).status_code == 404
