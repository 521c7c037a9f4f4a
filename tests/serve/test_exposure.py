"""A server that can be exposed (issue 29): weight routes off by default and locked to --weight-dir, a Host allow-list,
the API key on every route but the open ones, bodies bounded while they are read, nothing CPU-heavy on the event
loop, caps checked before any work, and client errors as 4xx in OpenAI's shape."""

from __future__ import annotations

import asyncio
import json
import os
import threading
from dataclasses import replace

import httpx
import pytest
import torch
from safetensors.torch import save_file

from verispec.engine.config import SpecConfig
from verispec.engine.generator import SpeculativeGenerator
from verispec.rollout.client import RolloutClient
from verispec.serve import create_app
from verispec.serve.access import BodyLimit, allowed_hosts, is_loopback
from verispec.serve.protocol import MAX_PROMPTS, MAX_STOP

from ..cli.test_checks import usage_error
from ..helpers.server import HANG_GUARD_S, MODEL, LiveServer, wait_until
from ..helpers.tiny import loaded

KEY = "k3y"


@pytest.fixture(scope="module")
def server(tiny_target):
    """The defaults: no weight updates, no key, loopback Host names only."""
    with LiveServer(SpeculativeGenerator(tiny_target, config=SpecConfig(draft="none")), max_batch=4) as s:
        yield s


def _err(r: httpx.Response, status: int, param: str | None = None) -> str:
    assert r.status_code == status, r.text
    err = r.json()["error"]  # OpenAI's shape
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err["message"]


# --- 1. weight routes, hosts, keys ------------------------------------------------------------------------------


def test_weight_routes_are_off_by_default(server):
    octets = {"content-type": "application/octet-stream"}
    r = httpx.post(server.url + "/update_weights_from_tensor", content=b"x" * 100, headers=octets)
    assert "--enable-weight-updates" in _err(r, 403)
    r = httpx.post(server.url + "/update_weights_from_disk", json={"model_path": "/etc/passwd"})
    assert "--enable-weight-updates" in _err(r, 403) and "passwd" not in r.text
    assert httpx.get(server.url + "/get_weight_version").json() == {"weight_version": 0}


def test_updates_from_disk_only_under_the_weight_dirs_with_one_message(tmp_path):
    inside, outside = tmp_path / "weights", tmp_path / "elsewhere"
    inside.mkdir(), outside.mkdir()
    target = loaded(0)
    state = {k: v.clone() for k, v in loaded(5).model.state_dict().items()}
    save_file(state, str(outside / "model.safetensors"))
    (inside / "escape.safetensors").symlink_to(outside / "model.safetensors")  # a symlink out of the dir
    (inside / "linked").symlink_to(outside, target_is_directory=True)
    (inside / "empty").mkdir()
    unreadable = inside / "locked.safetensors"
    save_file(state, str(unreadable))
    unreadable.chmod(0)
    gen = SpeculativeGenerator(target, config=SpecConfig(draft="none"))
    with LiveServer(gen, enable_weight_updates=True, weight_dirs=[inside]) as s:
        messages = set()
        paths = [outside / "model.safetensors", outside, inside / "escape.safetensors", inside / "linked",
                 inside / "missing", inside / "empty", "/etc/passwd", "/", "../" * 20 + "etc", "a\x00b"]  # fmt: skip
        if os.geteuid() != 0:  # root reads a file whatever its mode
            paths.append(unreadable)
        for path in paths:
            r = httpx.post(s.url + "/update_weights_from_disk", json={"model_path": str(path)})
            messages.add(_err(r, 400, "model_path").replace(repr(str(path)), "PATH"))
        assert len(messages) == 1, messages  # outside, missing, unreadable: nothing tells them apart
        unreadable.unlink()
        save_file(state, str(inside / "model.safetensors"))
        r = httpx.post(s.url + "/update_weights_from_disk", json={"model_path": str(inside / "model.safetensors")})
        assert r.status_code == 200 and r.json()["weight_version"] == 1
    assert torch.equal(target.model.state_dict()["model.norm.weight"], state["model.norm.weight"])


