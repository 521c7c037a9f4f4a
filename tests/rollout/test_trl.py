"""TRL's GRPOTrainer end to end with rollouts from a live `verispec serve` (the real TRL, a tiny random Qwen2 policy
saved to disk, CPU, fp32): 3 optimizer steps, weights synced to the server over HTTP before every rollout, and at
every step the logprobs verispec returned equal the trainer's own recomputation under the weights it trains
(`GRPOTrainer._get_per_token_logps_and_entropies`, 1e-4) with speculation on (accepted draft tokens > 0)."""

from __future__ import annotations

import os

import datasets
import torch
import trl

from verispec.engine.config import SpecConfig
from verispec.engine.generator import SpeculativeGenerator
from verispec.model import load_model
from verispec.model.loading import LoadedModel
from verispec.rollout.trl import OnPolicyCheck, verispec_rollout_func

from ..helpers.server import LiveServer
from ..helpers.tiny import make_model, make_tokenizer, noisy_copy

STEPS = 3


class CheckedGRPOTrainer(OnPolicyCheck, trl.GRPOTrainer):
    """Records the tokens of every generated batch beside OnPolicyCheck's logprob gaps."""

    tokens: list[int]

    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        self.tokens.append(int(out["completion_mask"].sum()))
        return out


def _reward(prompts, completions, completion_ids, **kwargs):
    return [float(len(set(ids))) for ids in completion_ids]  # varies within a group: non-zero advantages


def test_grpo_trainer_on_verispec_rollouts_is_on_policy(tmp_path):
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    policy_dir = tmp_path / "policy"
    tok = make_tokenizer()
    tok.pad_token = "<unk>"
    make_model(0, "qwen2").save_pretrained(policy_dir)
    tok.save_pretrained(policy_dir)

    served = load_model(str(policy_dir))  # the server's own copy of the initial policy
    draft = LoadedModel(noisy_copy(served.model, 0.3), served.tokenizer, "draft")  # stale after step 1: still exact
    gen = SpeculativeGenerator(served, draft, config=SpecConfig(draft="model", gamma=3))
    ds = datasets.Dataset.from_dict({"prompt": ["a b c d", "e f g", "h i j k l", "m n"] * 3})
    args = trl.GRPOConfig(
        output_dir=str(tmp_path / "out"),
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=8,
        max_steps=STEPS,
        learning_rate=5e-2,  # large: the policy's logprobs move well past the tolerance each step
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        disable_dropout=True,
        temperature=1.0,
        seed=0,
        use_vllm=False,
    )
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    with LiveServer(gen, max_batch=8, enable_weight_updates=True) as s:
        rollout = verispec_rollout_func(s.url)
        trainer = CheckedGRPOTrainer(
            model=model, reward_funcs=_reward, args=args, train_dataset=ds, processing_class=tok, rollout_func=rollout
        )
        trainer.tokens = []
        trainer.train()
        version = rollout.last["weight_version"]
        accepted = rollout.last["speculation"]["accepted_tokens"]

    assert trainer.state.global_step == STEPS and len(trainer.logprob_gaps) == STEPS
    moved = max(float((model.state_dict()[k] - v).abs().max()) for k, v in start.items())
    assert moved > 1e-3, "the optimizer did not change the policy: the sync would go untested"
    assert rollout.syncs == STEPS and version == STEPS  # synced before the first rollout and after every step
    assert all(n > 0 for n in trainer.tokens)
    assert max(trainer.logprob_gaps) < 1e-4, trainer.logprob_gaps
    assert sum("verispec/logprob_gap_max" in h for h in trainer.state.log_history) == STEPS  # logged each step
    assert accepted > 0
