"""The commands with a hidden-state head as --draft (a head directory, detected by its config.json): generate,
serve's app, bench e2e (a verispec:draft=model,model=HEAD method beside verispec-plain) and certify generate.
A tiny 4-layer target and a random EAGLE-3 head for it (aux layers 0, 2, 4), saved to disk."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from verispec.engine import SpeculativeGenerator
from verispec.engine.config import SpecConfig
from verispec.engine.drafters import load_draft
from verispec.model.loading import load_model
from verispec.sampling import SamplingParams

from ..helpers.cli import run_verispec
from ..helpers.heads import save_eagle3
from ..helpers.server import free_port
from ..helpers.tiny import V, make_model, make_tokenizer

PROMPT = "a b c"
GREEDY = ["--temperature", "0"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, Path]:
    """(target dir, head dir)."""
    folder = tmp_path_factory.mktemp("entry")
    make_model(0, layers=4).save_pretrained(folder / "target")
    make_tokenizer().save_pretrained(folder / "target")
    return folder / "target", save_eagle3(folder / "head", V)


@pytest.fixture(scope="module")
def plain_tokens(saved) -> list[int]:
    """Plain greedy decoding of PROMPT, 12 tokens (EOS ignored)."""
    gen = SpeculativeGenerator(load_model(str(saved[0])), config=SpecConfig(draft="none"))
    return gen.generate(PROMPT, SamplingParams(temperature=0), max_new_tokens=12, ignore_eos=True)[0].token_ids


def test_generate_drafts_with_a_head_directory(saved, plain_tokens, capsys):
    target, head = saved
    argv = ["generate", PROMPT, "--target", target, "--draft", head, *GREEDY, "--max-new-tokens", "12", "--json"]
    for runner in ("fast", "hf"):
        r = run_verispec([*argv, "--spec", f"runner={runner}"], capsys)
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        n = len(out["token_ids"])
        assert out["token_ids"] == plain_tokens[:n] and (n == 12 or out["finish_reason"] == "stop")
        assert out["stats"]["drafted"] > 0
    assert f"loading {head} (torch)" in r.stderr


def test_a_head_on_llamacpp_is_a_clear_error_before_anything_loads(saved, tmp_path, capsys, monkeypatch):
    import verispec.model.loading as loading

    monkeypatch.setattr(loading, "load_model", lambda *a, **k: pytest.fail("loaded a model"))
    target, head = saved
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": PROMPT}) + "\n")
    for argv in (
        ["generate", PROMPT, "--target", target, "--draft", head, "--spec", "runner=llamacpp"],
        ["generate", PROMPT, "--target", target, "--spec", f"draft=model,model={head},runner=llamacpp"],
        ["serve", "--target", target, "--draft", head, "--spec", "runner=llamacpp"],
        ["bench", "e2e", "--target", target, "--prompts", prompts, "--runner", "llamacpp",
         "--methods", f"verispec-plain,verispec:draft=model,model={head}"],
    ):  # fmt: skip
        r = run_verispec(argv, capsys)
        assert r.returncode == 2 and "Traceback" not in r.stderr
        assert f"--draft {head} is a hidden-state head (eagle3)" in r.stderr
        assert "llama.cpp does not expose" in r.stderr and "the fast or hf runner" in r.stderr


def test_runner_auto_loads_a_gguf_target_with_torch_beside_a_head(saved, monkeypatch):
    """runner auto would run a .gguf target on llama.cpp; with a head as --draft, the target loads with torch."""
    import verispec.model.llamacpp as llamacpp
    from verispec.cli.generate import check_heads
    from verispec.cli.options import backend_for

    monkeypatch.setattr(llamacpp, "llamacpp_available", lambda: True)
    args = argparse.Namespace(runner="auto", dtype="float32", device="cpu", draft=None)
    assert backend_for("model.gguf", args) == "llamacpp"
    check_heads(args, ["ngram-free-model-dir", None], "auto")  # not heads: nothing changes
    assert backend_for("model.gguf", args) == "llamacpp"
    check_heads(args, [str(saved[1])], "auto")
    assert backend_for("model.gguf", args) == "torch"


def test_a_head_refuses_a_draft_quantization(saved, capsys):
    target, head = saved
    r = run_verispec(["generate", PROMPT, "--target", target, "--draft", head, "--spec", "quant=int8"], capsys)
    assert r.returncode == 2 and "quantizes a draft model's weights" in r.stderr


def test_serve_with_a_head_drafts_and_answers_plain_greedy_text(saved, plain_tokens, capsys, monkeypatch):
    """`verispec serve --draft HEAD`: the app the command builds (uvicorn replaced by a capture) answers a greedy
    completion with plain decoding's text, and its usage shows the head drafted."""
    import logging

    from fastapi.testclient import TestClient

    import verispec.serve.shutdown as shutdown

    apps = []
    monkeypatch.setattr(shutdown, "serve", lambda app, **kw: apps.append(app))
    monkeypatch.setattr(logging, "basicConfig", lambda **kw: None)
    target, head = saved
    port = str(free_port())  # a port free now (the default, 8000, may be another program's)
    r = run_verispec(
        ["serve", "--target", target, "--draft", head, "--served-model-name", "tiny", "--port", port], capsys
    )
    assert r.returncode == 0, r.stderr
    assert f"model={head}" in r.stderr  # the spec the server prints
    tok = make_tokenizer()
    with TestClient(apps[0], base_url="http://localhost") as client:
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        resp = client.post("/v1/completions", json=body)
        assert resp.status_code == 200, resp.text
        out = resp.json()
    assert out["choices"][0]["text"] == tok.decode(plain_tokens)
    assert out["usage"]["speculation"]["draft_tokens"] > 0