def test_the_cli_refuses_weight_updates_beyond_loopback_without_a_key(capsys, monkeypatch):
    monkeypatch.delenv("VERISPEC_API_KEY", raising=False)
    msg = usage_error(["serve", "--host", "0.0.0.0", "--enable-weight-updates"], capsys)
    assert "--api-key" in msg
    assert "--enable-weight-updates" in usage_error(["serve", "--weight-dir", "/tmp"], capsys)


def test_loopback_and_host_lists():
    assert all(is_loopback(h) for h in ("127.0.0.1", "localhost", "::1", "127.0.0.5", "[::1]"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "10.0.0.1", "example.com"))
    assert allowed_hosts("127.0.0.1") == ("localhost", "127.0.0.1", "::1")
    assert allowed_hosts("127.0.0.1", ["box.lan"])[-1] == "box.lan"
    assert allowed_hosts("0.0.0.0") is None and allowed_hosts("0.0.0.0", ["api.example"]) == ("api.example",)


def test_a_loopback_server_answers_only_loopback_host_names(server):
    port = server.url.rsplit(":", 1)[1]
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", "localhost", f"[::1]:{port}", f"LOCALHOST:{port}"):
        assert httpx.get(server.url + "/v1/models", headers={"host": host}).status_code == 200, host
    for host in (f"evil.example:{port}", "127.0.0.1.evil.example", ""):  # DNS rebinding names another host
        r = httpx.post(server.url + "/abort_request", json={}, headers={"host": host})
        assert "--allowed-host" in _err(r, 400), host


def test_allowed_hosts_with_wildcards(tiny_target):
    gen = SpeculativeGenerator(tiny_target, config=SpecConfig(draft="none"))
    with LiveServer(gen, allowed_hosts=("127.0.0.1", "*.example.com")) as s:
        assert httpx.get(s.url + "/health", headers={"host": "a.b.example.com"}).status_code == 200
        assert httpx.get(s.url + "/health", headers={"host": "example.com.evil"}).status_code == 400


def test_mutating_routes_take_json_bodies_only(server):
    for body, kind in ((None, None), ("abort_all=true", "application/x-www-form-urlencoded"), ("{}", "text/plain")):
        headers = {"content-type": kind} if kind else {}
        r = httpx.post(server.url + "/abort_request", content=body, headers=headers)  # what a cross-site form sends
        _err(r, 400)
    assert httpx.post(server.url + "/abort_request", json={}).json() == {"success": True}
    assert httpx.post(server.url + "/abort_request", json={"abort_all": True}).status_code == 200
    _err(httpx.post(server.url + "/abort_request", json={"rid": "x"}), 400, "rid")


def test_the_key_guards_the_docs_and_takes_the_scheme_in_any_case(tiny_target):
    with LiveServer(SpeculativeGenerator(tiny_target, config=SpecConfig(draft="none")), api_key=KEY) as s:
        for path in ("/docs", "/openapi.json", "/redoc"):
            assert httpx.get(s.url + path).status_code == 401, path
            assert httpx.get(s.url + path, headers={"authorization": f"Bearer {KEY}"}).status_code == 200, path
        for scheme in ("Bearer", "bearer", "BEARER"):
            r = httpx.get(s.url + "/v1/models", headers={"authorization": f"{scheme} {KEY}"})
            assert r.status_code == 200, scheme
        for bad in (f"Basic {KEY}", KEY, f"Bearer {KEY}x", f"Bearer{KEY}", ""):
            assert httpx.get(s.url + "/v1/models", headers={"authorization": bad}).status_code == 401, bad


# --- 2. bounded bodies ------------------------------------------------------------------------------------------


def _asgi(app, scope: dict, chunks):
    """Call an ASGI app with a body from `chunks` (an iterator); the responses' messages and how many chunks were
    read."""
    sent, read = [], [0]

    async def receive():
        try:
            chunk = next(chunks)
        except StopIteration:
            return {"type": "http.request", "body": b"", "more_body": False}
        read[0] += 1
        return {"type": "http.request", "body": chunk, "more_body": True}

    async def send(message):
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    return sent, read[0]


