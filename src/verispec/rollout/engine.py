"""Exact speculative rollouts for RL post-training: groups of samples, token ids in and out, in-place weight updates.

    eng = RolloutEngine(policy, draft="self", draft_quant="int4", history=True)
    outs = eng.generate(prompt_token_ids, n=8, params=SamplingParams(temperature=1.0), max_new_tokens=256, seed=0)
    ... trainer step ...
    eng.update_weights(policy_model.named_parameters())      # in place; the int4 self-draft is re-quantized

Every rollout follows the *current* target exactly (the verification rules of `verispec.sampling`); what was
derived from older weights — a separate draft model, the rollout history — only changes how fast.

Groups: the n samples of a prompt are admitted together, their shared prompt is prefilled once and its KV rows
copied (`HFRunner.fill`); groups join and leave the running batch continuously, at most `max_batch_size` rows.
Seeds: sample j of prompt i draws from its own stream, seeded by numpy's SeedSequence([seed, i, j]): one
request seed reproduces every sample, alone or in any batch (with a fixed draft length; see the generator).

Logprobs (per completion token, under the target that sampled it):
    logprobs      log of the distribution actually sampled from: log_softmax(logits / temperature) when no
                  truncation or penalty is on — the value a trainer recomputes for its importance ratio
                  (TRL, verl and OpenRLHF compute log_softmax(logits / T) of the policy);
    raw_logprobs  log_softmax(logits) at temperature 1.
With `strict_on_policy` (the default) sampling options that make the sampled distribution differ from
softmax(logits / T) — top-k, top-p, min-p, penalties — and greedy decoding are refused: the trainer's
recomputation could not match them. `strict_on_policy=False` allows them; `logprobs` is then still exactly the
distribution sampled from.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

import numpy as np
from torch import Tensor

from ..drafting import DraftModelProposer, Proposer, TreeSpec
from ..drafting.combined import CombinedProposer
from ..drafting.history import HistoryProposer, RolloutHistory
from ..engine.config import DRAFTERS, UNSET, SpecConfig, config_from_keywords, keyword_items, tree_shape
from ..engine.core import WeightUpdate
from ..engine.generator import SpeculativeGenerator
from ..engine.request import Job, check_limits
from ..engine.rows import Completion
from ..engine.session import GenerationSession
from ..engine.stats import SpecStats
from ..model.loading import LoadedModel, shared_vocab_size
from ..model.weights import load_safetensors_dir
from ..sampling import SamplingParams, check_seed

__all__ = [
    "RL_DEFAULTS",
    "SPEC_KEYWORDS",
    "Rollout",
    "RolloutEngine",
    "WeightUpdate",
    "check_on_policy",
    "check_request",
    "engine_config",
    "sample_seed",
]


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

    prompt_index: int  # position of the prompt in the call
    sample_index: int  # j in 0..n-1 within its group
    prompt_token_ids: list[int]
    completion_token_ids: list[int]  # EOS excluded
    logprobs: list[float]  # log p(x) under the distribution sampled from (see the module docstring)
    raw_logprobs: list[float]  # log_softmax(target logits)(x), temperature 1
    finish_reason: str  # "stop" (EOS or a stop string), "length" or "abort" (`RolloutEngine.abort`)
    stop_reason: str | int | None  # the stop string or EOS id that ended it
    eos_logprob: float | None  # when EOS ended it: the EOS token's logprob (as `logprobs`), else None
    text: str
    seed: int  # this sample's own seed (replays it)
    weight_version: int  # the target's weights it was sampled under
    stats: SpecStats  # this sample's speculation figures

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


def _rollout_config(config: SpecConfig | None, draft, history, keywords: dict) -> SpecConfig:
    """The engine's config from `config` and the keyword arguments given (see RolloutEngine's docstring)."""
    items = keyword_items({k: v for k, v in keywords.items() if k not in _HISTORY_KEYWORDS})
    if "history_tree" in keywords and keywords["history_tree"] is not None:
        tree = keywords["history_tree"]
        if not isinstance(tree, TreeSpec) or tree.rule != "deterministic":
            raise ValueError("history tries are deterministic (one-hot q): give a TreeSpec with rule 'deterministic'")
        items["tree"] = tree_shape(tree)
    items |= {"min_share": keywords["history_min_share"]} if "history_min_share" in keywords else {}
    items |= {"choose_depth": keywords["choose_depth"]} if "choose_depth" in keywords else {}
    kind = _draft_kind(draft, history, config)
    if kind is not None:
        items["draft"] = kind
    drafter = DRAFTERS.get(items.get("draft", config.draft if config is not None else RL_DEFAULTS["draft"]))
    if drafter is not None:
        if drafter.history and items.get("verify") == "token":
            del items["verify"]  # "token", the chains' default, beside history's trees
        if not drafter.history:  # history's keys do nothing without history (as before)
            items = {k: v for k, v in items.items() if k not in ("min_share", "choose_depth")}
            items = {k: v for k, v in items.items() if not (k == "tree" and "history_tree" in keywords)}
        elif not drafter.uses_model:
            items.pop("choose_depth", None)
        if drafter.target_weights and config is None and items.get("quant") is None:
            items["quant"] = "int4"  # the self-draft's default quantization
    return config_from_keywords(config, items, RL_DEFAULTS)


_HISTORY_KEYWORDS = ("history_tree", "history_min_share", "choose_depth")
# RolloutEngine's keyword arguments that spell its SpecConfig (history too, when it is True or False)
SPEC_KEYWORDS = ("draft_quant", "history", *_HISTORY_KEYWORDS, "gamma", "runner", "verify", "coupling", "seeding")


def engine_config(draft: str | None, keywords: dict) -> SpecConfig:
    """The SpecConfig a RolloutEngine builds from its old spelling, with the draft model named by its path: draft
    None, "self" or a draft model's path, and the speculation keywords (SPEC_KEYWORDS) among `keywords` (what a
    `RolloutCluster`'s EngineSpec reads; the rest of `keywords` is ignored here)."""
    given = {k: v for k, v in keywords.items() if k in SPEC_KEYWORDS and k != "history"}
    path = draft if draft not in (None, "self", "ngram", "none") else None
    cfg = _rollout_config(None, "model" if path is not None else draft, keywords.get("history", UNSET), given)
    return replace(cfg, model=path) if path is not None else cfg