def test_bench_e2e_runs_a_head_method_beside_plain(saved, tmp_path, capsys):
    """A head as a method's own model= and as --draft (verispec-draft, --gamma 2); hf-assisted cannot run a head:
    skipped."""
    target, head = saved
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": PROMPT, "category": "x"}) + "\n")
    method = f"verispec:draft=model,model={head},gamma=2"
    argv = ["bench", "e2e", "--target", target, "--draft", head, "--prompts", prompts, "--out", tmp_path / "out",
            "--methods", f"verispec-plain,{method},verispec-draft,hf-assisted", "--gamma", "2", "--num-prompts", "1",
            "--max-new-tokens", "6", "--temperatures", "0", "--batch", "1"]  # fmt: skip
    r = run_verispec(argv, capsys)
    assert r.returncode == 0, r.stderr
    assert "hf-assisted skipped: the draft is a hidden-state head (eagle3)" in r.stderr
    result = json.loads((tmp_path / "out" / "e2e.json").read_text())
    rows = {rec["method"]: rec for rec in result["records"]}
    assert set(rows) == {"verispec-plain", method, "verispec-draft"}
    for m in (method, "verispec-draft"):
        assert rows[m]["tau"] >= 1 and rows[m]["drafted_per_step"] > 0
    assert result["method_drafts"] == {str(head): str(head)}


def test_certify_generate_with_a_head(saved, tmp_path, capsys):
    target, head = saved
    base = ["certify", "generate", "--target", target, "--draft", head, "--prompt", PROMPT, "--samples", "20",
            "--length", "2", "--two-sample-tokens", "0", "--out", tmp_path]  # fmt: skip
    r = run_verispec(base, capsys)
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads((tmp_path / "generate-certificate.json").read_text())
    assert report["verdict"] == "PASS" and f"model={head}" in report["method"] and report["acceptance_rate"] is not None
    r = run_verispec([*base, "--method", "hf-assisted"], capsys)
    assert r.returncode == 2 and "is a hidden-state head (eagle3), not a model" in r.stderr


def test_calibrating_a_head_times_its_draft_step(saved, plain_tokens):
    """gamma auto's calibration times the head's draft step (its target runner holds the context it reads); the
    generator then decodes as plain decoding does."""
    target, head = saved
    gen = SpeculativeGenerator(
        load_model(str(target)), load_draft(str(head)), config=SpecConfig(draft="model", gamma="auto")
    )
    costs = gen.calibrate((1, 2), context=16, repeats=1)
    assert all(c["draft_step"] > 0 and len(c["curve"]) == gen.core.controller.max_gamma + 1 for c in costs.values())
    out = gen.generate(PROMPT, SamplingParams(temperature=0), max_new_tokens=12, ignore_eos=True)[0]
    assert out.token_ids == plain_tokens
