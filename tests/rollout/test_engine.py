"""The rollout engine on tiny random models: shared prefills, seeds, in-place weight updates, on-policy checks."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from safetensors.torch import save_file

from verispec.drafting.history import RolloutHistory
from verispec.engine.config import SpecConfig
from verispec.model.fast import make_runner
from verispec.rollout import RolloutEngine, WeightUpdateError, sample_seed
from verispec.rollout.engine import RL_DEFAULTS
from verispec.sampling import Constraint, SamplingParams

from ..helpers.tiny import greedy_reference, loaded

PROMPTS = [[3, 7, 7, 12, 3, 7], [5, 9, 11, 4]]
T1 = SamplingParams(temperature=1.0)
PLAIN = SpecConfig.parse("draft=none,gamma=4,stop_below=none,random=stream")  # RL_DEFAULTS without history
SELF = SpecConfig.parse("draft=self,quant=int4,gamma=4,stop_below=none,random=stream")


@pytest.fixture
def policy():
    """A target of its own (these tests replace its weights)."""
    return loaded(0)


def _new_weights(seed: int = 5) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in loaded(seed).model.state_dict().items()}


def test_a_group_prefills_its_prompt_once(tiny_target):
    eng = RolloutEngine(tiny_target, config=PLAIN)
    before = eng.gen.core.runner.tokens_computed
    outs = eng.generate([PROMPTS[0]], n=4, params=T1, max_new_tokens=1, seed=0, ignore_eos=True)
    assert [o.sample_index for o in outs] == [0, 1, 2, 3]
    # prompt minus its pending last token, once; then one position per sample for the first step
    assert eng.gen.core.runner.tokens_computed - before == (len(PROMPTS[0]) - 1) + 4


def test_groups_are_seeded_and_reproducible(tiny_target):
    eng = RolloutEngine(tiny_target, config=PLAIN, max_batch_size=3)  # groups of 2 join and leave the batch
    a = eng.generate(PROMPTS, n=2, params=T1, max_new_tokens=12, seed=7)
    b = eng.generate(PROMPTS, n=2, params=T1, max_new_tokens=12, seed=7)
    c = eng.generate(PROMPTS, n=2, params=T1, max_new_tokens=12, seed=8)
    assert [(o.prompt_index, o.sample_index) for o in a] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [o.completion_token_ids for o in a] == [o.completion_token_ids for o in b]
    assert [o.completion_token_ids for o in a] != [o.completion_token_ids for o in c]
    assert [o.seed for o in a] == [sample_seed(7, i, j) for i in range(2) for j in range(2)]
    assert len({o.seed for o in a}) == 4
    assert all(o.prompt_token_ids == PROMPTS[o.prompt_index] for o in a)
    assert all(len(o.logprobs) == len(o.raw_logprobs) == len(o.completion_token_ids) for o in a)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0),
        SamplingParams(top_k=5),
        SamplingParams(top_p=0.9),
        SamplingParams(min_p=0.1),
        SamplingParams(repetition_penalty=1.2),
        SamplingParams(logit_bias={3: 2.0}),
        SamplingParams(allowed_token_ids=[3, 4, 5]),
        SamplingParams(bad_words=[[3]]),
        SamplingParams(constraint=Constraint.grammar('root ::= ("a" | "b")+ "x0"')),
    ],
)
def test_options_a_trainer_cannot_recompute_are_refused(tiny_target, params):
    eng = RolloutEngine(tiny_target, config=PLAIN)
    with pytest.raises(ValueError, match="importance ratios"):
        eng.generate(PROMPTS, n=2, params=params, max_new_tokens=4, seed=0)
    RolloutEngine(tiny_target, config=PLAIN, strict_on_policy=False).generate(
        PROMPTS, n=2, params=params, max_new_tokens=4, seed=0
    )


def test_bad_arguments_are_refused(tiny_target):
    eng = RolloutEngine(tiny_target, config=PLAIN, max_batch_size=4)
    for kwargs, match in [
        (dict(n=0), "n must be"),
        (dict(n=5), "n must be"),
        (dict(params=SamplingParams(seed=3)), "request seed"),
        (dict(prompts=[]), "non-empty list"),
        (dict(prompts=[[99]]), "token ids must lie"),
    ]:
        args = dict(prompts=PROMPTS, n=2, params=T1, max_new_tokens=4) | kwargs
        with pytest.raises(ValueError, match=match):
            eng.generate(**args)
    with pytest.raises(ValueError, match="a history was given, but draft=none does not draft from history"):
        RolloutEngine(tiny_target, config=PLAIN, history=RolloutHistory())
    with pytest.raises(ValueError, match="draft='self': name the drafter in the config"):
        RolloutEngine(tiny_target, "self")
    with pytest.raises(ValueError, match="config must be a SpecConfig"):
        RolloutEngine(tiny_target, config="draft=none")
    with pytest.raises(ValueError, match="max_batch_size must be an integer >= 1"):
        RolloutEngine(tiny_target, config=PLAIN, max_batch_size=0)


def test_rl_defaults_and_a_shared_history(tiny_target):
    """No config: RL_DEFAULTS (history drafting, with a history of the engine's own); a history given is the one
    drafted from and recorded into."""
    eng = RolloutEngine(tiny_target)
    assert eng.config == RL_DEFAULTS == SpecConfig.parse("draft=history,gamma=4,stop_below=none,random=stream")
    assert isinstance(eng.history, RolloutHistory) and len(eng.history) == 0
    shared = RolloutHistory()
    eng = RolloutEngine(tiny_target, history=shared)
    assert eng.history is shared and eng.gen.core.proposer.history is shared
    eng.generate([PROMPTS[0]], n=2, params=T1, max_new_tokens=4, seed=0)
    assert len(shared) == 1
    assert RolloutEngine(tiny_target, config=PLAIN).history is None


def _snapshot(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize(
    "break_it,match",
    [
        (lambda w: w.update({"model.no_such.weight": torch.zeros(3)}), "no such parameter"),
        (lambda w: w.update({"lm_head.weight": torch.zeros(3, 3)}), "shape"),
        (lambda w: w.update({"lm_head.weight": w["lm_head.weight"].double()}), "dtype"),
        (lambda w: w["model.norm.weight"].__setitem__(0, float("nan")), "NaN"),
    ],
)
def test_a_bad_update_changes_nothing(policy, break_it, match):
    eng = RolloutEngine(policy, config=SELF)
    before = _snapshot(policy.model)
    draft_runner = eng.gen.core.proposer.runner
    weights = _new_weights()
    break_it(weights)
    with pytest.raises(WeightUpdateError, match=match):
        eng.update_weights(weights.items())
    assert eng.weight_version == 0
    assert eng.gen.core.proposer.runner is draft_runner  # nothing re-quantized
    after = policy.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_rollouts_after_an_update_follow_the_new_weights(policy):
    """Greedy rollouts equal the updated model's own greedy output; the returned logprobs equal a fresh fp32
    forward of the updated model; the int4 self-draft is re-quantized from the new weights."""
    fresh = loaded(5)
    eng = RolloutEngine(policy, config=replace(SELF, gamma=3), strict_on_policy=False)
    eng.generate(PROMPTS, n=2, params=T1, max_new_tokens=6, seed=0)  # caches and drafts from the old weights
    report = eng.update_weights(_new_weights(5).items())
    assert report.version == eng.weight_version == 1 and report.tensors == len(fresh.model.state_dict())
    assert report.requantize_seconds > 0
    # the re-quantized draft is the one a fresh int4 runner builds from the new weights
    ids = [PROMPTS[0]]
    ref_runner = make_runner(fresh.model, 32, quant="int4")
    for r in (eng.gen.core.proposer.runner, ref_runner):
        r.start(1, 16)
    assert torch.equal(eng.gen.core.proposer.runner.forward(ids), ref_runner.forward(ids))
    greedy = eng.generate(PROMPTS, n=1, params=SamplingParams(temperature=0.0), max_new_tokens=10, seed=0)
    for o in greedy:
        assert o.completion_token_ids == greedy_reference(fresh.model, o.prompt_token_ids, 10)
        assert o.weight_version == 1
    sampled = eng.generate(PROMPTS, n=2, params=SamplingParams(temperature=0.7), max_new_tokens=10, seed=1)
    with torch.no_grad():
        for o in sampled:
            seq = torch.tensor([o.prompt_token_ids + o.completion_token_ids])
            logits = fresh.model(seq).logits[0, len(o.prompt_token_ids) - 1 : -1].double()
            tok = torch.tensor(o.completion_token_ids).unsqueeze(1)
            raw = logits.log_softmax(-1).gather(1, tok).squeeze(1)
            processed = (logits / 0.7).log_softmax(-1).gather(1, tok).squeeze(1)
            torch.testing.assert_close(torch.tensor(o.raw_logprobs, dtype=torch.float64), raw, atol=1e-5, rtol=0)
            torch.testing.assert_close(torch.tensor(o.logprobs, dtype=torch.float64), processed, atol=1e-5, rtol=0)
    assert eng.last_stats.drafted > 0


def test_update_from_a_safetensors_directory(policy, tmp_path):
    eng = RolloutEngine(policy, config=PLAIN)
    weights = _new_weights(5)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(tmp_path / "model.safetensors"))
    eng.update_weights_from_path(tmp_path)
    after = policy.model.state_dict()
    assert all(torch.equal(after[k], weights[k]) for k in weights)
    with pytest.raises(WeightUpdateError, match=r"no \*\.safetensors"):
        eng.update_weights_from_path(tmp_path / "..")
    assert eng.weight_version == 1


def test_a_separate_draft_keeps_its_weights_unless_updated(policy, tiny_draft):
    draft = loaded(1, layers=1)
    eng = RolloutEngine(policy, draft, config=replace(SELF, draft="model", quant=None))
    before = _snapshot(draft.model)
    eng.update_weights(_new_weights(5).items())
    assert all(torch.equal(before[k], v) for k, v in draft.model.state_dict().items())
    new_draft = {k: v.clone() for k, v in loaded(9, layers=1).model.state_dict().items()}
    eng.update_draft_weights(new_draft.items())
    assert eng.weight_version == 1
    assert all(torch.equal(new_draft[k], v) for k, v in draft.model.state_dict().items())
