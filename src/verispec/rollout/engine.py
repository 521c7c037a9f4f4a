"""Exact speculative rollouts for RL post-training: groups of samples, token ids in and out, in-place weight updates
(the guide: docs/guides/rl-rollouts.md).

Every rollout follows the *current* target exactly; what was derived from older weights (a separate draft model,
the rollout history) only changes how fast. Sample j of prompt i draws from its own stream, seeded by numpy's
SeedSequence([seed, i, j]). `logprobs` are those of the distribution actually sampled from — log_softmax(logits /
T) under plain temperature sampling, what TRL, verl and OpenRLHF recompute for their importance ratios; with
`strict_on_policy` (the default) options that would make it anything else are refused.
"""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from ..drafting import Proposer
from ..drafting.history import RolloutHistory
from ..engine.config import SpecConfig
from ..engine.core import WeightUpdate
from ..engine.generator import SpeculativeGenerator
from ..engine.request import Job, check_limits
from ..engine.rows import Completion
from ..engine.session import GenerationSession
from ..engine.stats import SpecStats
from ..model.loading import LoadedModel
from ..model.weights import load_safetensors_dir
from ..sampling import SamplingParams, check_seed

__all__ = [
    "RL_DEFAULTS",
    "Rollout",
    "RolloutEngine",
    "RolloutRequest",
    "WeightUpdate",
    "check_on_policy",
    "draw_seed",
    "sample_seed",
]

# RL's defaults: rollouts sample the same prompts again and again, so earlier rollouts of a prompt draft (history);
# chains of a draft model beside them have a fixed length (gamma 4) and run to it (stop_below none). random=stream:
# every rollout carries a seed, so auto would Gumbel-couple them all (other rollouts than before for a seed, fewer
# of a draft model's drafts kept); with gamma fixed a seed already gives the same rollouts in any batch.
RL_DEFAULTS = SpecConfig(draft="history", gamma=4, stop_below=None, random="stream")


@dataclass(frozen=True)
class Rollout:
    """One sample of a rollout: token ids in and out, with what a trainer needs.

    Attributes:
        prompt_index: The prompt's index i (its position in the call, or the global index a shard was given).
        sample_index: j in 0..n-1 within its group.
        prompt_token_ids: The prompt's token ids (chat template applied).
        completion_token_ids: The sampled tokens, EOS excluded (`with_eos` adds it).
        logprobs: log p(x) under the distribution sampled from: with plain temperature sampling exactly
            `log_softmax(logits / T)`, what TRL, verl and OpenRLHF recompute for the policy.
        raw_logprobs: `log_softmax(target logits)(x)` at temperature 1.
        finish_reason: "stop" (EOS or a stop string), "length" or "abort" (`RolloutEngine.abort`).
        stop_reason: The stop string or EOS id that ended it.
        eos_logprob: When EOS ended it: the EOS token's logprob (as `logprobs`), else None.
        text: The completion's text.
        seed: This sample's own seed, `SeedSequence([seed, i, j])` of the request seed: it replays the sample.
        weight_version: The target's weight version it was sampled under.
        stats: This sample's speculation figures.
    """

    prompt_index: int
    sample_index: int
    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    logprobs: list[float]
    raw_logprobs: list[float]
    finish_reason: str
    stop_reason: str | int | None
    eos_logprob: float | None
    text: str
    seed: int
    weight_version: int
    stats: SpecStats

    def with_eos(self) -> tuple[list[int], list[float]]:
        """The completion's token ids and logprobs with the EOS token that ended it, if one did.

        This is what a trainer scores, as vLLM's token_ids: the policy must learn to stop.

        Returns:
            (token ids, logprobs), EOS and its logprob appended when EOS ended the sample.
        """
        if self.eos_logprob is None or not isinstance(self.stop_reason, int):
            return list(self.completion_token_ids), list(self.logprobs)
        return [*self.completion_token_ids, self.stop_reason], [*self.logprobs, self.eos_logprob]


