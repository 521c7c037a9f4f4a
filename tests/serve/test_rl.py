"""The server's RL routes (TRL's /generate/, weight updates over HTTP, abort) on a live server over tiny models,
driven by verispec's RolloutClient; logprobs checked against fresh fp32 forwards of the weights served."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest
import torch
from safetensors.torch import save_file

from verispec.engine.config import SpecConfig
from verispec.engine.generator import SpeculativeGenerator
from verispec.engine.request import Job, Request
from verispec.model.loading import LoadedModel
from verispec.rollout import RolloutEngine
from verispec.rollout.client import RolloutClient, RolloutServerError
from verispec.sampling import SamplingParams
from verispec.serve.engine import Call, EngineThread

from ..helpers.server import HANG_GUARD_S, MODEL, LiveServer, metric, wait_for_metric, wait_until
from ..helpers.tiny import EOS, LONG_CONTEXT, loaded, noisy_copy

PROMPTS = [[3, 7, 7, 12, 3, 7], [5, 9, 11, 4]]


def _new_weights(seed: int = 5) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in loaded(seed).model.state_dict().items()}


def _generator(target: LoadedModel) -> SpeculativeGenerator:
    draft = LoadedModel(noisy_copy(target.model, 0.3), target.tokenizer, "noisy")  # separate: keeps its weights
    return SpeculativeGenerator(target, draft, config=SpecConfig(draft="model", gamma=3))


@pytest.fixture
def served(tmp_path):
    """A server over a target of its own (these tests replace its weights: from disk under tmp_path), and a client
    for it."""
    target = loaded(0)
    updates = {"enable_weight_updates": True, "weight_dirs": [tmp_path]}
    with LiveServer(_generator(target), max_batch=8, max_queue=16, **updates) as s, RolloutClient(s.url) as c:
        yield s, c, target


@torch.no_grad()
def _logprobs(model, prompt: list[int], completion: list[int], temperature: float) -> list[float]:
    """log softmax(logits / T) of each completion token: a trainer's recomputation (one fresh full forward)."""
    logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1].double()
    lp = torch.log_softmax(logits / temperature, -1)
    return lp[torch.arange(len(completion)), torch.tensor(completion)].tolist()