def _draft_kind(draft, history, config: SpecConfig | None) -> str | None:
    """The draft key that the draft and history arguments spell; None where they only pass objects to a config."""
    if config is not None and (draft is UNSET or draft is None or isinstance(draft, (LoadedModel, Proposer))):
        if history is not UNSET and (history is not False) != config.drafter.history:
            raise ValueError(f"history={history!r} conflicts with config draft={config.draft}")
        return None
    if history is UNSET:  # history by default, except beside prompt lookup, no drafter or a custom Proposer
        history = config.drafter.history if config is not None else draft not in ("ngram", "none")
        history = history and not isinstance(draft, Proposer)
    wants = history is not False
    if isinstance(draft, Proposer) or draft in ("ngram", "none"):
        if wants:
            what = "a custom Proposer brings its own drafting" if isinstance(draft, Proposer) else f"draft={draft!r}"
            raise ValueError(f"{what} does not draft from history: pass history=False")
        return "custom" if isinstance(draft, Proposer) else draft
    if isinstance(draft, LoadedModel) or draft in ("self", "model"):  # "model": one given by its path (EngineSpec)
        base = "self" if draft == "self" else "model"
        return f"{base}+history" if wants else base
    if draft not in (UNSET, None):
        raise ValueError(f"draft must be None, 'self', 'ngram', 'none', a LoadedModel or a Proposer, got {draft!r}")
    return "history" if wants else "none"


def _prompt_indices(indices: Sequence[int] | None, count: int) -> list[int]:
    if indices is None:
        return list(range(count))
    ok = isinstance(indices, Sequence) and all(isinstance(i, int) and not isinstance(i, bool) for i in indices)
    if not ok or len(indices) != count or len(set(indices)) != count or min(indices) < 0:
        raise ValueError(f"prompt_indices must be {count} distinct integers >= 0, one per prompt, got {indices!r}")
    return [int(i) for i in indices]


