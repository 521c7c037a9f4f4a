"""What operators of `verispec serve` need beyond the basics, on live servers over tiny models: lists of prompts,
stop_token_ids, echo (with prompt logprobs), --max-model-len (the RL routes too), --request-timeout, --chat-template,
clients that leave, failed streams, and the 503s a shutdown answers (the SIGTERM path itself runs in test_load)."""

from __future__ import annotations

import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch

from verispec.engine.config import SpecConfig
from verispec.engine.generator import SpeculativeGenerator
from verispec.model.loading import LoadedModel
from verispec.serve import create_app
from verispec.serve.chat import load_chat_template
from verispec.serve.jobs import Served

from ..helpers.server import HANG_GUARD_S, MODEL, LiveServer, wait_until
from ..helpers.tiny import make_tokenizer

CONTEXT = 128


@pytest.fixture(scope="module")
def server(tiny_target, tiny_draft):
    gen = SpeculativeGenerator(tiny_target, tiny_draft, config=SpecConfig(draft="model", gamma=3))
    with LiveServer(gen, max_batch=8, max_queue=64, max_model_len=CONTEXT) as s:
        yield s


def _post(s, body: dict, path: str = "/v1/completions") -> httpx.Response:
    return httpx.post(s.url + path, json={"model": MODEL} | body, timeout=60)