def _scope(path: str, headers=()) -> dict:
    return {"type": "http", "method": "POST", "path": path, "headers": list(headers), "query_string": b""}


def test_a_chunked_body_is_refused_once_it_passes_the_cap_not_after_reading_it():
    async def app(scope, receive, send):
        raise AssertionError("the route must not run")

    endless = iter(lambda: b"x" * 65536, None)  # a chunked upload with no Content-Length and no end
    sent, read = _asgi(BodyLimit(app, limit=1 << 20), _scope("/v1/completions"), endless)
    assert sent[0]["status"] == 413 and read == (1 << 20) // 65536 + 1  # the cap, and one chunk past it
    assert "--max-request-bytes" in json.loads(sent[1]["body"])["error"]["message"]
    sent, read = _asgi(BodyLimit(app, limit=100), _scope("/x", [(b"content-length", b"5000000")]), endless)
    assert sent[0]["status"] == 413 and read == 0  # refused from the header, before reading


def test_uploads_are_read_one_at_a_time(tiny_target):
    """A second upload waits, unread, while another holds the upload lock: memory holds one body at a time."""
    app = create_app(
        SpeculativeGenerator(tiny_target, config=SpecConfig(draft="none")), MODEL, enable_weight_updates=True
    )
    lock = app.state.weight_routes.lock
    headers = [(b"content-type", b"application/octet-stream"), (b"host", b"localhost")]

    async def scenario():
        reads = [0]

        async def receive():
            reads[0] += 1
            return {"type": "http.request", "body": b"x" * 1000, "more_body": True}

        async def send(message):
            pass

        await lock.acquire()  # an upload in progress
        task = asyncio.ensure_future(app(_scope("/update_weights_from_tensor", headers), receive, send))
        while not lock._waiters:  # the request has reached the lock (an event, not a delay)
            await asyncio.sleep(0)
        assert reads[0] == 0  # nothing of its body was read
        task.cancel()

    asyncio.run(scenario())


def test_json_bodies_past_the_cap_are_413(tiny_target):
    with LiveServer(SpeculativeGenerator(tiny_target, config=SpecConfig(draft="none")), max_request_bytes=4096) as s:
        big = {"model": MODEL, "prompt": "a " * 5000, "max_tokens": 1}

        def chunks():
            data = json.dumps(big).encode()
            for i in range(0, len(data), 1000):
                yield data[i : i + 1000]

        r = httpx.post(s.url + "/v1/completions", content=chunks(), headers={"content-type": "application/json"})
        assert "--max-request-bytes" in _err(r, 413)
        assert _err(httpx.post(s.url + "/v1/completions", json=big), 413)
        small = httpx.post(s.url + "/v1/completions", json={"model": MODEL, "prompt": "a b", "max_tokens": 2})
        assert small.status_code == 200


# --- 3. nothing heavy on the event loop; caps before any work -----------------------------------------------------


