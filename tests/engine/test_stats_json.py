"""A call's stats agree with themselves, with the wall time measured around the call and with the steps counted by an
observer; `verispec generate --json` reports them (strict JSON) and names the drafter in use, as does the summary line
(`engine.drafters.describe_drafter`, `describe_fallback`)."""

from __future__ import annotations

import json
import math
import time
from functools import partial

import pytest

from verispec.cli import main
from verispec.drafting import CombinedProposer, DraftModelProposer, HistoryProposer
from verispec.drafting.history import RolloutHistory
from verispec.drafting.tree import TreeSpec
from verispec.engine import SpeculativeGenerator
from verispec.engine.config import SpecConfig
from verispec.engine.drafters import describe_drafter, describe_fallback
from verispec.engine.observe import StepObserver
from verispec.heads import load_head
from verispec.model.fast import make_runner
from verispec.sampling import SamplingParams

from ..helpers.cross_tok import cross_pair
from ..helpers.heads import save_eagle3
from ..helpers.tiny import V, loaded, make_model, make_tokenizer

PROMPT = [3, 4, 5, 3, 4, 5, 3]


class StepCounter(StepObserver):
    """Counts the steps and their drafts, independently of SpecStats."""

    def __init__(self):
        self.steps, self.drafted = 0, 0

    def after_verify(self, view, draft, out) -> None:
        self.steps += 1
        self.drafted += sum(out.drafted)


def check_times(s: dict) -> None:
    """A one-call stats summary's times against each other."""
    parts = ("prefill_time_s", "draft_time_s", "verify_time_s", "other_time_s")
    assert all(s[k] >= 0 for k in parts) and s["verify_time_s"] > 0 and s["prefill_time_s"] > 0
    assert sum(s[k] for k in parts) == pytest.approx(s["wall_time_s"], rel=1e-9, abs=1e-9)
    assert s["prefill_time_s"] < s["time_to_first_token_s"] <= s["wall_time_s"]
    assert s["tokens_per_second"] == pytest.approx(s["output_tokens"] / s["wall_time_s"], rel=1e-12)


def check_counts(s: dict) -> None:
    """A stats summary's step counts against each other (chains: a step's depth is its drafts)."""
    by = {int(k): n for k, n in s["steps_by_drafted"].items()}
    assert sum(by.values()) == s["target_passes"]
    assert sum(k * n for k, n in by.items()) == s["drafted"] == s["nodes"]
    assert s["emitted"] == s["accepted"] + s["target_passes"]
    assert s["accepted"] <= s["drafted"] and s["output_tokens"] <= s["emitted"]


def test_one_prompt_stats_match_the_wall_time_and_the_steps():
    target, draft = loaded(0), loaded(1, layers=1)
    counter = StepCounter()
    gen = SpeculativeGenerator(target, draft, config=SpecConfig(draft="model", gamma=3), observers=[counter])
    t0 = time.perf_counter()
    out = gen.generate(PROMPT, SamplingParams(temperature=1.0, seed=0), max_new_tokens=16, ignore_eos=True)[0]
    outer = time.perf_counter() - t0
    st = gen.last_stats
    s = st.summary()
    check_times(s)
    assert 0 < s["wall_time_s"] <= outer  # measured inside the call
    check_counts(s)
    assert s["draft_time_s"] > 0 and s["output_tokens"] == len(out.token_ids) == 16
    assert s["target_passes"] == counter.steps and s["drafted"] == counter.drafted > 0
    mine = out.stats  # the request's own counts: one request, so the call's
    for k in ("drafted", "accepted", "emitted", "nodes", "target_passes", "steps_by_drafted", "output_tokens"):
        assert getattr(mine, k) == getattr(st, k), k
    assert gen.stats.wall_time == st.wall_time and gen.stats.prefill_time == st.prefill_time  # pooled over calls


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("target")
    make_model(0).save_pretrained(d)
    make_tokenizer().save_pretrained(d)
    return d


def strict(text: str) -> dict:
    def refuse(name):
        raise AssertionError(f"{name} in the JSON")

    return json.loads(text, parse_constant=refuse)


