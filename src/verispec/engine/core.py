"""`EngineCore`: what a generation session runs on — the target's runner, the drafter, the gamma controller, the
verification functions and randomness, the vocabulary, limits and device — and the one place where inputs become
checked `Request`s (`encode`, `request`) and where the target's weights change (`update_weights`, which counts the
weight version every completion reports)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..model.protocol import Runner
from ..model.weights import update_weights
from ..sampling import ConstraintError, SamplingParams
from ..sampling.randomness import RANDOMNESS, Randomness
from ..structured import Grammars, GrammarState
from .adaptive import GammaController, check_gamma
from .observe import StepObserver
from .request import Request
from .verify import PositionalVerification, Verification

__all__ = ["PREFILL_CHUNK", "EngineCore", "WeightUpdate", "check_prefill_chunk"]

# Chunked prefill (`GenerationSession`): while rows run, a longer prompt is prefilled at most this many tokens per
# step. Measured on the default model (SmolLM2-135M, fast runner, fp32, 2 threads of this AVX2 CPU, min of 3): one
# chunk at context 0 / 1536 / 2560 takes 124 / 189 / 224 ms (64 tokens), 204 / 342 / 415 ms (128), 369 / 567 / 709
# ms (256), 749 / 1160 / 1486 ms (512), against a decode step of 43-57 ms (1 token) or 57-78 ms (5). 128 bounds the
# running rows' extra wait per step to ~4-8 decode steps and keeps ~90% of the prefill throughput of 256 or 512 (64:
# 3-4 steps, ~75%). A running stream's longest gap while a 3,000-token prompt arrives: 6.8 s unchunked, 0.51 s.
PREFILL_CHUNK = 128


def check_prefill_chunk(value: int) -> int:
    """A prefill chunk: an integer >= 0 (0: chunked prefill off)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"prefill_chunk must be an integer >= 0 (0: off), got {value!r}")
    return value


@dataclass(frozen=True)
class WeightUpdate:
    """What one weight update did.

    Attributes:
        version: The new weight version.
        tensors: Tensors written.
        seconds: Validation plus the in-place copy.
        requantize_seconds: Rebuilding quantized drafts from the new weights (0 when there are none).
    """

    version: int  # the new weight version
    tensors: int  # tensors written
    seconds: float  # validation + in-place copy
    requantize_seconds: float  # rebuilding quantized drafts from the new weights (0 when none)


