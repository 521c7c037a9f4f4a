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
from ..engine.core import WeightUpdate
from ..engine.generator import SpeculativeGenerator
from ..engine.request import Job, check_limits
from ..engine.rows import Completion
from ..engine.session import GenerationSession
from ..engine.stats import SpecStats
from ..model.loading import LoadedModel, shared_vocab_size
from ..model.weights import load_safetensors_dir
from ..sampling import SamplingParams

__all__ = ["Rollout", "RolloutEngine", "WeightUpdate", "check_on_policy", "check_request", "sample_seed"]


@dataclass(frozen=True)
class Rollout:
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
        """The completion's token ids and logprobs with the EOS token that ended it, if one did (what a trainer
        scores, as vLLM's token_ids: the policy must learn to stop)."""
        if self.eos_logprob is None or not isinstance(self.stop_reason, int):
            return list(self.completion_token_ids), list(self.logprobs)
        return [*self.completion_token_ids, self.stop_reason], [*self.logprobs, self.eos_logprob]


def sample_seed(seed: int, prompt_index: int, sample_index: int) -> int:
    """The seed of sample j of prompt i under one request seed (numpy's SeedSequence mixing)."""
    state = np.random.SeedSequence([seed, prompt_index, sample_index]).generate_state(2, np.uint32)
    return (int(state[0]) << 31) ^ int(state[1])  # < 2**63


def _prompt_indices(indices: Sequence[int] | None, count: int) -> list[int]:
    if indices is None:
        return list(range(count))
    ok = isinstance(indices, Sequence) and all(isinstance(i, int) and not isinstance(i, bool) for i in indices)
    if not ok or len(indices) != count or len(set(indices)) != count or min(indices) < 0:
        raise ValueError(f"prompt_indices must be {count} distinct integers >= 0, one per prompt, got {indices!r}")
    return [int(i) for i in indices]


def check_request(prompts, n, params, max_new_tokens, stop, max_batch_size: int, strict_on_policy: bool) -> None:
    """A rollout request's checks that need no model (a `RolloutCluster` runs them on its driver): ValueError."""
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