def sample_seed(seed: int, prompt_index: int, sample_index: int) -> int:
    """The seed of sample j of prompt i under one request seed (numpy's SeedSequence mixing)."""
    state = np.random.SeedSequence([seed, prompt_index, sample_index]).generate_state(2, np.uint32)
    return (int(state[0]) << 31) ^ int(state[1])  # < 2**63


def draw_seed() -> int:
    """A fresh request seed (numpy's entropy), for a rollout request that names none."""
    return int(np.random.SeedSequence().generate_state(1, np.uint32)[0])


@dataclass(frozen=True)
class RolloutRequest:
    """A rollout request's arguments (`RolloutEngine.generate`'s; a `RolloutCluster` checks them on its driver).

    prompt_indices: each prompt's index i in `SeedSequence([seed, i, j])` and `Rollout.prompt_index` (default 0, 1,
    ...): a shard of a larger batch passes its prompts' global indices and gets the same samples as the whole batch.
    """

    prompts: Sequence[Sequence[int]] | Sequence[str] | Sequence[Sequence[dict]]
    n: int = 1
    params: SamplingParams = SamplingParams()
    max_new_tokens: int = 256
    seed: int | None = None
    stop: str | Sequence[str] | None = ()
    chat: bool = False
    ignore_eos: bool = False
    prompt_indices: Sequence[int] | None = None

    @property
    def options(self) -> dict:
        """The keyword arguments of `RolloutEngine.generate` after prompts, n and params."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("prompts", "n", "params")}

    def check(self, max_batch_size: int, strict_on_policy: bool) -> None:
        """Every check that needs no model (ValueError): n, params, seed, limits and the prompts' container."""
        check_seed(self.seed)  # the rule of SamplingParams' seed: [0, 2**63)
        stop, n, params = self.stop, self.n, self.params
        strings = isinstance(stop, Sequence) and all(isinstance(x, str) for x in stop)
        if not (stop is None or isinstance(stop, str) or strings):
            raise ValueError(f"stop must be None, a string or a list of strings, got {stop!r}")
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= max_batch_size:
            raise ValueError(f"n must be an integer in [1, max_batch_size={max_batch_size}], got {n!r}")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        if params.seed is not None:
            raise ValueError("pass the request seed as generate(seed=...); each sample derives its own from it")
        if strict_on_policy:
            check_on_policy(params)
        check_limits(self.max_new_tokens, stop)
        if isinstance(self.prompts, str) or not isinstance(self.prompts, Sequence) or not self.prompts:
            raise ValueError("prompts must be a non-empty list of prompts (token id lists, strings or chat messages)")
        self.indices()

    def indices(self) -> list[int]:
        """Each prompt's index i (ValueError unless prompt_indices are distinct integers >= 0, one per prompt)."""
        indices, count = self.prompt_indices, len(self.prompts)
        if indices is None:
            return list(range(count))
        ok = isinstance(indices, Sequence) and all(isinstance(i, int) and not isinstance(i, bool) for i in indices)
        if not ok or len(indices) != count or len(set(indices)) != count or min(indices) < 0:
            raise ValueError(f"prompt_indices must be {count} distinct integers >= 0, one per prompt, got {indices!r}")
        return [int(i) for i in indices]


def check_on_policy(params: SamplingParams) -> None:
    """Refuse options under which the sampled distribution is not softmax(logits / T) (see the module docstring)."""
    used = [
        name
        for name, on in (
            ("temperature=0 (greedy)", params.greedy),
            ("top_k", params.top_k > 0),
            ("top_p", params.top_p < 1.0),
            ("min_p", params.min_p > 0.0),
            ("repetition/presence/frequency penalties", params.uses_penalties),
            ("logit_bias/allowed_token_ids/bad_words", params.uses_token_options),
            ("a structured-output constraint", params.constraint is not None),
        )
        if on
    ]
    if used:
        raise ValueError(
            f"{', '.join(used)}: the sampled distribution would not be softmax(logits / temperature), which is "
            "what RL trainers recompute for their importance ratios; use plain temperature sampling, or "
            "RolloutEngine(strict_on_policy=False) to sample anyway (logprobs are then those of the distribution "
            "actually sampled from)"
        )