@dataclass(eq=False)
class EngineCore:
    """The parts a `GenerationSession` runs (built by `SpeculativeGenerator`; one core may back several sessions,
    one at a time). `weight_version` counts the target's weight updates through `update_weights`."""

    runner: Runner  # the target's
    proposer: object | None  # a drafting.Proposer, or None (plain decoding through the same loop)
    controller: GammaController
    tokenizer: object
    model: object  # the target model whose weights `update_weights` replaces
    vocab_size: int  # ids target and draft share
    eos_ids: set[int]
    verification: Verification | None = None  # the step's strategy (None: token-wise chains, verify_tree)
    observers: tuple[StepObserver, ...] = ()  # hooks into every step (`engine.observe`)
    random: str = "auto"  # SpecConfig's random: auto, stream, position or gumbel (sampling.randomness)
    jump: int = 16  # SpecConfig's jump: the most grammar-forced tokens appended to a chain per step (0: off)
    prefill_chunk: int = PREFILL_CHUNK  # sessions' default: prompt tokens prefilled per step while rows run (0: off)
    weight_version: int = 0
    keep_top: int = field(init=False)  # the target's top K kept at emitted tokens (the observers' `keep_top`)
    device: torch.device = field(init=False)
    max_positions: int | None = field(init=False)
    randomness: Randomness = field(init=False)  # how drafter and verifier draw (from `random`)
    _grammars: Grammars | None = field(default=None, init=False, repr=False)  # built on the first constraint
    _grammars_lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    def __post_init__(self):
        self.device = self.runner.device
        self.max_positions = self.runner.max_positions
        if self.random not in RANDOMNESS:
            raise ValueError(f"random must be one of {', '.join(RANDOMNESS)}, got {self.random!r}")
        self.randomness = RANDOMNESS[self.random]
        check_prefill_chunk(self.prefill_chunk)
        if self.random == "position" and self.verification is not None:
            raise ValueError("random=position verifies token-wise by position: a verification override replaces that")
        if self.random == "position":
            self.verification = PositionalVerification()
        elif self.verification is None:
            self.verification = Verification()
        self.observers = tuple(self.observers)
        self.keep_top = max((int(getattr(o, "keep_top", 0)) for o in self.observers), default=0)

    @property
    def tree(self):
        """The drafter's token-tree shape (a TreeSpec), None for chains."""
        return getattr(self.proposer, "tree", None)

    def encode(self, prompt: str | Sequence[int] | Sequence[dict], chat: bool = False) -> list[int]:
        """A prompt as token ids: text (with the chat template when chat=True), chat messages
        ([{"role": ..., "content": ...}, ...], always templated) or token ids (checked against the vocabulary)."""
        if isinstance(prompt, str):
            if prompt == "":
                raise ValueError("prompt is empty")
            if not chat:
                return list(self.tokenizer(prompt, add_special_tokens=True)["input_ids"])
            return self._apply_chat_template([{"role": "user", "content": prompt}])
        if not isinstance(prompt, Sequence) or not len(prompt):
            raise ValueError(
                f"a prompt must be a non-empty string, list of token ids or list of chat messages, got {prompt!r}"
            )
        if all(isinstance(m, dict) for m in prompt):
            return self._apply_chat_template(list(prompt))
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise ValueError(f"token ids must be integers, got {[t for t in prompt if not isinstance(t, int)][:3]}")
        if any(not 0 <= t < self.vocab_size for t in prompt):
            raise ValueError(f"prompt token ids must lie in [0, {self.vocab_size})")
        return [int(t) for t in prompt]

    def _apply_chat_template(self, messages: list[dict]) -> list[int]:
        for i, m in enumerate(messages):
            if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ValueError(f"chat message {i} must have a string 'role' and a string 'content', got {m!r}")
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise ValueError("chat=True but the tokenizer has no chat template")
        enc = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if hasattr(enc, "keys"):
            enc = enc["input_ids"]
        return [int(t) for t in enc]

    def request(
        self,
        prompt,
        params: SamplingParams = SamplingParams(),
        *,
        max_new_tokens: int = 128,
        stop: str | Sequence[str] | None = (),
        stop_token_ids: Iterable[int] = (),
        chat: bool = False,
        ignore_eos: bool = False,
        gamma: int | None = None,
        top_logprobs: int = 0,
        key: object = None,
        index: int = 0,
    ) -> Request:
        """A checked request: the prompt encoded (`encode`), every option validated against this model (ValueError
        naming it). gamma: this request's draft length (0: off; capped at the controller's max_gamma)."""
        ids = self.encode(prompt, chat)
        req = Request(
            tuple(ids),
            params,
            max_new_tokens=max_new_tokens,
            stop=() if stop is None else (stop,) if isinstance(stop, str) else stop,
            stop_token_ids=frozenset(self._token_ids(stop_token_ids, "stop_token_ids")),
            ignore_eos=bool(ignore_eos),
            gamma=None if gamma is None else min(check_gamma(gamma, "gamma"), self.controller.max_gamma),
            top_logprobs=top_logprobs,
            key=key if key is not None else object(),
            index=index,
        )
        self.check(req)
        return req

    def check(self, req: Request) -> None:
        """What a Request cannot check alone: its ids against the vocabulary, its prompt against the context; a
        request that passes is marked checked by this core (`Request.checked`: a session does not check it again)."""
        req.params.check_vocab(self.vocab_size)  # token options' ids: refused here, not when the batch is built
        self._token_ids(req.prompt_token_ids, "prompt token ids")
        self._token_ids(req.stop_token_ids, "stop_token_ids")
        c = req.params.constraint  # compiled here: ConstraintError (a ValueError) naming the problem
        if c is not None and self.grammars.state(c, req.stop_token_ids).stuck:
            raise ConstraintError(
                f"the {c.describe()} constraint cannot be met: no token of this model's vocabulary can start its output"
            )
        if self.max_positions is not None and len(req.prompt_token_ids) >= self.max_positions:
            raise ValueError(
                f"prompt {req.index} has {len(req.prompt_token_ids)} tokens; the model's context is {self.max_positions}"
            )
        object.__setattr__(req, "checked", self)

    def _token_ids(self, ids: Iterable[int], name: str) -> list[int]:
        ids = list(ids)
        if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size for t in ids):
            raise ValueError(f"{name} must be integers in [0, {self.vocab_size})")
        return ids

    @property
    def grammars(self) -> Grammars:
        """Constraints compiled for this tokenizer (built on first use: the tokenizer's vocabulary is read once)."""
        with self._grammars_lock:  # the server's worker threads and the engine's may ask at once: build it once
            if self._grammars is None:
                self._grammars = Grammars(self.tokenizer, self.vocab_size, self.eos_ids)
            return self._grammars

    def grammar_state(self, req: Request) -> GrammarState | None:
        """A request's grammar matcher at the start of its output (None: no constraint)."""
        c = req.params.constraint
        state = None if c is None else self.grammars.state(c, req.stop_token_ids)
        for o in self.observers:
            state = o.grammar(req, state)
        return state

    def release(self) -> None:
        """Free what the runner and the drafter hold for a batch (their KV caches) while none runs: the next batch
        allocates them again (`RolloutEngine.sleep`). Weights, and what drafting learned, stay."""
        release = getattr(self.runner, "release", None)  # llama.cpp's context keeps its cells
        if release is not None:
            release()
        if self.proposer is not None:
            self.proposer.release()

    def update_weights(self, named_tensors: Iterable[tuple[str, Tensor]], model=None) -> WeightUpdate:
        """Replace weights in place (every name, shape, dtype and value checked before anything is written: a bad
        update changes nothing). model: the target (default; the weight version counts it) or a separate draft
        model (the version stays). Drafts derived from the changed model (a quantized self-draft) are rebuilt.
        Run it only between jobs (`GenerationSession.barrier`), never while a job is unfinished."""
        target = model is None or model is self.model
        model = self.model if model is None else model
        t0 = time.perf_counter()
        written = update_weights(model, named_tensors)
        seconds = time.perf_counter() - t0
        if target:  # the weights have changed: count it before rebuilding drafts (which may fail)
            self.weight_version += 1
        requant = self.proposer.weights_changed(model) if self.proposer is not None else 0.0
        return WeightUpdate(self.weight_version, written, seconds, requant)
