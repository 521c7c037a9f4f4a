"""`verispec bench rl` on tiny random models: the task's reward, GRPO's advantages, the policy step and the weights it
pushes into every engine, and a short run end to end (speed is measured by the benchmark itself, never asserted)."""

from __future__ import annotations

import random

import pytest
import torch

from verispec.bench.rl import (
    FEW_SHOT,
    PolicyTrainer,
    RLBenchConfig,
    advantages,
    make_engines,
    problem,
    reward,
    step_prompts,
)
from verispec.bench.rl import _push as push
from verispec.cli import main
from verispec.sampling import SamplingParams

from ..helpers.saved import read_strict_json
from ..helpers.tiny import loaded, make_model, make_tokenizer


@pytest.mark.parametrize(
    "text, answer, expected",
    [
        (" 25\n12 + 3 = 15", 25, 1.0),  # the first number is the sum; what follows does not count
        ("The sum is 25.", 25, 1.0),  # a full stop is not a decimal part
        (" 25.0", 25, 1.0),
        (" 24 + 1 = 25", 25, 0.0),  # only the first number counts
        (" 2 5", 25, 0.0),
        (" 250", 25, 0.0),
        (" 25.5", 25, 0.0),
        (" -25", 25, 0.0),
        (" -7", -7, 1.0),
        (" twenty-five", 25, 0.0),
        ("", 25, 0.0),
    ],
)
def test_reward_reads_the_first_number(text, answer, expected):
    assert reward(text, answer) == expected


def test_problems_are_seeded_sums_cycled_through_the_pool():
    pool = [problem(random.Random(3)) for _ in range(2)]
    assert pool[0] == pool[1]  # seeded
    rng = random.Random(0)
    pool = [problem(rng) for _ in range(5)]
    for prompt, answer in pool:
        a, b = (int(x) for x in prompt.removeprefix(FEW_SHOT).removesuffix(" =").split(" + "))
        assert answer == a + b and 10 <= a <= 50 and 10 <= b <= 50
    assert step_prompts(pool, 0, 2) == pool[:2] and step_prompts(pool, 2, 2) == [pool[4], pool[0]]


def test_advantages_are_normalized_per_group():
    adv = advantages(torch.tensor([[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0], [0.0, 1.0, 0.0, 1.0]]))
    # group 0: mean 1/4, unbiased std 1/2; group 1: no spread, no signal; group 2: mean 1/2, std sqrt(1/3)
    torch.testing.assert_close(adv[0], torch.tensor([1.5, -0.5, -0.5, -0.5]), atol=1e-3, rtol=0)
    assert torch.equal(adv[1], torch.zeros(4))
    torch.testing.assert_close(adv[2], torch.tensor([-1.0, 1.0, -1.0, 1.0]) * 0.5 / 3**-0.5, atol=1e-3, rtol=0)


def _rollouts(eng, seed=0):
    return eng.generate(["a b c a b"], n=4, params=SamplingParams(temperature=1.0), max_new_tokens=6, seed=seed)


def test_a_policy_step_lowers_the_loss_and_every_engine_gets_its_weights():
    """The step moves the policy towards the samples of positive advantage (sum_i A_i * the change of their mean log
    pi is > 0) and descends (its loss, recomputed after it, is lower); before the push the engines' rollouts no
    longer follow the policy (logprob gap), after it every engine has the policy's weights and a new weight
    version."""
    target = loaded(0)
    engines = make_engines(target, None, RLBenchConfig(group=4, methods=("plain", "history")))
    trainer = PolicyTrainer(target, lr=1e-2, max_grad_norm=1.0)
    outs = _rollouts(engines["plain"])
    adv = advantages(torch.tensor([[1.0, 0.0, 0.0, 0.0]]))
    with torch.no_grad():
        before = trainer.logprobs(outs)[1]
    engines_own = torch.tensor([sum(o.with_eos()[1]) / len(o.with_eos()[1]) for o in outs])
    torch.testing.assert_close(before, engines_own, atol=1e-4, rtol=0)  # each rollout's own mean log pi
    first = trainer.step(outs, adv)
    with torch.no_grad():
        after = trainer.logprobs(outs)[1]
    assert (adv.reshape(-1) * (after - before)).sum() > 0
    assert first["logprob_gap"] < 1e-4 and first["grad_norm"] > 0  # the rollouts were the policy's
    second = trainer.step(outs, adv)  # the same batch after the first step: lower loss, the engines left behind
    assert second["loss"] < first["loss"] and second["logprob_gap"] > 1e-3
    pushed = push(engines, trainer)
    assert set(pushed) == {"plain", "history"}
    policy = dict(trainer.weights())
    for eng in engines.values():
        assert eng.weight_version == 1
        assert all(torch.equal(w, policy[n]) for n, w in eng.target.model.named_parameters())
    fresh = _rollouts(engines["history"], seed=1)
    assert all(o.weight_version == 1 for o in fresh)
    assert trainer.step(fresh, adv)["logprob_gap"] < 1e-4  # rollouts from the pushed weights are the policy's


def test_config_refuses_what_cannot_run():
    with pytest.raises(ValueError, match="group must be >= 2"):
        RLBenchConfig(group=1)
    with pytest.raises(ValueError, match="methods must be distinct"):
        RLBenchConfig(methods=("plain", "plain"))
    with pytest.raises(ValueError, match="methods must be distinct"):
        RLBenchConfig(methods=("plain", "draft"))


def test_a_short_run_end_to_end(tmp_path):
    """Two steps of plain, history and a frozen head (a 7-layer tiny target: EAGLE-3's aux layers need 7)."""
    make_model(0, layers=7).save_pretrained(tmp_path / "target")
    make_tokenizer().save_pretrained(tmp_path / "target")
    argv = ["bench", "rl", "--target", str(tmp_path / "target"), "--steps", "2", "--group", "3", "--pool", "2"]
    argv += ["--max-new-tokens", "6", "--frozen-steps", "1", "--head-steps", "2", "--methods", "plain,history,frozen"]
    assert main([*argv, "--out", str(tmp_path / "out"), "--threads", "1"]) == 0
    result = read_strict_json(tmp_path / "out" / "rl.json")
    assert result["commit"] is None or len(result["commit"]) == 40
    assert "+" in result["date"] or result["date"].endswith("Z")  # tz-aware
    recs = result["records"]
    assert [(r["step"], r["method"]) for r in recs] == [(s, m) for s in (0, 1) for m in ("plain", "history", "frozen")]
    assert all(r["weight_version"] == r["step"] and r["tokens"] <= 3 * 6 for r in recs)
    assert all(r["alpha"] is None and r["tau"] == 1.0 for r in recs if r["method"] == "plain")
    for r in recs:
        parts = r["rollout_seconds"] + r["head_train_seconds"] + r["update_seconds"] + r["push_seconds"]
        assert r["wall_seconds"] == pytest.approx(parts)
    assert [p["step"] for p in result["policy"]] == [0, 1] and all(p["logprob_gap"] < 1e-4 for p in result["policy"])
    assert result["frozen_head"]["samples"] == 3 and result["frozen_head"]["steps"] == 2
    assert [s["method"] for s in result["summary"]] == ["plain", "history", "frozen"]
    assert result["summary"][0]["tokens_per_s_x_plain"] == 1.0
    md = (tmp_path / "out" / "rl.md").read_text()
    assert "tau 0-1" in md and "| frozen |" in md
    assert (tmp_path / "out" / "rl.png").stat().st_size > 0