def _stream(s, body: dict, path: str = "/v1/completions", first: threading.Event | None = None) -> list:
    """The stream's chunks (dicts), then "[DONE]" if it came; `first` is set once the first chunk has come."""
    out = []
    with httpx.stream("POST", s.url + path, json={"model": MODEL, "stream": True} | body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                out.append("[DONE]" if line == "data: [DONE]" else json.loads(line[6:]))
                if first is not None:
                    first.set()
    return out


def _prompt_tokens_total(s) -> float:
    line = next(ln for ln in httpx.get(s.url + "/metrics").text.splitlines() if ln.startswith("verispec:prompt_t"))
    return float(line.rsplit(" ", 1)[1])


def _texts(chunks: list) -> dict[int, str]:
    texts: dict[int, str] = {}
    for ch in chunks[:-1]:
        for c in ch["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
    return texts


@pytest.mark.parametrize("prompts", [["a b", "c d e"], [[3, 4], [5, 6, 7]]], ids=["strings", "token-lists"])
def test_a_list_of_prompts_gives_prompt_major_choices_as_separate_requests_would(server, prompts):
    kw = {"n": 2, "seed": 5, "max_tokens": 6, "ignore_eos": True}
    both = _post(server, {"prompt": prompts} | kw).json()
    assert [c["index"] for c in both["choices"]] == [0, 1, 2, 3]
    alone = [_post(server, {"prompt": p} | kw).json() for p in prompts]
    assert [c["text"] for c in both["choices"]] == [c["text"] for a in alone for c in a["choices"]]
    once = [_post(server, {"prompt": p} | kw | {"n": 1}).json()["usage"]["prompt_tokens"] for p in prompts]
    assert [a["usage"]["prompt_tokens"] for a in alone] == once  # each prompt counted once, whatever n is
    assert both["usage"]["prompt_tokens"] == sum(once)
    before = _prompt_tokens_total(server)
    _post(server, {"prompt": prompts[0]} | kw | {"n": 3})
    assert _prompt_tokens_total(server) - before == once[0]  # the counter too
    assert both["usage"]["completion_tokens"] == 4 * 6
    streamed = _stream(server, {"prompt": prompts, "stream_options": {"include_usage": True}} | kw)
    assert streamed[-1] == "[DONE]" and streamed[-2]["usage"]["completion_tokens"] == 24
    assert _texts(streamed[:-1]) == {c["index"]: c["text"] for c in both["choices"]}


@pytest.mark.parametrize(
    "prompt,param",
    [([], "prompt"), (["a", [3]], "prompt[1]"), ([[3], 4], "prompt[1]"), ([[3], []], "prompt[1]"),
     ([[3], [99]], "prompt[1]"), (["a", ""], "prompt[1]"), ([[3], [True]], "prompt[1][0]"),
     ([[3], [1.5]], "prompt[1][0]"), (["a b " * 70], "prompt"), (["a", "a b " * 70], "prompt[1]")],
)  # fmt: skip
def test_bad_prompt_lists_are_400s_naming_the_prompt(server, prompt, param):
    r = _post(server, {"prompt": prompt, "max_tokens": 2})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["message"]


def test_stop_token_ids_end_a_choice_without_their_token(server, tiny_target):
    kw = {"prompt": "a b c", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    base = _post(server, kw | {"logprobs": 0, "return_tokens_as_token_ids": True}).json()["choices"][0]
    ids = [int(t.split(":")[1]) for t in base["logprobs"]["tokens"]]
    stop, k = ids[3], ids.index(ids[3])
    cut = _post(server, kw | {"stop_token_ids": [stop]}).json()
    assert cut["choices"][0]["finish_reason"] == "stop" and cut["usage"]["completion_tokens"] == k
    assert cut["choices"][0]["text"] == tiny_target.tokenizer.decode(ids[:k], skip_special_tokens=True)
    streamed = _stream(server, kw | {"stop_token_ids": [stop]})
    assert _texts(streamed) == {0: cut["choices"][0]["text"]}
    assert streamed[-2]["choices"][0]["finish_reason"] == "stop"
    chat = _post(
        server, {"messages": [{"role": "user", "content": "a"}], "stop_token_ids": [stop]}, "/v1/chat/completions"
    )
    assert chat.status_code == 200
    for bad in ([32], [-1], ["3"], 3):
        r = _post(server, kw | {"stop_token_ids": bad})
        assert r.status_code == 400 and r.json()["error"]["param"].startswith("stop_token_ids"), bad


def test_echo_prepends_the_prompt_and_its_logprobs(server, tiny_target):
    prompt = "a b c a"
    tok = tiny_target.tokenizer
    ids = tok(prompt)["input_ids"]
    kw = {"prompt": prompt, "max_tokens": 5, "seed": 3, "ignore_eos": True}
    plain = _post(server, kw).json()["choices"][0]
    as_ids = _post(server, kw | {"logprobs": 0, "return_tokens_as_token_ids": True}).json()["choices"][0]
    completion = [int(t.split(":")[1]) for t in as_ids["logprobs"]["tokens"]]
    echoed = _post(server, kw | {"echo": True}).json()["choices"][0]
    assert echoed["logprobs"] is None and plain["text"] and echoed["text"] != prompt + plain["text"]  # not glued
    assert echoed["text"] == tok.decode(ids + completion, skip_special_tokens=True)  # "a b c a" + " " + "b ..."
    assert echoed["text"] == prompt + " " + plain["text"]
    lp = _post(server, kw | {"echo": True, "logprobs": 2}).json()
    got = lp["choices"][0]["logprobs"]
    assert lp["choices"][0]["text"] == echoed["text"]
    n = len(ids)
    assert len(got["tokens"]) == n + lp["usage"]["completion_tokens"]
    assert got["token_logprobs"][0] is None and got["top_logprobs"][0] is None
    with torch.no_grad():
        ref = torch.log_softmax(tiny_target.model(input_ids=torch.tensor([ids])).logits[0].float(), -1)
    want = [ref[t - 1, ids[t]].item() for t in range(1, n)]
    assert got["token_logprobs"][1:n] == pytest.approx(want, abs=1e-4)
    assert all(len(d) == 2 for d in got["top_logprobs"][1:])
    offsets = got["text_offset"]
    assert offsets == sorted(offsets) and offsets[n] == len(prompt)  # the completion starts after the prompt
    text, ends = lp["choices"][0]["text"], [*offsets[n + 1 :], len(lp["choices"][0]["text"])]
    words = [text[a:b].strip() for a, b in zip(offsets[n:], ends)]  # each completion token's text at its offset
    assert words == [t if t not in tok.all_special_tokens else "" for t in got["tokens"][n:]]
    streamed = _stream(server, kw | {"echo": True, "logprobs": 2})
    assert _texts(streamed) == {0: lp["choices"][0]["text"]}
    tokens = [t for ch in streamed[:-1] for c in ch["choices"] if c["logprobs"] for t in c["logprobs"]["tokens"]]
    assert tokens == got["tokens"]


def test_max_model_len_limits_prompt_and_max_tokens(server, tiny_target):
    assert httpx.get(server.url + "/v1/models").json()["data"][0]["max_model_len"] == CONTEXT
    r = _post(server, {"prompt": "a b", "max_tokens": CONTEXT})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "max_tokens"
    assert f"maximum context length is {CONTEXT}" in err["message"] and str(CONTEXT + 2) in err["message"]
    ok = _post(server, {"prompt": "a b", "max_tokens": CONTEXT - 2, "ignore_eos": True, "temperature": 0})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == CONTEXT - 2
    with pytest.raises(ValueError, match="exceeds the model's context"):
        create_app(SpeculativeGenerator(tiny_target, config=SpecConfig(draft="none")), MODEL, max_model_len=10_000)


def _slowed(s, seconds: float = 0.005) -> None:
    """Each engine step takes at least `seconds` (a long request stays long on a fast machine)."""
    step = s.engine.session.run

    def slow():
        time.sleep(seconds)
        return step()

    s.engine.session.run = slow


def test_request_timeout_ends_running_and_waiting_requests_with_abort(tiny_long_target):
    gen = SpeculativeGenerator(tiny_long_target, config=SpecConfig(draft="none"))
    with LiveServer(gen, max_batch=1, max_queue=8, request_timeout=1.0) as s:
        _slowed(s)  # 1000 tokens take over 5 s: both requests end by the timeout, never by their length
        body = {"prompt": "a b", "max_tokens": 1000, "ignore_eos": True}
        first = threading.Event()
        with ThreadPoolExecutor(2) as pool:
            streamed = pool.submit(_stream, s, body | {"stream_options": {"include_usage": True}}, first=first)
            assert first.wait(HANG_GUARD_S)  # the stream has the one row; the plain request waits behind it
            waited = pool.submit(_post, s, body)
            chunks, plain = streamed.result(), waited.result().json()
        assert chunks[-1] == "[DONE]" and chunks[-3]["choices"][0]["finish_reason"] == "abort"
        got = chunks[-2]["usage"]["completion_tokens"]
        assert 0 < got < 1000 and 0 < len(_texts(chunks)[0].split()) <= got  # what it had (EOS has no text)
        assert plain["choices"][0]["finish_reason"] == "abort" and plain["usage"]["completion_tokens"] < 1000
        metrics = httpx.get(s.url + "/metrics").text
        assert 'verispec:request_success_total{finished_reason="abort",model_name="tiny"} 2.0' in metrics
        assert s.engine.num_running == 0 and s.engine.num_waiting == 0


def test_chat_template_overrides_the_tokenizers(tiny_target, tmp_path):
    template = "{% for m in messages %}{{ m['content'] }} x1 {% endfor %}{% if add_generation_prompt %}x2{% endif %}"
    (tmp_path / "t.jinja").write_text(template)
    assert load_chat_template(str(tmp_path / "t.jinja")) == template == load_chat_template(template)
    assert load_chat_template("{{ 'a' }}\\n{{ 'b' }}") == "{{ 'a' }}\n{{ 'b' }}"  # a shell's one-line \n
    for bad in ("no/such/file.jinja", "{% for %}"):
        with pytest.raises(ValueError, match="--chat-template"):
            load_chat_template(bad)
    tok = make_tokenizer()  # a tokenizer of its own: the app sets its template
    gen = SpeculativeGenerator(LoadedModel(tiny_target.model, tok, "tiny"), config=SpecConfig(draft="none"))
    with LiveServer(gen, chat_template=load_chat_template(str(tmp_path / "t.jinja"))) as s:
        msgs = [{"role": "user", "content": "a b"}]
        r = httpx.post(s.url + "/tokenize", json={"messages": msgs}).json()
        assert r["tokens"] == tok("a b x1 x2")["input_ids"]
        chat = _post(s, {"messages": msgs, "max_tokens": 3}, "/v1/chat/completions").json()
        assert chat["usage"]["prompt_tokens"] == r["count"]
    refusing = (
        "{% if messages[0]['role'] != 'system' %}{{ raise_exception('a system message comes first') }}{% endif %}"
    )
    gen = SpeculativeGenerator(
        LoadedModel(tiny_target.model, make_tokenizer(), "tiny"), config=SpecConfig(draft="none")
    )
    with LiveServer(gen, chat_template=refusing) as s:
        for path in ("/v1/chat/completions", "/tokenize"):
            r = _post(s, {"messages": [{"role": "user", "content": "a"}]}, path)
            assert r.status_code == 400 and "a system message comes first" in r.json()["error"]["message"], path


def test_a_draining_server_answers_503_but_metrics(server):
    gate = server.app.state.gate
    gate.draining = True
    try:
        r = _post(server, {"prompt": "a", "max_tokens": 2})
        assert r.status_code == 503 and r.headers["retry-after"] == "1" and r.json()["error"]["type"] == "server_error"
        assert httpx.get(server.url + "/health").status_code == 503
        assert httpx.get(server.url + "/metrics").status_code == 200
        with pytest.raises(openai.InternalServerError):
            server.client().completions.create(model=MODEL, prompt="a", max_tokens=2)
    finally:
        gate.draining = False
    assert gate.in_flight == 0 and _post(server, {"prompt": "a", "max_tokens": 2}).status_code == 200


@pytest.mark.parametrize(
    "argv,says",
    [(["--request-timeout", "0"], "--request-timeout"), (["--shutdown-timeout", "-1"], "--shutdown-timeout"),
     (["--max-model-len", "1"], "--max-model-len"), (["--request-timeout", "inf"], "--request-timeout")],
)  # fmt: skip
def test_cli_refuses_bad_operator_options(argv, says, capsys):
    from verispec.cli import main

    with pytest.raises(SystemExit) as e:
        main(["serve", *argv])
    assert e.value.code == 2 and says in capsys.readouterr().err


def test_cli_refuses_a_chat_template_that_is_neither_file_nor_template_before_loading(capsys):
    from verispec.cli import main

    assert main(["serve", "--chat-template", "no/such/template.jinja"]) == 2
    assert "--chat-template" in capsys.readouterr().err


def test_rl_generate_honours_max_model_len(server):
    r = httpx.post(server.url + "/generate/", json={"prompts": ["a b"], "max_tokens": CONTEXT}, timeout=60)
    assert r.status_code == 400 and f"exceeds the context ({CONTEXT})" in r.json()["error"]["message"]
    assert httpx.post(server.url + "/generate/", json={"prompts": ["a b"], "max_tokens": 3}, timeout=60).is_success


def test_a_plain_request_whose_client_leaves_stops_though_its_events_come_fast(tiny_long_target):
    """Events every ~10 ms never let a 0.5 s wait time out: the client is watched on its own."""
    with LiveServer(
        SpeculativeGenerator(tiny_long_target, config=SpecConfig(draft="none")), max_batch=2, max_queue=4
    ) as s:
        _slowed(s, 0.01)  # 3000 tokens take over 30 s: it ends by the hang-up, on any machine
        body = {"model": MODEL, "prompt": "a b", "max_tokens": 3000, "ignore_eos": True}
        with pytest.raises(httpx.ReadTimeout):  # the client gives up and hangs up
            httpx.post(s.url + "/v1/completions", json=body, timeout=0.3)
        wait_until(lambda: not (s.engine.num_running or s.engine.session.num_active), "the request to stop")
        ended = [ln for ln in httpx.get(s.url + "/metrics").text.splitlines() if ln.startswith("verispec:request_s")]
        assert ended == ['verispec:request_success_total{finished_reason="abort",model_name="tiny"} 1.0']


def test_a_failed_stream_ends_with_its_error_then_done_and_the_server_serves_on(tiny_target, caplog):
    with LiveServer(SpeculativeGenerator(tiny_target, config=SpecConfig(draft="none"))) as s:

        def broken():
            raise RuntimeError("injected device error")

        s.engine.session.run = broken  # this session's only: a failed step replaces it
        chunks = _stream(s, {"prompt": "a b", "max_tokens": 5})
        assert chunks[-1] == "[DONE]"  # the error as a chunk, then [DONE], as vLLM ends it
        message = chunks[-2]["error"]["message"]
        rid = re.fullmatch(r"internal error \(request id (\w+)\): see the server's log", message).group(1)
        assert "injected" not in message  # the reply names no internals; the log has them under the request id
        logged = [r for r in caplog.records if rid in r.getMessage()]
        assert logged and "injected device error" in str(logged[0].exc_info[1])
        assert _post(s, {"prompt": "a", "max_tokens": 2}).status_code == 200


def test_served_without_a_scorer_shares_or_makes_one(tiny_target):
    gen = SpeculativeGenerator(tiny_target, config=SpecConfig(draft="none"))
    with LiveServer(gen) as s:
        s.engine.scorer = None
        s.app.state.served = served = Served(gen, s.engine, s.app.state.metrics, MODEL)
        assert served.scorer is not None and s.engine.scorer is served.scorer
        r = _post(s, {"prompt": "a b c", "max_tokens": 2, "echo": True, "logprobs": 1})  # was a 500
        assert r.status_code == 200 and r.json()["choices"][0]["logprobs"]["token_logprobs"][-3] is not None


def test_a_request_reaching_the_engine_after_the_shutdown_cut_gets_503(tiny_target):
    with LiveServer(SpeculativeGenerator(tiny_target, config=SpecConfig(draft="none"))) as s:
        s.engine.expire_all()  # what the drain does at --shutdown-timeout; the gate let this one through before
        r = _post(s, {"prompt": "a", "max_tokens": 2})
        assert r.status_code == 503 and r.headers["retry-after"] == "1" and r.json()["error"]["type"] == "server_error"


def test_chat_templates_compile_as_transformers_compiles_them():
    template = (
        "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
        "{% generation %}{{ m['content'] }} {% endgeneration %}{% endfor %}"
    )
    assert load_chat_template(template) == template  # was refused: no {% break %} nor {% generation %}
    tok = make_tokenizer()
    tok.chat_template = template
    msgs = [{"role": "user", "content": w} for w in "abc"]
    assert tok.apply_chat_template(msgs, tokenize=False) == "a b "
