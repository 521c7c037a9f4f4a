"""A draft with another tokenizer through every entry point: `verispec generate --draft` (chosen automatically,
`--spec cross_vocab=` to force one, a bad value refused before any model loads), the OpenAI server, `RolloutEngine`, `bench
e2e` (a method naming its own draft model beside the run's), and `certify generate` (PASS for the exact drafters,
FAIL for --inject tli-last-write) — on the tiny pair of tests/helpers/cross_tok.py saved to disk."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from verispec.bench.e2e import E2EConfig, run_e2e
from verispec.cli import main
from verispec.engine.config import SpecConfig
from verispec.engine.generator import SpeculativeGenerator
from verispec.rollout import RolloutEngine
from verispec.sampling import SamplingParams
from verispec.serve import create_app

from ..helpers.cross_tok import SAMPLES, cross_pair, save_cross_pair
from ..helpers.server import MODEL


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return save_cross_pair(tmp_path_factory.mktemp("cross-pair"))


@pytest.fixture(scope="module")
def pair():
    return cross_pair(0)


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("flags", [(), ("--spec", "cross_vocab=slem"), ("--spec", "cross_vocab=tli", "--tree", "2-2")])
def test_generate_with_a_draft_of_another_tokenizer_equals_plain_greedy(saved, capsys, flags):
    target, draft = map(str, saved)
    common = ["generate", SAMPLES[0], "--target", target, "--temperature", "0", "--max-new-tokens", "12", "--json"]
    code, plain, _ = run_cli(capsys, *common, "--draft", "none")
    assert code == 0
    code, spec, err = run_cli(capsys, *common, "--draft", draft, "--gamma", "3", *flags)
    assert code == 0, err
    assert json.loads(spec)["token_ids"] == json.loads(plain)["token_ids"]
    assert json.loads(spec)["stats"]["drafted"] > 0


def test_a_bad_cross_vocab_is_a_usage_error(saved, capsys):
    target, draft = map(str, saved)
    code, _, err = run_cli(
        capsys, "generate", "ab", "--target", target, "--draft", draft, "--spec", "cross_vocab=bytes"
    )
    assert code == 2 and "cross_vocab must be one of auto, tli, slem" in err
    code, _, err = run_cli(
        capsys, "generate", "ab", "--target", target, "--draft", "ngram", "--spec", "cross_vocab=tli"
    )
    assert code == 2 and "cross_vocab applies to a draft model" in err
    code, _, err = run_cli(
        capsys, "generate", "ab", "--target", target, "--draft", draft, "--spec", "cross_vocab=slem", "--tree", "2-1"
    )
    assert code == 2 and "chains" in err


def test_the_server_serves_a_cross_vocabulary_draft(pair):
    target, draft = pair
    gen = SpeculativeGenerator(target, draft, config=SpecConfig(draft="model", gamma=3))
    assert type(gen.core.proposer.runner).__name__ == "BridgedRunner"
    with TestClient(create_app(gen, MODEL, max_batch=4), base_url="http://localhost") as client:
        body = {"model": MODEL, "prompt": SAMPLES[0], "max_tokens": 10, "temperature": 0, "seed": 1}
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        plain = SpeculativeGenerator(target, config=SpecConfig(draft="none")).generate(
            SAMPLES[0], SamplingParams(temperature=0), max_new_tokens=10
        )
        assert r.json()["choices"][0]["text"] == plain[0].text


def test_rollouts_with_a_cross_vocabulary_draft_are_seeded_and_carry_logprobs(pair):
    target, draft = pair
    eng = RolloutEngine(
        target, draft, config=SpecConfig(draft="model", stop_below=None, gamma=3, random="stream"), max_batch_size=4
    )
    prompts = [target.tokenizer(s)["input_ids"] for s in SAMPLES[:2]]
    a = eng.generate(prompts, n=2, params=SamplingParams(temperature=1.0), max_new_tokens=8, seed=3)
    b = eng.generate(prompts, n=2, params=SamplingParams(temperature=1.0), max_new_tokens=8, seed=3)
    assert [o.completion_token_ids for o in a] == [o.completion_token_ids for o in b]
    assert all(len(o.logprobs) == len(o.completion_token_ids) for o in a)
    assert eng.last_stats.drafted > 0


def test_bench_e2e_runs_a_cross_vocabulary_draft_beside_its_own_method_draft(pair):
    target, draft = pair
    other = cross_pair(0)[0]  # the target itself as a same-tokenizer draft, named by path in the method
    cfg = E2EConfig(
        methods=(
            "verispec-plain",
            "verispec-draft",
            "verispec:draft=model,cross_vocab=slem",
            "verispec:draft=model,model=same",
        ),
        temperatures=(0.0,),
        max_new_tokens=6,
        num_prompts=1,
        batch=(),
        gamma=2,
    )
    result = run_e2e(target, draft, {"letters": SAMPLES[:1]}, cfg, log=lambda m: None, drafts={"same": other})
    methods = {r["method"] for r in result["records"]}
    assert methods == set(cfg.methods)
    assert result["method_drafts"] == {"same": other.name}
    texts = {r["method"]: r.get("tau") for r in result["records"]}
    assert texts["verispec:draft=model,model=same"] > 1.0  # the target drafting for itself is always kept


@pytest.mark.slow  # ~30 s each on 2 cores; tests/crossvocab/test_law.py holds the same verdicts in the default tier
@pytest.mark.parametrize(("inject", "verdict"), [(None, "PASS"), ("tli-last-write", "FAIL")])
def test_certify_passes_the_cross_vocabulary_draft_and_fails_the_last_write_merge(
    saved, capsys, tmp_path, inject, verdict
):
    """N = 1500 continuations of L = 3 tokens at temperature 1, family-wise level 0.01 (the certificate's own tests and
    power statement, in its report). The fixture draft gives its byte-fallback duplicates ('<0x61>' beside 'a', ...)
    the same rows as their ordinary pieces, so last-write keeps half their mass: a first-token TV far above the
    certificate's detectable effect at this N."""
    target, draft = map(str, saved)
    argv = ["certify", "generate", "--target", target, "--draft", draft, "--prompt", SAMPLES[0], "--samples", "1500"]
    argv += ["--length", "3", "--temperature", "1", "--gamma", "3", "--two-sample-tokens", "0", "--out", str(tmp_path)]
    argv += ["--inject", inject] if inject else []
    code, out, _ = run_cli(capsys, *argv)
    report = json.loads((tmp_path / "generate-certificate.json").read_text())
    assert report["verdict"] == verdict, out[-2000:]
    assert code == (0 if verdict == "PASS" else 1)
