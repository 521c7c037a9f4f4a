"""The generator facade: `SpeculativeGenerator` builds one `EngineCore` from a `SpecConfig` and runs
`GenerationSession`s on it (generate, stream, calibrate, continuous batching). What the tokens, seeds and logprobs
mean (and when seeded tokens are bit-for-bit equal): docs/guides/generating.md, docs/concepts/randomness.md.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence

from ..drafting import DraftModelProposer, Proposer
from ..heads import LoadedHead
from ..model.loading import LoadedModel
from ..sampling import CHAIN_RULES, SamplingParams
from .adaptive import GammaController, measure_cost_curve
from .config import SpecConfig
from .core import EngineCore
from .costs import prior_slope
from .drafters import build_proposer, describe_drafter
from .observe import StepObserver
from .request import Job, check_limits
from .rows import Completion, StreamEvent
from .session import GenerationSession
from .stats import SpecStats
from .verify import Verification

__all__ = ["Completion", "GenerationSession", "SpeculativeGenerator", "StreamEvent"]


class SpeculativeGenerator:
    """Speculative decoding with a target model and a drafter, as a `SpecConfig` says (a front over one
    `EngineCore`). Every emitted token follows the target's distribution exactly, whatever the config: it only moves
    speed (and, through `random`, what a seeded request's tokens depend on).

    ```python
    gen = SpeculativeGenerator(target, draft, config=SpecConfig.parse("draft=model,gamma=auto"))
    outs = gen.generate(["def fib(n):", "Hello"], SamplingParams(temperature=0.7, seed=1), max_new_tokens=64)
    for event in gen.stream("Tell me a story", SamplingParams(seed=2), chat=True):
        print(event.delta, end="", flush=True)
    ```

    Under random=position the stats count the drafts fed to the target (the last draft of a step shows in tau, not
    in `accepted`), and gamma auto prices a step's drafts without that last one.

    Args:
        target: The target model (`load_model`).
        draft: What the config's drafter drafts with: a `LoadedModel` or a hidden-state head (`load_head`,
            `engine.drafters.load_draft`) for draft=model (None: the config's `model=` path is loaded), a `Proposer`
            for draft=custom, else None (draft=mtp reads the MTP layer from the target's own checkpoint).
        config: The speculation configuration (default: `SpecConfig()`, prompt lookup with gamma auto).
        history (RolloutHistory | None): The earlier rollouts the history drafters read (a `RolloutEngine`'s).
        verification (Verification | None): A verification strategy (`engine.verify.Verification`) instead of the
            config's rule (the certifier's broken rules, the lossy study); under random=auto a seeded request is
            still coupled.
        observers (Sequence[StepObserver]): Hooks into every step (`engine.observe`): benchmarks' probes, the
            certifier's mutants.

    Raises:
        SpecError: The configuration is invalid (it names the key at fault).
        ValueError: `draft` does not fit the config's drafter, or a verification override does not fit the config.
        ModelLoadError: The draft and target vocabularies cannot be shared.
    """

    def __init__(
        self,
        target: LoadedModel,
        draft: LoadedModel | LoadedHead | Proposer | None = None,
        *,
        config: SpecConfig | None = None,
        history=None,
        verification: Verification | None = None,
        observers: Sequence[StepObserver] = (),
    ):
        if config is not None and not isinstance(config, SpecConfig):
            raise ValueError(f"config must be a SpecConfig (SpecConfig.parse reads its string form), got {config!r}")
        self.config = cfg = config or SpecConfig()
        self.target = target
        if verification is not None and (cfg.chain_rule != "token" or cfg.random == "position"):
            raise ValueError(f"a verification override replaces verify={cfg.chain_rule} and random={cfg.random}")
        built = build_proposer(cfg, target, draft, history=history)
        tree = built.proposer.tree if built.proposer is not None else None
        if tree is not None and cfg.chain_rule != "token":
            raise ValueError(
                f"verify={cfg.chain_rule!r} verifies chains, and the {type(built.proposer).__name__} drafts trees "
                "(verified by their own rule)"
            )
        if cfg.random == "position":
            _check_position_seeding(built.proposer)
        elif verification is None:
            verification = Verification(CHAIN_RULES[cfg.chain_rule])
        self.core = EngineCore(
            runner=built.runner,
            proposer=built.proposer,
            controller=_controller(built, cfg),
            tokenizer=target.tokenizer,
            model=target.model,
            vocab_size=built.vocab_size,
            eos_ids=_eos_ids(target.tokenizer, target.model),
            verification=verification,
            observers=(*built.observers, *observers),
            random=cfg.random,
            jump=cfg.jump,
        )
        self.learner = built.learner  # draft=online: the head being trained (`heads.online.OnlineLearner`)
        self.stats = SpecStats()  # pooled over every call
        self.last_stats = SpecStats()  # the last generate / stream call's

    @property
    def drafter(self) -> str:
        """The drafter in use, described (`engine.drafters.describe_drafter`): "prompt lookup", "EAGLE-3 head",
        "draft model (cross-vocabulary bridge)", "int4 self-draft", "none", ..."""
        return describe_drafter(self.core.proposer, self.target.model)

    @property
    def tokenizer(self):
        """The target's tokenizer."""
        return self.core.tokenizer

    def encode(self, prompt: str | Sequence[int] | Sequence[dict], chat: bool = False) -> list[int]:
        """A prompt as token ids.

        Args:
            prompt: Text, chat messages (a list of `{"role", "content"}` dicts) or token ids (returned as they are).
            chat: Apply the tokenizer's chat template to a text prompt.

        Returns:
            The prompt's token ids (`EngineCore.encode`).
        """
        return self.core.encode(prompt, chat)

    @property
    def weight_version(self) -> int:
        """The target's weight version (counted by `EngineCore.update_weights`)."""
        return self.core.weight_version

    def generate(
        self, prompts, params: SamplingParams | Sequence[SamplingParams] = SamplingParams(), **options
    ) -> list[Completion]:
        """Generate for one prompt or a list of them, and return when every request has finished.

        Args:
            prompts (str | list): One prompt (text, token ids or chat messages) or a list of them.
            params: One SamplingParams for every prompt, or one per prompt.
            **options (Any): `stream`'s keyword arguments: max_new_tokens (128), stop, chat, ignore_eos.

        Returns:
            One Completion per prompt, in prompt order.

        Raises:
            ValueError: A prompt, a parameter or an option is invalid (checked before any step runs).
        """
        done = [event.completion for event in self.stream(prompts, params, **options) if event.completion is not None]
        return sorted(done, key=lambda c: c.index)

    def stream(
        self,
        prompts,
        params: SamplingParams | Sequence[SamplingParams] = SamplingParams(),
        *,
        max_new_tokens: int = 128,
        stop: str | Sequence[str] | None = (),
        chat: bool = False,
        ignore_eos: bool = False,
    ) -> Iterator[StreamEvent]:
        """Generate for one prompt or a list of them, yielding text deltas per request as steps are accepted.

        Args:
            prompts (str | list): One prompt (text, token ids or chat messages) or a list of them.
            params: One SamplingParams for every prompt, or one per prompt.
            max_new_tokens: Each request's budget of new tokens.
            stop: Stop strings (one string, or a list): the text ends before the first one.
            chat: Apply the tokenizer's chat template to text prompts.
            ignore_eos: Generate past EOS.

        Returns:
            An iterator of StreamEvents; a request's last event carries its Completion.

        Raises:
            ValueError: A prompt, a parameter or an option is invalid (checked before any step runs).
        """
        max_new_tokens, stop = check_limits(max_new_tokens, stop)
        prompts = _prompt_list(prompts)
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        ok = isinstance(params, Sequence) and len(params) == len(prompts)
        if not ok or not all(isinstance(p, SamplingParams) for p in params):
            raise ValueError("params must be one SamplingParams, or one per prompt")
        requests = [  # every prompt is validated before any step
            self.core.request(
                p, sp, max_new_tokens=max_new_tokens, stop=stop, chat=chat, ignore_eos=ignore_eos, index=i
            )
            for i, (p, sp) in enumerate(zip(prompts, params))
        ]
        sess = GenerationSession(self.core)
        sess.submit(Job(requests))
        return self._drive(sess)

    def calibrate(self, batches: Sequence[int] = (1, 2, 4, 8), context: int = 64, repeats: int = 3) -> dict:
        """Measure the target's cost curve and the draft's step cost at each batch size, for gamma "auto" to use
        from the first step on (lossless either way: only speed moves).

        Args:
            batches: The batch sizes B to measure.
            context: Tokens of context each measured row holds.
            repeats: Timings per point (their median is kept).

        Returns:
            `{B: {"curve": [T_B(1), ..., T_B(max_gamma + 1)], "draft_step": seconds or None}}`.

        Raises:
            ValueError: `batches` is not a non-empty list of integers >= 1.
        """
        ints = not isinstance(batches, int) and batches and all(isinstance(b, int) for b in batches)
        if not ints or any(isinstance(b, bool) or b < 1 for b in batches):
            raise ValueError(f"batches must be a non-empty list of integers >= 1, got {batches!r}")
        drafters = draft_runners(self.core.proposer)  # source -> a draft model's runner (n-gram drafting: none)
        out = {}
        for b in sorted(set(batches)):
            curve = measure_cost_curve(
                self.core.runner, self.core.vocab_size, self.core.controller.max_gamma + 1, b, context, repeats
            )
            steps = {s: measure_cost_curve(r, self.core.vocab_size, 1, b, context, repeats)[0] for s, r in drafters}
            self.core.controller.seed_costs(b, curve, None)
            for source, step in steps.items():
                self.core.controller.seed_costs(b, [], step, source)
            out[b] = {"curve": curve, "draft_step": next(iter(steps.values()), None)}
        return out

    def session(self, max_batch: int | None = None) -> GenerationSession:
        """A continuous-batching session: jobs join (`submit`, `add`) and leave (finish, `abort`) between steps.

        Args:
            max_batch: The most rows decoded together (None: no limit).

        Returns:
            A GenerationSession over this generator's engine core.
        """
        return GenerationSession(self.core, max_batch)

    def _drive(self, sess: GenerationSession) -> Iterator[StreamEvent]:
        """The session's steps' events, then the call's stats (`last_stats`, merged into `stats`): its counts and
        times (wall = prefill + draft + verify + other; for one request, that request's)."""
        pooled = sess.stats  # the steps add draft_time and verify_time (`speculative_step`)
        t_start = time.perf_counter()
        try:
            while not sess.idle:
                t0 = time.perf_counter()
                sess.schedule()  # (`sess.step()`: schedule, then run) admission: prompts prefilled
                pooled.prefill_time += time.perf_counter() - t0
                for event in sess.run():
                    if event.completion is not None and event.completion.error is not None:
                        raise event.completion.error  # a RowFault: this request failed inside a step
                    if event.token_ids and not pooled.first_token_time:
                        pooled.first_token_time = time.perf_counter() - t_start
                    yield event
        finally:
            sess.close()  # (a raise, or a caller that stopped iterating: staged prompts freed)
        pooled.wall_time = time.perf_counter() - t_start
        pooled.other_time = max(0.0, pooled.wall_time - pooled.prefill_time - pooled.draft_time - pooled.verify_time)
        self.last_stats = pooled
        self.stats.merge(pooled)


def _check_position_seeding(proposer) -> None:
    """random=position, beyond what the config checks: a Proposer given must draft a draft model's chains."""
    if proposer is not None and (not isinstance(proposer, DraftModelProposer) or proposer.tree is not None):
        raise ValueError(
            "random=position needs a draft model drafting chains (its q at every position) or no drafter: "
            "prompt lookup's and history's proposals depend on where a step starts, trees on their shape"
        )


def draft_runners(proposer) -> list[tuple[int, object]]:
    """(source, runner) of each draft source that runs a model (a SwitchProposer's parts; prompt lookup: none)."""
    parts = getattr(proposer, "parts", None) or [proposer]
    return [(s, p.runner) for s, p in enumerate(parts) if getattr(p, "runner", None) is not None]


def _controller(built, cfg) -> GammaController:
    """The draft-length controller: the config's gamma, priced with the target runner's prior slope and the
    drafter's per-source cost priors."""
    if built.proposer is None:
        return GammaController(0, cfg.max_gamma)
    priors = built.proposer.source_costs if built.proposer.tree is None else (0.0,)
    return GammaController(cfg.gamma, cfg.max_gamma, slope=prior_slope(built.runner), cost_priors=priors)


def _eos_ids(tokenizer, model) -> set[int]:
    eos: set[int] = set()
    config = getattr(model, "generation_config", None)
    for source in (getattr(tokenizer, "eos_token_id", None), getattr(config, "eos_token_id", None)):
        if isinstance(source, int):
            eos.add(source)
        elif isinstance(source, (list, tuple)):
            eos.update(int(x) for x in source)
    return eos


def _prompt_list(prompts) -> list:
    """One prompt (text, token ids, chat messages) or a list of them -> a list of prompts."""
    if isinstance(prompts, str):
        return [prompts]
    if not isinstance(prompts, Sequence) or isinstance(prompts, (bytes, bytearray)):
        raise ValueError(
            f"prompts must be a string, a list of token ids, chat messages, or a list of prompts; "
            f"got {type(prompts).__name__}"
        )
    prompts = list(prompts)
    if not prompts:
        raise ValueError("no prompts given")
    ids = all(isinstance(t, int) and not isinstance(t, bool) for t in prompts)
    if ids or all(isinstance(m, dict) for m in prompts):
        return [prompts]  # one prompt: token ids, or one conversation
    return prompts