def _check_logprobs(out: dict, prompts, model, n: int, temperature: float) -> None:
    for k, (ids, lps) in enumerate(zip(out["completion_ids"], out["logprobs"])):
        assert len(ids) == len(lps) > 0
        ref = _logprobs(model, list(prompts[k // n]), ids, temperature)
        assert max(abs(a - b) for a, b in zip(lps, ref)) < 1e-5


def test_generate_shapes_seeds_and_logprobs(served):
    _s, client, target = served
    out = client.generate(PROMPTS, n=3, temperature=0.7, max_tokens=16, seed=11)
    assert out["prompt_ids"] == PROMPTS  # one per prompt; completions prompt-major, n per prompt
    assert len(out["completion_ids"]) == len(out["logprobs"]) == len(out["finish_reasons"]) == 6
    _check_logprobs(out, PROMPTS, target.model, 3, 0.7)
    assert out["weight_version"] == 0 and out["speculation"]["accepted_tokens"] > 0
    # the same samples as a rollout engine over the same generator and seed (EOS appended where it ended one)
    ref = RolloutEngine.from_generator(_generator(loaded(0))).generate(
        PROMPTS, 3, SamplingParams(temperature=0.7), max_new_tokens=16, seed=11
    )
    assert out["completion_ids"] == [r.with_eos()[0] for r in ref]
    assert out == client.generate(PROMPTS, n=3, temperature=0.7, max_tokens=16, seed=11) | {
        "speculation": out["speculation"]
    }
    text = client.generate(["a b c"], n=2, max_tokens=4, seed=0)
    assert text["prompt_ids"] == [target.tokenizer("a b c")["input_ids"]]


def test_a_sample_ended_by_eos_carries_eos_and_its_logprob(served):
    s, client, target = served
    out = client.generate(PROMPTS, n=8, temperature=1.0, max_tokens=24, seed=3)
    stopped = [k for k, r in enumerate(out["finish_reasons"]) if r == "stop"]
    assert stopped, "no sample hit EOS at this seed: pick another"
    for k in stopped:
        assert out["completion_ids"][k][-1] == EOS
    for k, ids in enumerate(out["completion_ids"]):
        assert (EOS in ids) == (k in stopped)
    _check_logprobs(out, PROMPTS, target.model, 8, 1.0)  # the EOS position's logprob too
    # the rollouts count in the server's metrics like OpenAI requests (EOS not counted as a generated token)
    metrics = httpx.get(s.url + "/metrics").text
    generated = sum(len(ids) for ids in out["completion_ids"]) - len(stopped)
    assert f'verispec:generation_tokens_total{{model_name="{MODEL}"}} {generated:.1f}' in metrics
    assert (
        f'verispec:request_success_total{{finished_reason="stop",model_name="{MODEL}"}} {len(stopped):.1f}' in metrics
    )
    accepted = out["speculation"]["accepted_tokens"]
    assert f'verispec:spec_decode_num_accepted_tokens_total{{model_name="{MODEL}"}} {accepted:.1f}' in metrics


def test_weight_updates_over_http(served, tmp_path):
    s, client, _target = served
    before = client.generate(PROMPTS, n=2, temperature=1.0, max_tokens=12, seed=5)
    new = _new_weights(5)
    up = client.update_weights(new.items())
    assert up["weight_version"] == 1 and up["tensors"] == len(new)
    after = client.generate(PROMPTS, n=2, temperature=1.0, max_tokens=12, seed=5)
    assert after["weight_version"] == 1 and after["completion_ids"] != before["completion_ids"]
    _check_logprobs(after, PROMPTS, loaded(5).model, 2, 1.0)
    # from a safetensors file on the server's disk
    save_file(_new_weights(6), str(tmp_path / "model.safetensors"))
    assert client.update_weights_from_disk(tmp_path)["weight_version"] == 2 == client.weight_version()
    metrics = httpx.get(s.url + "/metrics").text
    assert f'verispec:weight_version{{model_name="{MODEL}"}} 2.0' in metrics
    assert f'verispec:weight_updates_total{{model_name="{MODEL}"}} 2.0' in metrics
    _check_logprobs(client.generate(PROMPTS, n=2, max_tokens=8, seed=1), PROMPTS, loaded(6).model, 2, 1.0)


def test_a_bad_update_is_a_400_that_changes_nothing(served, tmp_path):
    s, client, _target = served
    ref = client.generate(PROMPTS, n=2, max_tokens=8, seed=2)
    bad = _new_weights(5)
    bad["model.norm.weight"] = torch.full_like(bad["model.norm.weight"], float("nan"))
    with pytest.raises(RolloutServerError, match="NaN") as e:
        client.update_weights(bad.items())
    assert e.value.status == 400
    with pytest.raises(RolloutServerError, match="shape"):
        client.update_weights([("model.norm.weight", torch.zeros(3))])
    with pytest.raises(RolloutServerError, match="no readable safetensors file or directory under"):
        client.update_weights_from_disk(tmp_path / "nowhere")
    octets = {"content-type": "application/octet-stream"}
    r = httpx.post(s.url + "/update_weights_from_tensor", content=b"not safetensors", headers=octets)
    assert r.status_code == 400 and "safetensors" in r.json()["error"]["message"]
    r = httpx.post(s.url + "/update_weights_from_tensor", json={"model.norm.weight": [1.0]})
    assert r.status_code == 415 and "application/octet-stream" in r.json()["error"]["message"]
    r = httpx.post(s.url + "/update_weights_from_tensor", content=bytes(70 << 20), headers=octets)  # > the model
    assert r.status_code == 413
    assert client.weight_version() == 0
    assert client.generate(PROMPTS, n=2, max_tokens=8, seed=2) == ref


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"prompts": [[1, 2]], "top_k": 5}, 400, None),  # a law the trainer cannot recompute
        ({"prompts": [[1, 2]], "temperature": 0.0}, 400, None),
        ({"prompts": [[1, 2]], "generation_kwargs": {"best_of": 2}}, 400, "generation_kwargs.best_of"),
        ({"prompts": [[1, 2]], "n": 9}, 400, "n"),  # over the server's batch
        ({"prompts": [[1, 99]]}, 400, "prompts[0]"),  # outside the vocabulary
        ({"prompts": []}, 400, "prompts"),
        ({"prompts": [[1, 2]], "logprobs": 2}, 400, "logprobs"),
        ({"prompts": [[1, 2]], "guided_decoding_regex": "a+"}, 400, "guided_decoding_regex"),
        ({"prompts": [[1, 2]], "max_tokens": 10_000}, 400, "prompts[0]"),  # past the context
    ],
)
def test_generate_refuses_what_it_cannot_honour(served, body, status, param):
    s, _, _ = served
    r = httpx.post(s.url + "/generate/", json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and (param is None or err["param"] == param)
    if body.get("top_k") or body.get("temperature") == 0.0:
        assert "importance ratios" in err["message"]


def test_trl_housekeeping_routes(served):
    s, _, _ = served
    assert httpx.get(s.url + "/health/").json() == {"status": "ok"}
    assert httpx.get(s.url + "/get_world_size/").json() == {"world_size": 1}
    assert httpx.post(s.url + "/reset_prefix_cache/").json() == {"success": True}
    assert httpx.post(s.url + "/close_communicator/").status_code == 200
    for route in ("/init_communicator/", "/update_named_param/", "/init_weight_transfer_engine", "/update_weights"):
        r = httpx.post(s.url + route, json={})
        assert r.status_code == 501 and "update_weights_from_tensor" in r.json()["error"]["message"]


def _slow_steps(engine: EngineThread, seconds: float = 0.005) -> None:
    """Every engine step (the OpenAI routes') takes at least `seconds` more."""
    step = engine.session.run

    def slow():
        time.sleep(seconds)
        return step()

    engine.session.run = slow


def test_an_update_waits_for_running_requests_and_they_keep_their_weights(served):
    """A completion in flight when an update arrives finishes under the weights it started with."""
    s, client, _target = served
    old = loaded(0).model
    result = {}

    def long_request():
        result["out"] = s.client().completions.create(
            model=MODEL, prompt=[3, 7, 7], max_tokens=150, temperature=1.0, seed=4, logprobs=0,
            extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
        )  # fmt: skip

    _slow_steps(s.engine)  # 150 steps take >= 0.75 s: the update surely arrives while the request runs
    t = threading.Thread(target=long_request)
    t.start()
    deadline = time.time() + 30
    while s.engine.num_running == 0 and time.time() < deadline:
        time.sleep(0.005)
    assert s.engine.num_running == 1, "the request did not start"
    client.update_weights(_new_weights(5).items())
    t.join(timeout=60)
    assert not t.is_alive()
    lp = result["out"].choices[0].logprobs
    ids = [int(tok.split(":")[1]) for tok in lp.tokens]
    assert len(ids) == 150
    ref = _logprobs(old, [3, 7, 7], ids, 1.0)  # the server's logprobs are raw: temperature 1
    assert max(abs(a - b) for a, b in zip(lp.token_logprobs, ref)) < 1e-5
    assert client.weight_version() == 1


ENDLESS = LONG_CONTEXT - 16  # max_tokens of a rollout that ends only by an abort: many thousand steps, tens of seconds


@pytest.fixture
def served_long():
    """As `served`, over a target with a 32k context: a rollout of ENDLESS tokens (ignore_eos) lasts far longer
    than a client's timeout or the server's watch of its clients (0.5 s), on any machine, loaded or not."""
    target = loaded(0, max_positions=LONG_CONTEXT)
    with LiveServer(_generator(target), max_batch=8, max_queue=16) as s, RolloutClient(s.url) as c:
        yield s, c, target


def test_abort_ends_a_running_generate(served_long):
    _s, client, _ = served_long
    result = {}
    t = threading.Thread(
        target=lambda: result.setdefault(
            "out", client.generate(PROMPTS, n=2, max_tokens=ENDLESS, seed=0, ignore_eos=True)
        )
    )
    t.start()
    while t.is_alive():  # an abort before the rollout starts is a no-op: repeat until one lands (it cannot end first)
        client.abort()
        t.join(timeout=0.05)
    out = result["out"]
    assert set(out["finish_reasons"]) == {"abort"}
    assert all(len(ids) < ENDLESS for ids in out["completion_ids"])
    assert all(len(ids) == len(lp) for ids, lp in zip(out["completion_ids"], out["logprobs"]))
    assert client.generate(PROMPTS, n=1, max_tokens=4, seed=0)["finish_reasons"] == ["length", "length"]


def test_abort_reaches_a_generate_still_waiting_for_the_model(served):
    """A /generate/ queued behind a request that fills the batch: /abort_request ends its samples before they start
    (no tokens, finish_reason "abort")."""
    s, client, _ = served
    gate, expire, run = threading.Event(), s.engine.expire, s.engine.session.run

    def expired(job):
        expire(job)
        gate.set()

    s.engine.expire = expired  # /abort_request ends the rollout through it
    s.engine.session.run = lambda: gate.wait(HANG_GUARD_S) and run()  # the busy request holds the batch until then
    busy = threading.Thread(
        target=lambda: s.client().completions.create(
            model=MODEL, prompt=[3, 7], max_tokens=20, seed=0, n=8, extra_body={"ignore_eos": True}
        )
    )
    busy.start()
    wait_until(lambda: s.engine.num_running == 8, "the busy request to fill the batch")
    result = {}
    t = threading.Thread(target=lambda: result.setdefault("out", client.generate(PROMPTS, n=2, max_tokens=8, seed=0)))
    t.start()
    wait_until(lambda: s.app.state.rl_jobs and s.engine.num_waiting == 4, "the rollout to wait for rows")
    client.abort()
    t.join(timeout=HANG_GUARD_S)
    busy.join(timeout=HANG_GUARD_S)
    out = result["out"]
    assert out["finish_reasons"] == ["abort"] * 4 and out["completion_ids"] == [[]] * 4


def test_a_generate_whose_client_goes_away_is_aborted(served_long):
    s, client, _ = served_long
    gone = RolloutClient(s.url, generate_timeout=0.5)
    with pytest.raises(httpx.ReadTimeout):  # ENDLESS tokens are never done in 0.5 s: the client gives up, hangs up
        gone.generate(PROMPTS, n=4, max_tokens=ENDLESS, seed=0, ignore_eos=True)
    # the server notices and stops the rollout: wait until its 8 samples are counted, then see how they ended (run
    # to the end, ENDLESS tokens later, they would count as "length")
    metrics = wait_for_metric(s.url, "verispec:request_success_total", 8)
    assert metric(metrics, "verispec:request_success_total", finished_reason="abort") == 8
    assert metric(metrics, "verispec:request_success_total") == 8
    assert client.generate(PROMPTS, n=1, max_tokens=4, seed=0)["finish_reasons"] == ["length"] * 2


def test_an_update_waiting_for_a_job_fails_when_the_server_stops(tiny_target, tiny_draft):
    """An update queued behind a running job when the engine stops gets an error instead of waiting forever."""
    engine = EngineThread(
        SpeculativeGenerator(tiny_target, tiny_draft, config=SpecConfig(draft="model", gamma=3)), max_batch=2
    )
    gate = threading.Event()
    run = engine.session.run
    engine.session.run = lambda: gate.wait(HANG_GUARD_S) and run()
    engine.start()
    loop = asyncio.new_event_loop()
    engine.submit(Call(Job([Request((3, 7), max_new_tokens=200, ignore_eos=True)], key="long"), loop))
    wait_until(lambda: engine.num_running == 1, "the job to start")
    update = engine.between_jobs(lambda: "never")
    stopper = threading.Thread(target=engine.stop)
    stopper.start()
    wait_until(lambda: engine._stop, "the stop to be asked for")  # before the job's step may go on
    gate.set()
    stopper.join(HANG_GUARD_S)
    loop.close()
    with pytest.raises(RuntimeError, match="shutting down"):
        update.wait(HANG_GUARD_S)
