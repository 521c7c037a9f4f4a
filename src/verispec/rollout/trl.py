"""TRL's GRPOTrainer with rollouts from a `verispec serve` server (the guide: docs/guides/rl-rollouts.md#trl).

`verispec_rollout_func(url)` is a `rollout_func` (TRL's hook for custom generation, TRL 1.x): it syncs the policy's
weights to the server whenever the trainer has taken an optimizer step, then samples each distinct group of the
batch once (n = num_generations) by token ids, returning prompt_ids (as TRL's own `_tokenize_prompts` builds them),
completion_ids (EOS included when it ended a sample) and logprobs (log softmax(logits / T), what TRL computes for
the policy). `OnPolicyCheck` (a mixin: `class Trainer(OnPolicyCheck, GRPOTrainer)`) logs the largest gap between
those logprobs and the trainer's own recomputation (`verispec/logprob_gap_max`; meaningful with disable_dropout).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from .client import RolloutClient

__all__ = ["OnPolicyCheck", "verispec_rollout_func"]


def verispec_rollout_func(
    client: RolloutClient | str, *, sync_weights: bool = True, weight_dtype: torch.dtype = torch.float32
) -> Callable[[list, object], dict]:
    """TRL's `rollout_func` over a verispec server, for GRPOTrainer.

    The weights go as the unwrapped policy's named_parameters in one HTTP body, from the main process. With several
    training processes the main one gathers every process's prompts (a group may straddle processes), sends one
    request and hands every process its slice, as TRL's vLLM server mode does; a failure there is raised on every
    process (none waits forever).

    ```python
    rollout = verispec_rollout_func("http://127.0.0.1:8000")
    trainer = GRPOTrainer(model=path, reward_funcs=reward, train_dataset=ds, rollout_func=rollout,
                          args=GRPOConfig(..., use_vllm=False, temperature=1.0, bf16=False))
    ```

    Args:
        client: A `RolloutClient`, or the server's base URL.
        sync_weights: Send the trainer's weights before the first rollout and after every optimizer step. The
            server must then run with --enable-weight-updates (its weight routes answer 403 otherwise).
        weight_dtype: The dtype the weights are sent in (the served model's).

    Returns:
        The rollout function. It keeps the last server reply in `.last` (speculation figures, weight_version) and
        counts weight syncs in `.syncs`.
    """
    client = RolloutClient(client) if isinstance(client, str) else client
    state = {"step": None, "calls": 0}

    def rollout_func(prompts: list, trainer) -> dict:
        from accelerate.utils import broadcast_object_list, gather_object

        acc = trainer.accelerator
        everyone, counts = gather_object(list(prompts)), gather_object([len(prompts)])
        sync = sync_weights and state["step"] != trainer.state.global_step
        reply, error = None, None
        if acc.is_main_process:
            try:
                reply = _rollouts(client, trainer, everyone, sync, weight_dtype, state["calls"])
            except Exception as e:  # raised on every process below
                error = f"{type(e).__name__}: {e}"
        reply, error = broadcast_object_list([reply, error], from_process=0)
        if error is not None:
            raise RuntimeError(f"verispec rollout (on the main process) failed: {error}")
        state["calls"] += 1
        if sync:
            state["step"] = trainer.state.global_step
            rollout_func.syncs += 1
        rollout_func.last = reply
        begin = sum(counts[: acc.process_index])
        return {key: reply[key][begin : begin + len(prompts)] for key in ("prompt_ids", "completion_ids", "logprobs")}

    rollout_func.last, rollout_func.syncs = None, 0
    return rollout_func


def _rollouts(client: RolloutClient, trainer, prompts: list, sync: bool, dtype: torch.dtype, call: int) -> dict:
    """On the main process: sync the weights if asked, then one completion per entry of the whole batch."""
    if sync:
        model = trainer.accelerator.unwrap_model(trainer.model)
        client.update_weights((name, p.detach().to(dtype)) for name, p in model.named_parameters())
    g = trainer.num_generations if trainer.model.training else trainer.num_generations_eval
    ids = _tokenize(trainer, _groups(prompts, g))
    step = trainer.state.global_step
    seed = int(np.random.SeedSequence([int(trainer.args.seed), step, call]).generate_state(1, np.uint32)[0])
    args = trainer.args
    out = client.generate(
        ids,
        n=g,
        temperature=args.temperature,
        max_tokens=args.max_completion_length,
        seed=seed,
        top_p=args.top_p,
        top_k=args.top_k if args.top_k is not None else -1,
        min_p=args.min_p if args.min_p is not None else 0.0,
        repetition_penalty=args.repetition_penalty,
    )
    if "abort" in out["finish_reasons"]:
        raise RuntimeError("the server aborted the rollout (/abort_request): TRL cannot train on partial groups")
    out["prompt_ids"] = [p for p in out["prompt_ids"] for _ in range(g)]
    return out


def _groups(prompts: list, g: int) -> list:
    """The distinct prompts of a batch TRL repeated g times in a row (ValueError if it is not so shaped)."""
    if len(prompts) % g:
        raise ValueError(f"{len(prompts)} prompts do not split into groups of num_generations = {g}")
    groups = [prompts[i] for i in range(0, len(prompts), g)]
    if any(prompts[i * g + j] != p for i, p in enumerate(groups) for j in range(g)):
        raise ValueError("rollout_func expects each prompt repeated num_generations times in a row (TRL's sampler)")
    return groups


def _tokenize(trainer, prompts: list) -> list[list[int]]:
    tok = trainer.processing_class
    if prompts and isinstance(prompts[0], list):  # conversational
        enc = tok.apply_chat_template(
            conversation=prompts,
            tools=getattr(trainer, "tools", None) or None,
            chat_template=getattr(trainer, "chat_template", None),
            add_generation_prompt=True,
            tokenize=True,
            return_dict=True,
            **(getattr(trainer, "chat_template_kwargs", None) or {}),
        )
        return [list(map(int, x)) for x in enc["input_ids"]]
    return [list(map(int, x)) for x in tok(text=prompts)["input_ids"]]


class OnPolicyCheck:
    """A GRPOTrainer mixin that checks the rollouts are on-policy: `class Trainer(OnPolicyCheck, GRPOTrainer)`.

    Per generated batch it computes the largest |rollout logprob - trainer logprob| over completion tokens, the
    trainer's logprobs computed by its own `_get_per_token_logps_and_entropies` on its current weights. The gaps
    are kept in `self.logprob_gaps` and logged as `verispec/logprob_gap_max`. It costs one forward over the batch,
    and only means something with `disable_dropout=True`.
    """

    logprob_gaps: list[float]

    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        sampled = out.get("sampling_per_token_logps")
        if sampled is None:
            raise ValueError("OnPolicyCheck needs rollout logprobs: a rollout_func that returns them")
        ids = torch.cat([out["prompt_ids"], out["completion_ids"]], dim=1)
        mask = torch.cat([out["prompt_mask"], out["completion_mask"]], dim=1)
        with torch.no_grad():
            logps = self._get_per_token_logps_and_entropies(self.model, ids, mask, out["completion_ids"].size(1))[0]
        keep = out["completion_mask"].bool()
        gap = float((logps - sampled)[keep].abs().max()) if keep.any() else 0.0
        if not hasattr(self, "logprob_gaps"):
            self.logprob_gaps = []
        self.logprob_gaps.append(gap)
        self._metrics["train" if self.model.training else "eval"]["verispec/logprob_gap_max"].append(gap)
        return out