class _GatedTokenizer:
    """Wraps a tokenizer: every call to it waits for `gate` (so a tokenize on the event loop would stall /health
    forever), and counts the calls."""

    def __init__(self, tok):
        self.tok, self.gate, self.calls = tok, threading.Event(), 0

    def _gated(self, fn, *a, **kw):
        self.calls += 1
        assert self.gate.wait(HANG_GUARD_S), "never released"
        return fn(*a, **kw)

    def __call__(self, *a, **kw):
        return self._gated(self.tok, *a, **kw)

    def __len__(self):  # the vocabulary's size, read when the engine is built (not a call)
        return len(self.tok)

    def encode(self, *a, **kw):
        return self._gated(self.tok.encode, *a, **kw)

    def apply_chat_template(self, *a, **kw):
        return self._gated(self.tok.apply_chat_template, *a, **kw)

    def __getattr__(self, name):
        return getattr(self.tok, name)


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"model": MODEL, "prompt": "a b c", "max_tokens": 2}),
        ("/v1/completions", {"model": MODEL, "prompt": [1, 2], "max_tokens": 2, "bad_words": ["a"], "n": 4}),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "a"}], "max_tokens": 2}),
        ("/tokenize", {"prompt": "a b"}),
        ("/generate/", {"prompts": ["a b"], "max_tokens": 2}),
    ],
)
def test_health_answers_while_a_request_is_being_tokenized(tiny_target, path, body):
    gated = _GatedTokenizer(tiny_target.tokenizer)
    gen = SpeculativeGenerator(replace(tiny_target, tokenizer=gated), config=SpecConfig(draft="none"))
    with LiveServer(gen) as s:
        result = {}
        t = threading.Thread(target=lambda: result.setdefault("r", httpx.post(s.url + path, json=body, timeout=None)))
        t.start()
        wait_until(lambda: gated.calls, "the request to reach the tokenizer")  # which waits for the gate
        assert httpx.get(s.url + "/health", timeout=HANG_GUARD_S).status_code == 200  # the loop is free
        gated.gate.set()
        t.join(HANG_GUARD_S)
        assert result["r"].status_code == 200, result["r"].text
        if "bad_words" in body:
            assert gated.calls <= 3  # the prompt's none, each word alone and with a space: once, not once per choice


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": "a", "stop": ["x"] * (MAX_STOP + 1)}, "stop"),
        ("/v1/completions", {"prompt": "a", "stop": ["x" * 1025]}, "stop[0]"),
        ("/v1/completions", {"prompt": "a", "bad_words": ["b"] * 129}, "bad_words"),
        ("/v1/completions", {"prompt": ["a"] * (MAX_PROMPTS + 1)}, "prompt"),
        ("/generate/", {"prompts": ["a"] * (MAX_PROMPTS + 1)}, "prompts"),
        ("/generate/", {"prompts": ["a"], "generation_kwargs": {"stop": ["x"] * (MAX_STOP + 1)}}, None),
    ],
)
def test_caps_are_checked_before_any_tokenizing(tiny_target, path, body, param):
    gated = _GatedTokenizer(tiny_target.tokenizer)
    gated.gate.set()
    gen = SpeculativeGenerator(replace(tiny_target, tokenizer=gated), config=SpecConfig(draft="none"))
    with LiveServer(gen) as s:
        body = {"model": MODEL, **body} if path.startswith("/v1") else body
        _err(httpx.post(s.url + path, json=body), 400, param)
    assert gated.calls == 0


# --- 4. lone surrogates; internal errors -------------------------------------------------------------------------

SURROGATE = '"a\\ud800b"'  # JSON's escape of a lone surrogate: valid JSON, no valid Unicode


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", '{"model": "tiny", "prompt": %s}', "prompt"),
        ("/v1/completions", '{"model": "tiny", "prompt": ["a", %s]}', "prompt[1]"),
        ("/v1/completions", '{"model": "tiny", "prompt": "a", "bad_words": [%s]}', "bad_words[0]"),
        ("/v1/completions", '{"model": "tiny", "prompt": "a", "stop": %s}', "stop"),
        ("/v1/completions", '{"model": %s, "prompt": "a"}', "model"),
        ("/v1/chat/completions", '{"model": "tiny", "messages": [{"role": "user", "content": %s}]}', None),
        ("/tokenize", '{"prompt": %s}', "prompt"),
        ("/generate/", '{"prompts": [%s]}', "prompts[0]"),
    ],
)
def test_a_lone_surrogate_is_a_400_naming_the_field(server, path, body, param):
    r = httpx.post(server.url + path, content=body % SURROGATE, headers={"content-type": "application/json"})
    assert "surrogate" in _err(r, 400, param)