def check_count(name: str, value, low: int = 1) -> int:
    """An integer argument >= low (ValueError naming it otherwise)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return value


class RolloutEngine:
    """Exact speculative rollouts for RL post-training: groups of n samples per prompt (a group joins the batch
    together, its prompt prefilled once), token ids in and out, weights replaced in place many times per hour.

    ```python
    cfg = SpecConfig.parse("draft=self+history,quant=int4,gamma=4,stop_below=none,random=stream")
    eng = RolloutEngine(policy, config=cfg)   # int4 self-draft + drafting from earlier rollouts
    outs = eng.generate(prompt_ids, n=8, params=SamplingParams(temperature=1.0), max_new_tokens=256, seed=step)
    eng.update_weights(trainer_model.named_parameters())       # after every optimizer step
    ```

    Any drafter of `SpecConfig`; the history drafters (history, model+history, self+history) draft from earlier
    rollouts of the same prompt and the running siblings of each group. A separate draft model keeps its weights
    unless `update_draft_weights` is called; a self-draft is re-quantized after every weight update. draft=online
    trains its head after every `generate` on the rollouts just verified (`learner`, `last_train_seconds`), keeps it
    across weight updates and `sleep` / `wake_up`, and `save_draft` writes it in the published layout.

    Args:
        target: The policy model (`load_model`; float32 is the reference precision).
        draft: What the config's drafter drafts with (as `SpeculativeGenerator`'s): a draft model (`LoadedModel`),
            a hidden-state head or a `Proposer` (draft=custom); None otherwise.
        config: The speculation configuration (default: `RL_DEFAULTS`, draft=history, gamma=4, stop_below=none,
            random=stream).
        max_batch_size: Rows in the running batch.
        strict_on_policy: Refuse options under which the sampled distribution is not `softmax(logits / T)`
            (top-k, top-p, min-p, penalties, greedy, a constraint), which a trainer cannot recompute from logits.
        history: A `RolloutHistory` to draft from (shared with other engines); the engine makes one when its
            drafter drafts from history and none is given.

    Raises:
        ValueError: A bad argument, or a history given to a drafter that does not draft from history.
    """

    def __init__(
        self,
        target: LoadedModel,
        draft: LoadedModel | Proposer | None = None,
        *,
        config: SpecConfig | None = None,
        max_batch_size: int = 64,
        strict_on_policy: bool = True,
        history: RolloutHistory | None = None,
    ):
        cfg = RL_DEFAULTS if config is None else config
        if not isinstance(cfg, SpecConfig):
            raise ValueError(f"config must be a SpecConfig, got {type(cfg).__name__}")
        if isinstance(draft, str):  # the removed spelling draft="self", "ngram", "none"
            raise ValueError(
                f"draft={draft!r}: name the drafter in the config (draft is a model, a head or a Proposer)"
            )
        if history is not None and not isinstance(history, RolloutHistory):
            raise ValueError(f"history must be a RolloutHistory or None, got {type(history).__name__}")
        if history is not None and not cfg.drafter.history:
            raise ValueError(f"a history was given, but draft={cfg.draft} does not draft from history")
        self.history = (history if history is not None else RolloutHistory()) if cfg.drafter.history else None
        self.gen = SpeculativeGenerator(target, draft, config=cfg, history=self.history)
        if self.gen.learner is not None:
            self.gen.learner.inline = False  # draft=online: trained between batches (`_train_head`), not in them
        self._init_state(target, draft, cfg, max_batch_size, strict_on_policy)

    @classmethod
    def from_generator(
        cls, gen: SpeculativeGenerator, *, max_batch_size: int = 64, strict_on_policy: bool = True
    ) -> RolloutEngine:
        """Rollouts over an existing generator, its config and its drafter (no history of its own): what `verispec
        serve` runs its RL routes on, sharing the model with its OpenAI routes. A draft=online head keeps the
        generator's way of training (inline, within its budget: then `generate` trains no more after a batch).

        Args:
            gen: The generator to run on.
            max_batch_size: Rows in the running batch.
            strict_on_policy: As in the constructor.

        Returns:
            The engine.

        Raises:
            ValueError: max_batch_size is not an integer >= 1.
        """
        eng = cls.__new__(cls)
        eng.history, eng.gen = None, gen
        eng._init_state(gen.target, None, gen.config, max_batch_size, strict_on_policy)
        return eng

    def _init_state(self, target, draft, config: SpecConfig, max_batch_size: int, strict_on_policy: bool) -> None:
        self.target, self.draft, self.config = target, draft, config
        self.max_batch_size = check_count("max_batch_size", max_batch_size)
        self.strict_on_policy = strict_on_policy
        self.last_stats = SpecStats()
        self.last_train_seconds = 0.0  # draft=online: the head's training after the last generate (not in its time)
        self.sleeping = False  # `sleep`: the caches are freed, generate refused until `wake_up`
        self._lock = threading.Lock()  # generate, head training, weight updates and sleep never overlap
        self._aborting = threading.Event()

    @property
    def learner(self):
        """draft=online: the head being trained (`heads.online.OnlineLearner`: `version`, `head`, `stats()`);
        None for other drafters."""
        return self.gen.learner

    @property
    def weight_version(self) -> int:
        """The target's weight version: it counts updates, and every Rollout reports the one it was drawn under."""
        return self.gen.core.weight_version

    @weight_version.setter
    def weight_version(self, version: int) -> None:  # a RolloutCluster's replica takes the cluster's version
        self.gen.core.weight_version = version

    # --- rollouts -------------------------------------------------------------------------------------
    def generate(
        self,
        prompts: Sequence[Sequence[int]] | Sequence[str] | Sequence[Sequence[dict]],
        n: int = 1,
        params: SamplingParams = SamplingParams(),
        *,
        cancel: threading.Event | None = None,
        **options,
    ) -> list[Rollout]:
        """n samples of every prompt, in prompt order then sample order.

        `abort()` from another thread ends the call after the current step: unfinished samples come back with the
        tokens they have and finish_reason "abort"; so does setting `cancel`. With draft=online the head then trains
        on what was verified, for `online_budget`'s share of the time (`last_train_seconds`; not in
        `last_stats.wall_time`).

        Args:
            prompts: Token id lists; or texts or chat messages, templated when chat=True.
            n: Samples per prompt (a group), at most max_batch_size.
            params: How to sample (under strict_on_policy: temperature only).
            cancel: This call's own stop event: set it before or during the call to end it after the current step.
            **options (Any): max_new_tokens (256); seed (the request seed every sample's own seed derives from;
                None: drawn); stop; chat; ignore_eos; prompt_indices (each prompt's index i in
                `SeedSequence([seed, i, j])` and `Rollout.prompt_index`, default 0, 1, ...: a shard of a larger
                batch run elsewhere passes its prompts' global indices and gets the same samples as the whole batch
                run here).

        Returns:
            n Rollouts per prompt, in prompt order then sample order.

        Raises:
            ValueError: A bad prompt, n, option or parameter (checked before any compute), or an option that is not
                on-policy under strict_on_policy.
            RuntimeError: The engine sleeps (`sleep`): call `wake_up` first.
        """
        job, seed = self.job(prompts, n, params, **options)
        with self._lock:
            if self.sleeping:
                raise RuntimeError("the rollout engine sleeps (its caches were freed): call wake_up() first")
            self._aborting.clear()
            outs = self._run(job, seed, cancel if cancel is not None else threading.Event())
            self._train_head()
            return outs

    def job(self, prompts, n: int = 1, params: SamplingParams = SamplingParams(), *, key=None, **options):
        """The engine job of a rollout request (every check done, nothing run) and its request seed: sample j of
        prompt i is request (i, j) with seed `sample_seed(seed, i, j)`, the n samples of a prompt one group (they
        join the batch together: the prompt is prefilled once). `generate` runs it; the server queues it."""
        req = RolloutRequest(prompts, n, params, **options)
        req.check(self.max_batch_size, self.strict_on_policy)
        core = self.gen.core
        ids = [core.encode(p, req.chat) for p in prompts]  # all validated before any compute
        seed = draw_seed() if req.seed is None else req.seed
        requests = [
            core.request(
                prompt,
                replace(params, seed=sample_seed(seed, i, j)),
                max_new_tokens=req.max_new_tokens,
                stop=req.stop,
                ignore_eos=req.ignore_eos,
                key=(i, j),
                index=k * n + j,
            )
            for k, (i, prompt) in enumerate(zip(req.indices(), ids))
            for j in range(n)
        ]
        return Job(requests, group=n, **({} if key is None else {"key": key})), seed

    def abort(self) -> None:
        """End a running `generate` after its current step (call it from another thread); no-op when none runs."""
        self._aborting.set()

    def _run(self, job: Job, seed: int, cancel: threading.Event) -> list[Rollout]:
        sess = GenerationSession(self.gen.core, self.max_batch_size)
        sess.submit(job)
        done: dict[tuple[int, int], Rollout] = {}
        t0 = time.perf_counter()
        try:
            self._drive(sess, job, seed, cancel, done)
        finally:
            sess.close()  # (a RowFault raised: staged prompts freed)
        self.last_stats = sess.stats
        self.last_stats.wall_time = time.perf_counter() - t0
        return [done[r.key] for r in job.requests]  # prompt order (not prompt_indices'), then sample order

    def _drive(self, sess: GenerationSession, job: Job, seed: int, cancel: threading.Event, done: dict) -> None:
        """Step the session until idle (or aborted), collecting each finished request's Rollout in `done`."""
        while not sess.idle:
            if self._aborting.is_set() or cancel.is_set():
                for event in sess.abort(job.key):
                    done[event.key] = self.rollout(event.completion, seed, record=False)
                break
            for event in sess.step():
                if event.completion is not None and event.completion.error is not None:
                    raise event.completion.error  # a RowFault: a rollout failed inside a step (never a silent gap)
                if event.completion is not None:
                    done[event.key] = self.rollout(event.completion, seed)

    def _train_head(self) -> None:
        """draft=online trained between batches: the budget's share of the batch's time, on what it verified."""
        learner, self.last_train_seconds = self.learner, 0.0
        if learner is not None and not learner.inline:
            self.last_train_seconds = learner.train_between(self.last_stats.wall_time)

    def rollout(self, c: Completion, seed: int, record: bool = True, key: tuple[int, int] | None = None) -> Rollout:
        """A finished request of a rollout job (`job`) as a Rollout; `record` adds it to the history (not for an
        aborted one). key: the request's (prompt index, sample index) when the completion carries another key."""
        if self.history is not None and record and c.finish_reason != "abort":
            self.history.add(c.prompt_token_ids, c.token_ids)
        i, j = c.key if key is None else key
        return Rollout(
            prompt_index=i,
            sample_index=j,
            prompt_token_ids=list(c.prompt_token_ids),
            completion_token_ids=list(c.token_ids),
            logprobs=list(c.logprobs),
            raw_logprobs=list(c.raw_logprobs),
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
            eos_logprob=c.eos_logprob,
            text=c.text,
            seed=sample_seed(seed, i, j),
            weight_version=self.weight_version if c.weight_version is None else c.weight_version,
            stats=c.stats,
        )

    # --- weight updates -------------------------------------------------------------------------------
    def update_weights(self, named_tensors: Iterable[tuple[str, Tensor]]) -> WeightUpdate:
        """Replace target weights in place, after a running `generate` finishes.

        Every name, shape, dtype and value (NaN / inf) is checked before anything is written, so a bad update
        changes nothing. The tensors are then copied into the model's own parameters (no reload). Drafts derived
        from the target (a quantized self-draft) are rebuilt from the new weights; a separate draft model is
        untouched, and so is an online head (it goes on training on the new policy's rollouts).

        Args:
            named_tensors: (name, tensor) pairs, names as in the model's state_dict (e.g. a trainer's
                `model.named_parameters()`); a subset of the weights is fine.

        Returns:
            The new weight version, the tensors written and the time taken.

        Raises:
            WeightUpdateError: The update was refused; the message lists every problem.
        """
        return self._update(named_tensors)

    def update_weights_from_path(self, path) -> WeightUpdate:
        """`update_weights` from a checkpoint on disk.

        Args:
            path (str | os.PathLike): A directory of *.safetensors files (a save_pretrained checkpoint) or one file.

        Returns:
            The new weight version, the tensors written and the time taken.

        Raises:
            WeightUpdateError: The update was refused; the message lists every problem.
        """
        return self._update(load_safetensors_dir(path))

    def update_draft_weights(self, named_tensors: Iterable[tuple[str, Tensor]]) -> WeightUpdate:
        """Replace a separate draft model's weights the same way (the weight version does not change).

        Args:
            named_tensors: (name, tensor) pairs, names as in the draft model's state_dict.

        Returns:
            The (unchanged) weight version, the tensors written and the time taken.

        Raises:
            ValueError: There is no separate draft model.
            WeightUpdateError: The update was refused; the message lists every problem.
        """
        if not isinstance(self.draft, LoadedModel):
            raise ValueError("update_draft_weights needs a separate draft model (draft=LoadedModel)")
        return self._update(named_tensors, self.draft.model)

    def _update(self, named_tensors, draft_model=None) -> WeightUpdate:
        with self._lock:  # between generate calls: every rollout is drawn under one weight version
            return self.gen.core.update_weights(named_tensors, model=draft_model)

    # --- memory and the online head -------------------------------------------------------------------
    def sleep(self) -> None:
        """Free what the engine holds besides its weights, once a running `generate` has finished: the target's KV
        cache (with the hidden states a head reads) and the drafters' caches, as vLLM's sleep frees its KV cache (the
        weights stay where they are; a llama.cpp context keeps its cells). What drafting learned stays: the rollout
        history, an online head with its versions and training state. `generate` is refused until `wake_up`;
        weight updates are not. A no-op when already asleep or when nothing was allocated."""
        with self._lock:
            self.sleeping = True
            self.gen.core.release()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def wake_up(self) -> None:
        """Take rollouts again after `sleep` (the next batch allocates the caches). A no-op when awake."""
        with self._lock:
            self.sleeping = False

    def save_draft(self, folder: str | Path) -> Path:
        """draft=online: the published head in the SafeAILab / SpecForge layout (config.json, model.safetensors:
        `--draft DIR`, `load_draft`, vLLM, SGLang) and its training state beside it (`draft=online,model=DIR`
        resumes from it). Between `generate` calls, never during one.

        Args:
            folder: The directory to write (made if missing; the files in it replaced).

        Returns:
            The folder.

        Raises:
            ValueError: The drafter is not draft=online, or its head has no version yet.
        """
        with self._lock:
            if self.learner is None:
                raise ValueError(f"save_draft saves an online head: draft={self.config.draft} trains none")
            self.learner.save(folder, self.gen.core.runner.num_layers)
        return Path(folder)
