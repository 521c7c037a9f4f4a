"""verispec serve against the official openai client: a live server on 127.0.0.1 over tiny random models."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from verispec.engine.config import SpecConfig
from verispec.engine.generator import SpeculativeGenerator
from verispec.sampling import SamplingParams

from ..helpers.server import MODEL, LiveServer, free_port, wait_for_health, wait_until
from ..helpers.tiny import LONG_CONTEXT


@pytest.fixture(scope="module")
def server(tiny_target, tiny_draft):
    with LiveServer(
        SpeculativeGenerator(tiny_target, tiny_draft, config=SpecConfig(draft="model", gamma=3)),
        max_batch=8,
        max_queue=256,
    ) as s:
        yield s


def test_models_and_health(server):
    models = server.client().models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_completion_greedy_equals_the_engine_and_reports_speculation(server, tiny_target):
    out = server.client().completions.create(model=MODEL, prompt="a b c a b", max_tokens=12, temperature=0)
    ref = SpeculativeGenerator(tiny_target, config=SpecConfig(draft="none")).generate(
        "a b c a b", SamplingParams(temperature=0), max_new_tokens=12
    )[0]
    assert out.choices[0].text == ref.text and out.choices[0].finish_reason == ref.finish_reason
    assert out.usage.completion_tokens == len(ref.token_ids)
    spec = out.usage.model_extra["speculation"]
    assert spec["draft_tokens"] > 0 and spec["target_passes"] > 0 and spec["tokens_per_pass"] >= 1


def test_chat_completion(server):
    out = server.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "a b c"}], max_completion_tokens=8, seed=1
    )
    msg = out.choices[0].message
    assert msg.role == "assistant" and isinstance(msg.content, str)
    assert out.choices[0].finish_reason in ("stop", "length")
    assert out.usage.prompt_tokens > 0


def test_streaming_equals_non_streaming_and_includes_usage(server):
    c = server.client()
    kw = dict(model=MODEL, prompt="d e f d e", max_tokens=16, seed=7, temperature=1.0)
    full = c.completions.create(**kw).choices[0].text
    chunks = list(c.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == full
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] in ("stop", "length")
    ckw = dict(model=MODEL, messages=[{"role": "user", "content": "x y"}], max_tokens=10, seed=3)
    chat_full = c.chat.completions.create(**ckw).choices[0].message.content
    parts = [ch.choices[0].delta.content or "" for ch in c.chat.completions.create(**ckw, stream=True) if ch.choices]
    assert "".join(parts) == chat_full


def test_logprobs(server):
    c = server.client()
    out = c.completions.create(model=MODEL, prompt="a b", max_tokens=6, logprobs=3, seed=2)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == out.usage.completion_tokens
    assert all(v <= 0 for v in lp.token_logprobs) and all(len(d) == 3 for d in lp.top_logprobs)
    chat = c.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "a"}], max_tokens=5, logprobs=True, top_logprobs=2, seed=2
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.logprob <= entry.top_logprobs[0].logprob + 1e-6  # the best alternative is at least as likely


def _pieces(text: str, offsets: list[int]) -> list[str]:
    """text cut at the offsets: what each token contributes to the text."""
    assert offsets[0] == 0 and offsets == sorted(offsets) and offsets[-1] <= len(text)
    return [text[a:b] for a, b in zip(offsets, [*offsets[1:], len(text)])]


def test_text_offset_indexes_the_text_plain_and_streamed(server):
    """text_offset[i] is where token i starts in the returned text (the tiny tokenizer joins words with spaces,
    so decoding each token alone would give 0, 1, 2, ... instead)."""
    c = server.client()
    kw = dict(model=MODEL, prompt="a b c", max_tokens=10, logprobs=1, seed=5, extra_body={"ignore_eos": True})
    choice = c.completions.create(**kw).choices[0]
    text, lp = choice.text, choice.logprobs
    assert len(lp.text_offset) == len(lp.tokens) == 10
    pieces = _pieces(text, lp.text_offset)
    assert "".join(pieces) == text
    assert [p.strip() for p in pieces] == lp.tokens  # each token's text sits at its offset
    chunks = [ch.choices[0] for ch in c.completions.create(**kw, stream=True) if ch.choices]
    assert "".join(ch.text for ch in chunks) == text
    assert [o for ch in chunks if ch.logprobs for o in ch.logprobs.text_offset] == lp.text_offset
    stop = text.split()[4]  # a stop string: the text is cut, the offsets stay inside it
    cut = c.completions.create(**kw | {"stop": [stop]}).choices[0]
    assert cut.finish_reason == "stop" and "".join(_pieces(cut.text, cut.logprobs.text_offset)) == cut.text


def test_seeds_reproduce_alone_and_under_concurrency(server):
    c = server.client()

    def ask(seed):
        return (
            c.completions.create(
                model=MODEL, prompt="a b c d", max_tokens=20, seed=seed, extra_body={"ignore_eos": True}
            )
            .choices[0]
            .text
        )

    alone = [ask(s) for s in range(8)]
    assert len(set(alone)) > 1  # different seeds, different samples
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(ask, range(8)))
    assert together == alone


def test_stop_sequences_and_n(server):
    c = server.client()
    base = (
        c.completions.create(model=MODEL, prompt="a b c", max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
        .choices[0]
        .text
    )
    words = base.split()
    assert len(words) >= 4
    stop = words[3]
    cut = c.completions.create(
        model=MODEL, prompt="a b c", max_tokens=12, temperature=0, stop=[stop], extra_body={"ignore_eos": True}
    ).choices[0]
    assert cut.finish_reason == "stop" and cut.text == base[: base.find(stop)]
    two = c.completions.create(model=MODEL, prompt="a b c", max_tokens=5, n=2, seed=11)
    assert [ch.index for ch in two.choices] == [0, 1]


def test_speculation_can_be_switched_off_per_request(server):
    out = server.client().completions.create(
        model=MODEL, prompt="a b a b", max_tokens=10, temperature=0, extra_body={"num_speculative_tokens": 0}
    )
    assert out.usage.model_extra["speculation"]["draft_tokens"] == 0


@pytest.mark.parametrize(
    "kwargs,status,param",
    [
        ({"model": "gpt-9"}, 404, "model"),
        ({"temperature": -1.0}, 400, "temperature"),
        ({"top_p": 2.0}, 400, "top_p"),
        ({"extra_body": {"logit_bias": {"1": 500}}}, 400, "logit_bias"),
        ({"extra_body": {"logit_bias": {"one": 5}}}, 400, "logit_bias"),
        ({"extra_body": {"logit_bias": {"99": 5}}}, 400, "logit_bias"),
        ({"extra_body": {"allowed_token_ids": [3, 99]}}, 400, "allowed_token_ids"),
        ({"extra_body": {"allowed_token_ids": []}}, 400, "allowed_token_ids"),
        ({"extra_body": {"bad_words": [" "]}}, 400, "bad_words"),
        ({"extra_body": {"bad_words": "a"}}, 400, "bad_words"),
        ({"prompt": " ".join(["a"] * 300)}, 400, "prompt"),
        ({"max_tokens": 1000}, 400, "max_tokens"),
        ({"stop": [""]}, 400, "stop"),
        ({"extra_body": {"num_speculative_tokens": -1}}, 400, "num_speculative_tokens"),
        ({"extra_body": {"num_speculative_tokens": 10**6}}, 400, "num_speculative_tokens"),
        ({"extra_body": {"num_speculative_tokens": 2.5}}, 400, "num_speculative_tokens"),
        ({"extra_body": {"num_speculative_tokens": "3"}}, 400, "num_speculative_tokens"),
        ({"prompt": 5}, 400, "prompt"),
        ({"prompt": [1, "x"]}, 400, "prompt[1]"),
    ],
)
def test_errors_are_openai_style_and_name_the_field(server, kwargs, status, param):
    args = {"model": MODEL, "prompt": "a b", "max_tokens": 4} | kwargs
    with pytest.raises(openai.APIStatusError) as info:
        server.client().completions.create(**args)
    assert info.value.status_code == status
    assert info.value.body["param"] == param and info.value.body["message"]
    assert "SamplingParams" not in info.value.body["message"]  # the request's words, not the library's


@pytest.mark.parametrize(
    "messages,param",
    [
        ([{"role": "user", "content": 5}], "messages[0].content"),
        ([{"role": "user", "content": "a"}, {"content": "b"}], "messages[1].role"),
        ([{"role": "user", "content": [{"type": "text", "text": 1}]}], "messages[0].content[0].text"),
        ([], "messages"),
    ],
)
def test_chat_errors_name_the_field_as_sent(server, messages, param):
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": MODEL, "messages": messages})
    assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert r.json()["error"]["param"] == param and r.json()["error"]["message"].startswith(param)


@pytest.mark.parametrize("body", [b"", b"null", b"[]", b'"a"'])
def test_an_empty_or_non_object_body_gets_an_error_object(server, body):
    r = httpx.post(server.url + "/v1/completions", content=body, headers={"content-type": "application/json"})
    err = r.json()["error"]
    assert r.status_code == 400 and err["type"] == "invalid_request_error" and err["param"] is None
    assert "request body" in err["message"]


def test_unknown_routes_get_error_objects(server):
    r = httpx.get(server.url + "/v1/nowhere")
    assert r.status_code == 404
    assert r.json() == {
        "error": {
            "message": "Invalid URL (GET /v1/nowhere)",
            "type": "invalid_request_error",
            "param": None,
            "code": None,
        }
    }
    r = httpx.get(server.url + "/v1/completions")
    assert r.status_code == 405 and r.json()["error"]["message"] and "POST" in r.headers["allow"]


def test_bad_json_and_bad_messages(server):
    r = httpx.post(
        server.url + "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert r.status_code == 400 and "error" in r.json()
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": MODEL, "messages": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


def test_metrics(server):
    server.client().completions.create(model=MODEL, prompt="a b a b a b", max_tokens=8, temperature=0)
    text = httpx.get(server.url + "/metrics").text
    values = {}
    for line in text.splitlines():
        if line.startswith("verispec:") and " " in line:
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    assert values['verispec:spec_decode_num_draft_tokens_total{model_name="tiny"}'] > 0
    assert values['verispec:spec_decode_num_drafts_total{model_name="tiny"}'] > 0
    assert any(k.startswith("verispec:spec_decode_num_accepted_tokens_per_pos_total") for k in values)
    assert 'verispec:num_requests_waiting{model_name="tiny"}' in values
    assert values['verispec:e2e_request_latency_seconds_count{model_name="tiny"}'] >= 1


def test_load_32_clients_no_errors_no_lost_requests(server):
    c = server.client(timeout=120)

    def client(i):
        texts = []
        for j in range(8):
            out = c.completions.create(
                model=MODEL, prompt=f"a b {chr(97 + (i + j) % 26)}", max_tokens=6, seed=1000 * i + j
            )
            assert out.choices[0].finish_reason in ("stop", "length")
            texts.append(out.choices[0].text)
        return len(texts)

    with ThreadPoolExecutor(32) as pool:
        counts = list(pool.map(client, range(32)))
    assert sum(counts) == 256
    assert server.engine.num_running == 0 and server.engine.num_waiting == 0


def test_overload_returns_429_with_retry_after(tiny_target, tiny_draft):
    with LiveServer(
        SpeculativeGenerator(tiny_target, tiny_draft, config=SpecConfig(draft="model", gamma=3)),
        max_batch=1,
        max_queue=1,
    ) as s:

        def ask(_):
            return httpx.post(
                s.url + "/v1/completions",
                timeout=120,
                json={"model": MODEL, "prompt": "a b", "max_tokens": 60, "ignore_eos": True},
            )

        with ThreadPoolExecutor(12) as pool:
            replies = list(pool.map(ask, range(12)))
        codes = [r.status_code for r in replies]
        assert codes.count(200) >= 2 and codes.count(429) >= 1 and set(codes) <= {200, 429}
        busy = next(r for r in replies if r.status_code == 429)
        assert busy.headers["retry-after"] == "1" and busy.json()["error"]["type"] == "rate_limit_error"


def test_client_disconnect_mid_stream_stops_the_request(tiny_long_target):
    with LiveServer(
        SpeculativeGenerator(tiny_long_target, config=SpecConfig(draft="none")), max_batch=4, max_queue=8
    ) as s:
        endless = LONG_CONTEXT - 16  # thousands of steps: it ends only by the hang-up, on any machine
        body = {"model": MODEL, "prompt": "a b", "max_tokens": endless, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    json.loads(line[6:])
                    break  # one chunk, then hang up
        wait_until(lambda: not (s.engine.num_running or s.engine.session.num_active), "the request to stop")
        finished = [
            ln
            for ln in httpx.get(s.url + "/metrics").text.splitlines()
            if ln.startswith("verispec:request_success_total")
        ]
        # the request was dropped, not run to its 240 tokens, and /metrics says so
        assert finished == ['verispec:request_success_total{finished_reason="abort",model_name="tiny"} 1.0']
        ok = httpx.post(s.url + "/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 3})
        assert ok.status_code == 200  # and the server goes on


@pytest.mark.slow
def test_cli_serve_starts_and_answers(tmp_path):
    """`verispec serve` end to end: a tiny model saved to disk, a real process, curl-like calls. Slow tier (two
    processes, ~20 s on 2 cores): in the default tier tests/serve/test_load.py runs `verispec serve` as a process with
    the same flags and drives its completions, tests/cli/test_checks.py refuses --port 0 in the test process, and
    tests/cli/test_cli.py checks a usage error's exit status and one line from a process."""
    import subprocess
    import sys

    from ..helpers.tiny import make_model, make_tokenizer

    make_model(0).save_pretrained(tmp_path)
    make_tokenizer().save_pretrained(tmp_path)
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "verispec.cli",
            "serve",
            "--target",
            str(tmp_path),
            "--port",
            str(port),
            "--served-model-name",
            "m",
            "--draft",
            "ngram",
            "--gamma",
            "2",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for_health(url, proc, "verispec serve")
        r = httpx.post(url + "/v1/completions", json={"model": "m", "prompt": "a b a b", "max_tokens": 5})
        assert r.status_code == 200 and r.json()["object"] == "text_completion"
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    bad = subprocess.run([sys.executable, "-m", "verispec.cli", "serve", "--port", "0"], capture_output=True, text=True)
    assert bad.returncode == 2 and "--port" in bad.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize(
    "mode", [dict(random="gumbel"), dict(random="position", stop_below=None)], ids=["gumbel", "position"]
)
def test_seeded_requests_do_not_depend_on_gamma_auto_or_load(mode, tiny_target, tiny_noisy):
    """The server's default gamma auto with random=gumbel (reference: plain decoding under the coupling) or
    random=position (reference: the engine alone at gamma 1): seeded requests sent 16 at a time return the
    reference's text, whatever batch they shared."""
    gen = SpeculativeGenerator(tiny_target, tiny_noisy, config=SpecConfig(draft="model", gamma="auto", **mode))
    if mode["random"] == "gumbel":
        ref_gen = SpeculativeGenerator(tiny_target, config=SpecConfig(draft="none", gamma=1, random="gumbel"))
    else:  # (the default stop_below: ok)
        ref_gen = SpeculativeGenerator(
            tiny_target, tiny_noisy, config=SpecConfig(draft="model", gamma=1, random="position")
        )
    with LiveServer(gen, max_batch=8, max_queue=64) as s:
        c = s.client()

        def ask(seed):
            body = dict(ignore_eos=True)
            out = c.completions.create(model=MODEL, prompt=[3, 7, 7, 12], max_tokens=12, seed=seed, extra_body=body)
            return out.choices[0].text, out.usage.model_extra["speculation"]["draft_tokens"]

        with ThreadPoolExecutor(16) as pool:
            texts, drafted = zip(*pool.map(ask, range(32)))
    ref = [
        ref_gen.generate([[3, 7, 7, 12]], SamplingParams(seed=s), max_new_tokens=12, ignore_eos=True)[0].text
        for s in range(32)
    ]
    assert list(texts) == ref
    assert sum(drafted) > 0  # speculation was on