# --- 5. /generate/ follows /v1's rules -----------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [-1, 2**63, 2**64, True])
def test_generate_and_v1_refuse_the_same_seeds_alike(server, seed):
    v1 = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "a", "seed": seed})
    gen = httpx.post(server.url + "/generate/", json={"prompts": ["a"], "generation_kwargs": {"seed": seed}})
    m1, m2 = _err(v1, 400, "seed"), _err(gen, 400, "generation_kwargs.seed")
    if seed is not True:  # a JSON true: a type error for StrictInt in /generate/, a range error in /v1
        assert m1.split(" ", 1)[1] == m2.split(" ", 1)[1]  # "must be None or an integer in [0, 2**63), got ..."


def test_the_rollout_client_aborts_with_a_json_body(server, monkeypatch):
    """RolloutClient.abort sends what the JSON-only mutating routes take (`{}` as application/json, not a form):
    the server acts on it (its rollout engine is told to abort) and answers success."""
    rollout, aborted, replies = server.app.state.rollout, [], []
    real_abort = rollout.abort
    monkeypatch.setattr(rollout, "abort", lambda: aborted.append(True) or real_abort())
    with RolloutClient(server.url) as c:
        c._http.event_hooks["response"].append(lambda r: replies.append((r.request, r.read() and r.json())))
        c.abort()
    [(request, reply)] = replies
    assert (request.method, request.url.path) == ("POST", "/abort_request")
    assert request.headers["content-type"] == "application/json" and json.loads(request.content) == {}
    assert reply == {"success": True} and aborted == [True]


# --- 8. a seeded request repeats on a default server, whatever the load and gamma ---------------------------------


def _seeded_texts(s: LiveServer, body: dict, load: dict) -> set[str]:
    """One seeded request five times — gamma auto, 1, 3, 6, auto — each beside concurrent unseeded load."""
    texts = set()
    for gamma in (None, 1, 3, 6, None):
        noise = [threading.Thread(target=lambda: httpx.post(s.url + "/v1/completions", json=load, timeout=None))
                 for _ in range(3)]  # fmt: skip
        for t in noise:
            t.start()
        extra = {} if gamma is None else {"num_speculative_tokens": gamma}
        r = httpx.post(s.url + "/v1/completions", json=body | extra, timeout=None)
        assert r.status_code == 200, r.text
        texts.add(r.json()["choices"][0]["text"])
        for t in noise:
            t.join(HANG_GUARD_S)
    return texts


SEEDED = {"model": MODEL, "prompt": "a b c a b c a b c a b", "max_tokens": 40, "temperature": 1.0, "ignore_eos": True}
LOAD = {"model": MODEL, "prompt": "x0 d e", "max_tokens": 30, "temperature": 1.0, "n": 2, "ignore_eos": True}


# prompt lookup in the slow tier (a server of its own, seconds on 2 cores): random=auto's coupling of prompt lookup's
# drafts is checked in the default tier by tests/engine/test_auto_randomness.py, alone and under load
@pytest.mark.parametrize("draft", [pytest.param("ngram", marks=pytest.mark.slow), "model"])
def test_a_seeded_request_repeats_on_a_default_server_under_load_and_any_gamma(tiny_target, tiny_noisy, draft):
    model = tiny_noisy if draft == "model" else None
    gen = SpeculativeGenerator(tiny_target, model, config=SpecConfig(draft=draft))  # default config otherwise
    with LiveServer(gen, max_batch=8) as s:
        for seed in (1, 2):
            assert len(_seeded_texts(s, SEEDED | {"seed": seed}, LOAD)) == 1, seed


def test_the_stream_rule_does_not_repeat_so_the_test_above_bites(tiny_target, tiny_noisy):
    """Negative control: random=stream (the old default) gives a seeded request different texts under gamma 1/3/6
    (for one of seeds 1, 2, 3: the first that does ends the test)."""
    gen = SpeculativeGenerator(tiny_target, tiny_noisy, config=SpecConfig(draft="model", random="stream"))
    with LiveServer(gen, max_batch=8) as s:
        assert any(len(_seeded_texts(s, SEEDED | {"seed": seed}, LOAD)) > 1 for seed in (1, 2, 3))