class RolloutEngine:
    """Rollouts over a target and optional drafters.

    draft: None (no draft model), "self" (the target's own weights quantized with draft_quant, default "int4";
    re-quantized after every weight update) or a `LoadedModel` (a separate draft; it keeps its weights unless
    `update_draft_weights` is called) or any `Proposer`. history: draft from earlier rollouts of the same prompt
    and from the running siblings of each group (`HistoryProposer`; True, a `RolloutHistory` to share, or
    False). A draft model and history together draft one tree per step: the history's trie branches beside the
    draft model's sampled chain (`CombinedProposer`, verified with rule "mixed"). gamma: the draft model's chain
    length ("auto" without history). history_tree / history_min_share: the history trie's shape and the least
    share of matched continuations a node needs (`HistoryProposer`). choose_depth (draft model + history): None
    drafts both in one tree every step; d picks per row the history trie alone where it is at least d deep, else
    the chain alone (`CombinedProposer`). max_batch_size: rows in the running batch. verify: "token" or "block"
    verification of a draft model's chains (block needs history=False: history drafts trees). coupling: None or
    "gumbel" — each sample is then plain decoding's under the same seed, token for token, whatever drafted
    (`SpeculativeGenerator`), for rollouts that must match a non-speculative reference bit for bit. seeding:
    "position" makes a seeded sample independent of gamma and batch, with no loss of acceptance (a draft model, no
    history).
    runner: see `make_runner`.
    """

    def __init__(
        self,
        target: LoadedModel,
        draft: LoadedModel | Proposer | str | None = None,
        *,
        draft_quant: str | None = None,
        history: bool | RolloutHistory = True,
        history_tree: TreeSpec | None = None,
        history_min_share: float = 0.0,
        choose_depth: int | None = None,
        gamma: int | str = 4,
        max_batch_size: int = 64,
        runner: str = "auto",
        strict_on_policy: bool = True,
        verify: str = "token",
        coupling: str | None = None,
        seeding: str = "stream",
    ):
        if isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise ValueError(f"max_batch_size must be an integer >= 1, got {max_batch_size!r}")
        if draft == "self" and draft_quant is None:
            draft_quant = "int4"
        self.history = history if isinstance(history, RolloutHistory) else RolloutHistory() if history is True else None
        if history not in (True, False) and not isinstance(history, RolloutHistory):
            raise ValueError(f"history must be True, False or a RolloutHistory, got {history!r}")
        history_args = dict(tree=history_tree, min_share=history_min_share)
        self._choose_depth = choose_depth
        proposer = self._proposer(target, draft, draft_quant, history_args, runner, gamma)
        if verify != "token" and proposer is not None and proposer.tree is not None:
            raise ValueError(
                f"verify={verify!r} verifies chains, and history drafts trees: pass history=False to use it"
            )
        self.gen = SpeculativeGenerator(
            target,
            proposer,
            gamma=gamma if proposer is not None else 0,
            runner=runner,
            max_gamma=max(8, gamma) if isinstance(gamma, int) else 8,
            verify=verify,
            coupling=coupling,
            seeding=seeding,
        )
        self._init_state(target, draft, max_batch_size, strict_on_policy)

    @classmethod
    def from_generator(
        cls, gen: SpeculativeGenerator, *, max_batch_size: int = 64, strict_on_policy: bool = True
    ) -> RolloutEngine:
        """Rollouts over an existing generator and its drafter (no history of its own): what `verispec serve`
        runs its RL routes on, sharing the model with its OpenAI routes. Weight updates go to gen's target."""
        if isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise ValueError(f"max_batch_size must be an integer >= 1, got {max_batch_size!r}")
        eng = cls.__new__(cls)
        eng.history, eng._choose_depth, eng.gen = None, None, gen
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

    def _proposer(self, target, draft, quant, history_args, runner, gamma) -> Proposer | None:
        if isinstance(draft, Proposer):
            if quant is not None or self.history is not None:
                raise ValueError("a custom Proposer brings its own drafting: pass draft_quant=None, history=False")
            return draft
        model = target if draft == "self" else draft if isinstance(draft, LoadedModel) else None
        if draft not in (None, "self") and model is None:
            raise ValueError(f"draft must be None, 'self', a LoadedModel or a Proposer, got {draft!r}")
        if quant is not None and model is None:
            raise ValueError("draft_quant needs draft='self' or a draft model")
        history = HistoryProposer(self.history, **history_args) if self.history is not None else None
        if model is None:
            return history
        sampler = DraftModelProposer(model.model, shared_vocab_size(target, model), None, runner=runner, quant=quant)
        if history is None:
            return sampler
        if not isinstance(gamma, int) or isinstance(gamma, bool):
            raise ValueError(
                f"a draft model with history drafts a chain of fixed length: gamma must be an integer, got {gamma!r}"
            )
        return CombinedProposer(history, sampler, gamma, choose_depth=self._choose_depth)

    @property
    def weight_version(self) -> int:
        """The target's weight version (the generator's core counts it; every Rollout reports the one it was drawn
        under)."""
        return self.gen.core.weight_version

    # --- rollouts -------------------------------------------------------------------------------------
    def generate(
        self,
        prompts: Sequence[Sequence[int]] | Sequence[str] | Sequence[Sequence[dict]],
        n: int = 1,
        params: SamplingParams = SamplingParams(),
        *,
        max_new_tokens: int = 256,
        seed: int | None = None,
        stop: str | Sequence[str] | None = (),
        chat: bool = False,
        ignore_eos: bool = False,
        prompt_indices: Sequence[int] | None = None,
        cancel: threading.Event | None = None,
    ) -> list[Rollout]:
        """n samples of every prompt (token ids; text or chat messages are templated when chat=True), in prompt
        order then sample order. seed: the request seed every sample's own seed derives from (None: drawn).
        prompt_indices: each prompt's index i in `SeedSequence([seed, i, j])` and `Rollout.prompt_index` (default
        0, 1, ...): a shard of a larger batch run elsewhere passes its prompts' global indices and gets the same
        samples as the whole batch run here. `abort()` from another thread ends the call after the current step:
        unfinished samples come back with the tokens they have and finish_reason "abort"; so does setting `cancel`
        (this call's own event: set it before or during the call)."""
        job, seed = self.job(
            prompts,
            n,
            params,
            max_new_tokens=max_new_tokens,
            seed=seed,
            stop=stop,
            chat=chat,
            ignore_eos=ignore_eos,
            prompt_indices=prompt_indices,
        )
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
        check_request(prompts, n, params, max_new_tokens, stop, self.max_batch_size, self.strict_on_policy)
        core = self.gen.core
        ids = [core.encode(p, chat) for p in prompts]  # all validated before any compute
        indices = _prompt_indices(prompt_indices, len(ids))
        if seed is None:
            seed = int(np.random.SeedSequence().generate_state(1, np.uint32)[0])
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
        """End a running `generate` after its current step (from another thread); no-op when none runs."""
        self._aborting.set()

    def _run(self, job: Job, seed: int, cancel: threading.Event) -> list[Rollout]:
        sess = GenerationSession(self.gen.core, self.max_batch_size)
        sess.submit(job)
        done: dict[tuple[int, int], Rollout] = {}
        t0 = time.perf_counter()
        while not sess.idle:
            if self._aborting.is_set() or cancel.is_set():
                for event in sess.abort(job.key):
                    done[event.key] = self.rollout(event.completion, seed, record=False)
                break
            for event in sess.step():
                if event.completion is not None:
                    done[event.key] = self.rollout(event.completion, seed)
        self.last_stats = sess.stats
        self.last_stats.wall_time = time.perf_counter() - t0
        return [done[k] for k in sorted(done)]

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
        """Replace target weights in place (names as in the model's state_dict; every name, shape, dtype and value
        is checked before anything is written). Waits for a running generate to finish. Drafts derived from the
        target (a quantized self-draft) are rebuilt from the new weights; a separate draft model is untouched."""
        return self._update(self.target.model, named_tensors)

    def update_weights_from_path(self, path) -> WeightUpdate:
        """update_weights from a directory of *.safetensors files (a save_pretrained checkpoint) or one file."""
        return self._update(self.target.model, load_safetensors_dir(path))

    def update_draft_weights(self, named_tensors: Iterable[tuple[str, Tensor]]) -> WeightUpdate:
        """Replace a separate draft model's weights the same way (the weight version does not change)."""
        if not isinstance(self.draft, LoadedModel):
            raise ValueError("update_draft_weights needs a separate draft model (draft=LoadedModel)")
        return self._update(self.draft.model, named_tensors, bump=False)

    def _update(self, model, named_tensors, bump: bool = True) -> WeightUpdate:
        with self._lock:  # between generate calls: every rollout is drawn under one weight version
            return self.gen.core.update_weights(named_tensors, model=None if bump else model)