def test_generate_json_stats_are_one_calls_and_name_the_drafter(target_dir, capsys):
    argv = ["generate", "a b c a b", "--target", target_dir, "--max-new-tokens", "12", "--temperature", "0", "--json"]
    t0 = time.perf_counter()
    assert main([str(a) for a in [*argv, "--draft", "self", "--spec", "quant=int8", "--gamma", "2"]]) == 0
    outer = time.perf_counter() - t0  # (loading the model included: only an upper bound)
    doc = strict(capsys.readouterr().out)
    s = doc["stats"]
    assert s["drafter"] == "int8 self-draft" and s["output_tokens"] == len(doc["token_ids"]) == 12
    assert s["threads"] >= 1  # the CPU threads the models ran (a load-dependent default: say it to reproduce)
    assert s["draft_time_s"] > 0 and s["drafted"] > 0
    check_times(s)
    assert s["wall_time_s"] < outer
    check_counts(s)


def test_nothing_drafted_gives_no_rate_and_says_so(target_dir, capsys):
    argv = ["generate", "a b c a b", "--target", target_dir, "--max-new-tokens", "6", "--temperature", "0"]
    argv += ["--spec", "gamma=0"]
    assert main([str(a) for a in [*argv, "--json"]]) == 0
    s = strict(capsys.readouterr().out)["stats"]
    assert s["drafter"] == "prompt lookup" and s["drafted"] == 0 and s["acceptance_rate"] is None
    assert s["steps_by_drafted"] == {"0": s["target_passes"]}
    assert main([str(a) for a in argv]) == 0
    line = capsys.readouterr().err.strip().splitlines()[-1]
    passes = s["target_passes"]
    assert f"drafter=prompt lookup, no draft on {passes} of {passes} steps, spec draft=ngram,gamma=0," in line, line
    assert "acceptance=-," in line and "nan" not in line


def test_fallback_counts_the_steps_without_a_draft():
    gen = SpeculativeGenerator(loaded(0), config=SpecConfig(draft="ngram", gamma=4))
    gen.generate([5, 6, 7, 8], SamplingParams(temperature=0), max_new_tokens=3, ignore_eos=True)
    st = gen.last_stats
    plain = st.steps_by_drafted.get(0, 0)
    assert plain > 0  # no n-gram of the prompt recurs at first
    assert describe_fallback(st) == f"no draft on {plain} of {st.target_passes} step" + "s" * (st.target_passes != 1)
    assert describe_fallback(st, drafting=False) is None
    st.steps_by_drafted = {2: 3}
    assert describe_fallback(st) is None


def test_the_drafter_in_use_is_named(tmp_path):
    target = loaded(0)
    named = {
        "none": SpeculativeGenerator(target, config=SpecConfig(draft="none")),
        "prompt lookup": SpeculativeGenerator(target),
        "draft model": SpeculativeGenerator(target, loaded(1, layers=1), config=SpecConfig(draft="model")),
        "int4 self-draft": SpeculativeGenerator(target, config=SpecConfig(draft="self", quant="int4")),
    }
    cross_target, cross_draft = cross_pair()
    named["draft model (cross-vocabulary bridge)"] = SpeculativeGenerator(
        cross_target, cross_draft, config=SpecConfig(draft="model")
    )
    named["draft model (cross-vocabulary, string-level match)"] = SpeculativeGenerator(
        cross_target, cross_draft, config=SpecConfig(draft="model", cross_vocab="slem")
    )
    four = loaded(0, layers=4)
    head = load_head(save_eagle3(tmp_path / "eagle3", V))
    named["EAGLE-3 head"] = SpeculativeGenerator(four, head, config=SpecConfig(draft="model", gamma=2))
    assert {name: gen.drafter for name, gen in named.items()} == {name: name for name in named}
    trie = HistoryProposer(RolloutHistory(), tree=TreeSpec.parse("dynamic-4-2-8", "deterministic"))
    both = CombinedProposer(trie, DraftModelProposer(target.model, V, runner=partial(make_runner, quant="int8")), 2)
    assert describe_drafter(both, target.model) == "rollout history + int8 self-draft"
    out = named["EAGLE-3 head"].generate(PROMPT, SamplingParams(temperature=0), max_new_tokens=4)[0]
    assert out.token_ids and not math.isnan(named["EAGLE-3 head"].last_stats.tau)