def draw_seed() -> int:
    """A fresh request seed (numpy's entropy), for a rollout request that names none."""
    return int(np.random.SeedSequence().generate_state(1, np.uint32)[0])


def check_request(
    prompts, n, params, max_new_tokens, stop, max_batch_size: int, strict_on_policy: bool, seed: int | None = None
) -> None:
    """A rollout request's checks that need no model (a `RolloutCluster` runs them on its driver): ValueError."""
    check_seed(seed)  # the rule of SamplingParams' seed: [0, 2**63)
    if not (
        stop is None or isinstance(stop, str) or (isinstance(stop, Sequence) and all(isinstance(x, str) for x in stop))
    ):
        raise ValueError(f"stop must be None, a string or a list of strings, got {stop!r}")
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= max_batch_size:
        raise ValueError(f"n must be an integer in [1, max_batch_size={max_batch_size}], got {n!r}")
    if not isinstance(params, SamplingParams):
        raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
    if params.seed is not None:
        raise ValueError("pass the request seed as generate(seed=...); each sample derives its own from it")
    if strict_on_policy:
        check_on_policy(params)
    check_limits(max_new_tokens, stop)
    if isinstance(prompts, str) or not isinstance(prompts, Sequence) or not prompts:
        raise ValueError("prompts must be a non-empty list of prompts (token id lists, strings or chat messages)")


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


# RL's own defaults (the rest are SpecConfig's, the generator's): rollouts sample the same prompts again and again,
# so earlier rollouts of a prompt are the drafter (history); a draft model beside them drafts a chain of fixed length
# (gamma 4: CombinedProposer has no gamma auto), and draft chains run to that length (stop_below none: the last
# version's behaviour, kept so that a seed gives the same rollouts as before). random stream (SpecConfig's default is
# auto): every rollout carries a seed, so auto would Gumbel-couple them all — other rollouts than before for a seed,
# a keyed race per row and slot each step, and fewer of a draft model's drafts kept; with gamma fixed a seed already
# gives the same rollouts in any batch (random=gumbel where they must not depend on the history drafted from).
RL_DEFAULTS = {"draft": "history", "gamma": 4, "stop_below": None, "random": "stream"}


class RolloutEngine:
    """Exact speculative rollouts for RL post-training: groups of n samples per prompt, token ids in and out,
    weights replaced in place many times per hour.

    Every sample follows the **current** weights exactly; what was derived from older weights (the history, a
    stale draft model) only changes the speed. The n samples of a prompt join the batch together (the prompt is
    prefilled once); sample j of prompt i draws from its own stream seeded by `SeedSequence([seed, i, j])`.

    ```python
    eng = RolloutEngine(policy, draft="self", history=True)   # int4 self-draft + drafting from earlier rollouts
    outs = eng.generate(prompt_ids, n=8, params=SamplingParams(temperature=1.0), max_new_tokens=256, seed=step)
    eng.update_weights(trainer_model.named_parameters())       # after every optimizer step
    ```

    The drafters (the config's `draft`): history (earlier rollouts of the same prompt and the running siblings of
    each group, `HistoryProposer`; the `tree` key is its trie's shape, `min_share` the least share of matched
    continuations a node needs), a draft model (a `LoadedModel` given as draft; it keeps its weights unless
    `update_draft_weights` is called), the target's own weights quantized (draft=self; re-quantized after every
    weight update), either beside history (model+history, self+history: one tree per step, the trie's branches
    beside the sampled chain, verified with rule "mixed"; `choose_depth` d picks per row the trie alone where it
    is at least d deep), prompt lookup (ngram), none, or a `Proposer` given as draft (custom). random=gumbel makes
    each sample plain decoding's under the same seed, token for token, whatever drafted.

    Args:
        target: The policy model (`load_model`; float32 is the reference precision).
        draft: A draft model (`LoadedModel`) or a `Proposer`, as the config's drafter needs; in the older
            spelling also None (no draft model), "self", "ngram" or "none".
        config: The speculation configuration (default: RL_DEFAULTS over SpecConfig's defaults:
            draft=history, gamma=4, stop_below=none, random=stream).
        draft_quant: Older spelling of `quant` ("int4" for "self" when not given).
        history: Older spelling: True or False for the +history drafters, or a `RolloutHistory` to share (the
            engine makes one otherwise).
        history_tree: Older spelling of `tree`: the history trie's shape (a deterministic TreeSpec).
        history_min_share: Older spelling of `min_share`.
        choose_depth: Older spelling of `choose_depth`.
        gamma: Older spelling of `gamma`.
        max_batch_size: Rows in the running batch.
        runner: Older spelling of `runner`.
        strict_on_policy: Refuse options under which the sampled distribution is not `softmax(logits / T)`
            (top-k, top-p, min-p, penalties, greedy, a constraint), which a trainer cannot recompute from logits.
        verify: Older spelling of `verify`.
        coupling: With `seeding`, the older spelling of `random`.
        seeding: With `coupling`, the older spelling of `random`.

    Raises:
        ValueError: A bad argument, or keyword arguments that disagree with `config` (a `SpecError` names the
            key).
    """

    def __init__(
        self,
        target: LoadedModel,
        draft: LoadedModel | Proposer | str | None = UNSET,
        *,
        config: SpecConfig | None = None,
        draft_quant: str | None = UNSET,
        history: bool | RolloutHistory = UNSET,
        history_tree: TreeSpec | None = UNSET,
        history_min_share: float = UNSET,
        choose_depth: int | None = UNSET,
        gamma: int | str = UNSET,
        max_batch_size: int = 64,
        runner: str = UNSET,
        strict_on_policy: bool = True,
        verify: str = UNSET,
        coupling: str | None = UNSET,
        seeding: str = UNSET,
    ):
        if isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise ValueError(f"max_batch_size must be an integer >= 1, got {max_batch_size!r}")
        if history is not UNSET and history not in (True, False) and not isinstance(history, RolloutHistory):
            raise ValueError(f"history must be True, False or a RolloutHistory, got {history!r}")
        keywords = {"draft_quant": draft_quant, "gamma": gamma, "runner": runner, "verify": verify}
        keywords |= {"coupling": coupling, "seeding": seeding, "history_tree": history_tree}
        keywords |= {"history_min_share": history_min_share, "choose_depth": choose_depth}
        keywords = {k: v for k, v in keywords.items() if v is not UNSET}
        self.config = cfg = _rollout_config(config, draft, history, keywords)
        shared = history if isinstance(history, RolloutHistory) else None
        self.history = (shared if shared is not None else RolloutHistory()) if cfg.drafter.history else None
        self.gen = SpeculativeGenerator(target, self._proposer(target, draft, cfg), config=cfg)
        self._init_state(target, draft if draft is not UNSET else None, max_batch_size, strict_on_policy)

    @classmethod
    def from_generator(
        cls, gen: SpeculativeGenerator, *, max_batch_size: int = 64, strict_on_policy: bool = True
    ) -> RolloutEngine:
        """Rollouts over an existing generator, its config and its drafter (no history of its own).

        This is what `verispec serve` runs its RL routes on, sharing the model with its OpenAI routes. Weight
        updates go to gen's target.

        Args:
            gen: The generator to run on.
            max_batch_size: Rows in the running batch.
            strict_on_policy: As in the constructor.

        Returns:
            The engine.

        Raises:
            ValueError: max_batch_size is not an integer >= 1.
        """
        if isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise ValueError(f"max_batch_size must be an integer >= 1, got {max_batch_size!r}")
        eng = cls.__new__(cls)
        eng.history, eng.gen, eng.config = None, gen, gen.config
        eng._init_state(gen.target, None, max_batch_size, strict_on_policy)
        return eng

    def _init_state(self, target, draft, max_batch_size: int, strict_on_policy: bool) -> None:
        self.target = target
        self.draft = draft
        self.max_batch_size = max_batch_size
        self.strict_on_policy = strict_on_policy
        self.last_stats = SpecStats()
        self._lock = threading.Lock()  # generate and weight updates never overlap
        self._aborting = threading.Event()

    def _proposer(self, target: LoadedModel, draft, config: SpecConfig):
        """What the generator drafts with: the history drafters built here (they read this engine's history), else
        the draft model or Proposer given (the generator builds the rest from the config)."""
        kind = config.drafter
        if not kind.history:
            return draft if isinstance(draft, (LoadedModel, Proposer)) else None
        history = HistoryProposer(self.history, tree=config.tree_spec, min_share=config.min_share)
        if not kind.uses_model:
            return history
        model = target if kind.target_weights else draft
        if not isinstance(model, LoadedModel):
            raise ValueError(f"draft={config.draft} drafts with a draft model: pass it as draft, a LoadedModel")
        if getattr(model, "described", None):  # a hidden-state head (verispec.heads.LoadedHead)
            raise ValueError(f"{model.described} drafts alone (draft=model): draft={config.draft} cannot use it")
        vocab = shared_vocab_size(target, model)
        sampler = DraftModelProposer(model.model, vocab, config.stop_below, runner=config.runner, quant=config.quant)
        return CombinedProposer(history, sampler, config.gamma, choose_depth=config.choose_depth)

    @property
    def weight_version(self) -> int:
        """The target's weight version: it counts updates, and every Rollout reports the one it was drawn under."""
        return self.gen.core.weight_version

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
        tokens they have and finish_reason "abort"; so does setting `cancel`.

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
        """
        job, seed = self.job(prompts, n, params, **options)
        with self._lock:
            self._aborting.clear()
            return self._run(job, seed, cancel if cancel is not None else threading.Event())

    def job(
        self,
        prompts,
        n: int = 1,
        params: SamplingParams = SamplingParams(),
        *,
        max_new_tokens: int = 256,
        seed: int | None = None,
        stop: str | Sequence[str] | None = (),
        chat: bool = False,
        ignore_eos: bool = False,
        prompt_indices: Sequence[int] | None = None,
        key: object = None,
    ) -> tuple[Job, int]:
        """The engine job of a rollout request (every check done, nothing run) and its request seed: sample j of
        prompt i is request (i, j) with seed `sample_seed(seed, i, j)`, the n samples of a prompt one group (they
        join the batch together: the prompt is prefilled once). `generate` runs it; the server queues it."""
        check_request(prompts, n, params, max_new_tokens, stop, self.max_batch_size, self.strict_on_policy, seed)
        core = self.gen.core
        ids = [core.encode(p, chat) for p in prompts]  # all validated before any compute
        indices = _prompt_indices(prompt_indices, len(ids))
        if seed is None:
            seed = draw_seed()
        requests = [
            core.request(
                prompt,
                replace(params, seed=sample_seed(seed, i, j)),
                max_new_tokens=max_new_tokens,
                stop=stop,
                ignore_eos=ignore_eos,
                key=(i, j),
                index=k * n + j,
            )
            for k, (i, prompt) in enumerate(zip(indices, ids))
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
        return [done[k] for k in sorted(done)]

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
        untouched.

        Args:
            named_tensors: (name, tensor) pairs, names as in the model's state_dict (e.g. a trainer's
                `model.named_parameters()`); a subset of the weights is fine.

        Returns:
            The new weight version, the tensors written and the time taken.

        Raises:
            WeightUpdateError: The update was refused; the message lists every problem.
        """
        return self._update(self.target.model, named_tensors)

    def update_weights_from_path(self, path) -> WeightUpdate:
        """`update_weights` from a checkpoint on disk.

        Args:
            path (str | os.PathLike): A directory of *.safetensors files (a save_pretrained checkpoint) or one file.

        Returns:
            The new weight version, the tensors written and the time taken.

        Raises:
            WeightUpdateError: The update was refused; the message lists every problem.
        """
        return self._update(self.target.model, load_safetensors_dir(path))

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
        return self._update(self.draft.model, named_tensors, bump=False)

    def _update(self, model, named_tensors, bump: bool = True) -> WeightUpdate:
        with self._lock:  # between generate calls: every rollout is drawn under one weight version
            return self.gen.core.update_weights(named_tensors, model=None if bump else model)
