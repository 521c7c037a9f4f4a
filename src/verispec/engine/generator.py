"""The generate loop: draft, verify in one target pass, commit, roll back — for a batch of requests.

    gen = SpeculativeGenerator(target, draft)            # draft: a LoadedModel, "ngram", or None (plain)
    outs = gen.generate(["def fib(n):"], SamplingParams(temperature=0.7, seed=1), max_new_tokens=64)
    for event in gen.stream("Hello", SamplingParams()):  # text deltas as they are accepted
        print(event.delta, end="")

Every emitted token follows the target's distribution exactly (verify_chain or verify_block); the target's cache is
rolled back to the accepted prefix after each step, the draft's too. Rows finish independently (EOS,
stop strings, max_new_tokens, the context end) and leave the batch. Under random=auto (the default) a request
with its own seed (SamplingParams.seed) is Gumbel-coupled, keyed by that seed and its output positions: the same
request, seed and weights give the same tokens whatever gamma (auto included), the batch or the load; a request
without one draws from its own generator (seeded from torch's global RNG), as under random=stream, where with a
fixed gamma a seeded request gives the same tokens alone or in any batch. Either way bit for bit as far as the
kernels are batch-invariant: padding changes summation order in the last bits, which can flip a token only at a
near-exact tie (the distribution is unaffected).

Logprobs convention (both under the target, at each returned token):
    logprobs[i]     = log p(x_i): the processed distribution actually sampled from (penalties, temperature,
                      top-k / top-p / min-p applied; a greedy request gets 0.0);
    raw_logprobs[i] = log softmax(logits)(x_i): the model's own distribution (temperature 1, nothing
                      truncated or penalised) — what RL importance ratios usually need.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence

from ..drafting import DraftModelProposer, PromptLookupProposer, Proposer, TreeSpec
from ..heads import LoadedHead, bind_head, head_proposer, mtp_head
from ..model.fast import make_runner
from ..model.loading import LoadedModel, shared_vocab_size
from ..sampling import CHAIN_RULES, SamplingParams, verify_tree
from .adaptive import GammaController, measure_cost_curve
from .config import UNSET, SpecConfig, config_from_keywords, keyword_items
from .core import EngineCore
from .request import Job, check_limits
from .rows import Completion, StreamEvent
from .session import GenerationSession
from .stats import SpecStats

__all__ = ["Completion", "GenerationSession", "SpeculativeGenerator", "StreamEvent"]


class SpeculativeGenerator:
    """Speculative decoding with a target model and a drafter, as a `SpecConfig` says.

    The config (`verispec.engine.config`) names the drafter, gamma, tree, verification rule, randomness and runner;
    its docstring explains every key. Every emitted token follows the target's distribution exactly, whatever the
    config: it only moves speed (and, through `random`, what a seeded request's tokens depend on).

    ```python
    gen = SpeculativeGenerator(target, draft, config=SpecConfig.parse("draft=model,gamma=auto"))
    outs = gen.generate(["def fib(n):", "Hello"], SamplingParams(temperature=0.7, seed=1), max_new_tokens=64)
    for event in gen.stream("Tell me a story", SamplingParams(seed=2), chat=True):
        print(event.delta, end="", flush=True)
    ```

    The keyword arguments of earlier versions (gamma, max_gamma, ngram_sizes, draft_stop_below, runner,
    draft_quant, verify, coupling, seeding, tree, tree_rule) still build the config, each setting its keys; given
    beside `config`, each must agree with it. Under random=position the stats count the drafts fed to the target
    (the last draft of a step shows in tau, not in `accepted`), and gamma auto prices a step's drafts without that
    last one.

    Args:
        target: The target model (`load_model`).
        draft: What the config's drafter drafts with: a `LoadedModel` for draft=model (or a hidden-state head,
            `verispec.heads.load_head`), a `Proposer` for draft=custom (or a `RolloutEngine`'s history drafter),
            else None (draft=mtp reads the MTP layer from the target's own checkpoint). In the older spelling,
            also a string: "ngram", "self", "none" or None for plain decoding, the honest baseline.
        config: The speculation configuration (default: `SpecConfig()`, prompt lookup with gamma auto).
        gamma: Older spelling of the `gamma` key: drafts per step, or "auto".
        max_gamma: Older spelling of `max_gamma`: the most drafts gamma "auto" picks.
        ngram_sizes: Older spelling of `ngram`: prompt-lookup n-gram sizes, longest first.
        draft_stop_below: Older spelling of `stop_below`.
        runner: Older spelling of `runner`: "auto", "fast", "hf" or "llamacpp".
        draft_quant: Older spelling of `quant`: None, "int8" or "int4".
        verify: Older spelling of `verify`: "token" or "block" for chains.
        coupling: With `seeding`, the older spelling of `random`: None or "gumbel".
        seeding: With `coupling`, the older spelling of `random`: "stream" or "position".
        verifier (Callable | None): An override of the chain verification function (verify_chain's interface): `verispec certify
            --inject` and the lossy study swap it; not configuration.
        tree: Older spelling of `tree`: a TreeSpec or its string ("4-2-2-1", "dynamic-D-K-M").
        tree_rule: With `tree`, the older spelling of `verify` for trees.
        tree_verifier (Callable): An override of the tree verification function (verify_tree's interface), as `verifier`.
            With an override, random=auto runs the stream for every request (the override sees p, not coupled
            one-hot targets).

    Raises:
        SpecError: The configuration is invalid (it names the key at fault).
        ValueError: The keyword arguments disagree with `config`, or `draft` does not fit the config's drafter.
        ModelLoadError: The draft and target vocabularies cannot be shared.
    """

    def __init__(
        self,
        target: LoadedModel,
        draft: LoadedModel | Proposer | str | None = UNSET,
        *,
        config: SpecConfig | None = None,
        gamma: int | str = UNSET,
        max_gamma: int = UNSET,
        ngram_sizes: Sequence[int] = UNSET,
        draft_stop_below: float | None = UNSET,
        runner: str = UNSET,
        draft_quant: str | None = UNSET,
        verify: str = UNSET,
        coupling: str | None = UNSET,
        seeding: str = UNSET,
        verifier=None,
        tree: TreeSpec | str | None = UNSET,
        tree_rule: str | None = UNSET,
        tree_verifier=verify_tree,
    ):
        keywords = dict(
            draft=draft,
            gamma=gamma,
            max_gamma=max_gamma,
            ngram_sizes=ngram_sizes,
            draft_stop_below=draft_stop_below,
            runner=runner,
            draft_quant=draft_quant,
            verify=verify,
            coupling=coupling,
            seeding=seeding,
            tree=tree,
            tree_rule=tree_rule,
        )
        self.config, draft = _spec_config(config, {k: v for k, v in keywords.items() if v is not UNSET})
        self._build(target, draft, verifier, tree_verifier)

    def _build(self, target: LoadedModel, draft, verifier, tree_verifier) -> None:
        """Drafter, gamma controller, runner and core as self.config says (draft: the object it drafts with)."""
        self.target = target
        self.tokenizer = target.tokenizer
        cfg = self.config
        if verifier is not None and cfg.chain_rule != "token":
            raise ValueError(f"verify={cfg.chain_rule!r} and a verifier override exclude each other")
        self.verify = cfg.chain_rule  # "token" or "block" (chains); "token" where trees are drafted
        self.coupling = cfg.coupling
        self.seeding = cfg.seeding
        # the randomness the core runs: the config's, but auto with overridden verification functions (certify's
        # injected bugs, the lossy study) runs the stream: coupled rows would hand them one-hot targets, where most
        # bugs verify exactly
        overridden = verifier is not None or tree_verifier is not verify_tree
        self.random = "stream" if cfg.random == "auto" and overridden else cfg.random
        # the verification functions (verify_chain's and verify_tree's interfaces): `verispec certify --inject`
        # and the lossy variants of the study swap them, nothing else should
        self.verifier = CHAIN_RULES[self.verify] if verifier is None else verifier
        self.tree_verifier = tree_verifier
        if isinstance(target, LoadedHead):
            raise ValueError(f"{target.name} is {target.described}, not a model: pass it as the draft (--draft)")
        if draft is None and cfg.drafter.target_head:  # draft=mtp: the MTP layer in the target's own checkpoint
            draft = mtp_head(target)
        if isinstance(draft, LoadedHead):  # a hidden-state head reads the target's runner: that comes first
            self.vocab_size = bind_head(draft, target)
            self.runner = make_runner(target.model, self.vocab_size, runner=cfg.runner)
            self.proposer = head_proposer(target, draft, cfg, self.runner)
        else:
            self.proposer, self.vocab_size = self._proposer(target, draft, cfg)
            self.runner = make_runner(target.model, self.vocab_size, runner=cfg.runner)
        self.tree = self.proposer.tree if self.proposer is not None else None
        if self.tree is not None and self.verify != "token":
            raise ValueError(
                f"verify={self.verify!r} verifies chains, and the {type(self.proposer).__name__} drafts trees "
                "(verified by their own rule)"
            )
        if cfg.random == "position":
            _check_position_seeding(self.proposer, verifier)
        self.controller = GammaController(0 if self.proposer is None else cfg.gamma, cfg.max_gamma)
        self.device = self.runner.device
        self.eos_ids = _eos_ids(self.tokenizer, target.model)
        self.max_positions = self.runner.max_positions
        self.stats = SpecStats()  # pooled over every call
        self.last_stats = SpecStats()  # the last generate / stream call's
        self.core = EngineCore(
            runner=self.runner,
            proposer=self.proposer,
            controller=self.controller,
            tokenizer=self.tokenizer,
            model=target.model,
            vocab_size=self.vocab_size,
            eos_ids=self.eos_ids,
            verifier=self.verifier,
            tree_verifier=self.tree_verifier,
            random=self.random,
            jump=cfg.jump,
        )

    @staticmethod
    def _proposer(target: LoadedModel, draft, config: SpecConfig) -> tuple[Proposer | None, int]:
        """The drafter the config names (draft: the object it drafts with, if any; see `_spec_config`) and the
        vocabulary size target and draft share."""
        kind, tree = config.drafter, config.tree_spec
        if kind.uses_model and kind.built_by_generator:
            model = target if kind.target_weights else draft
            if not kind.target_weights and _cross_vocab(target, model, config):
                from ..crossvocab import cross_vocab_proposer

                return cross_vocab_proposer(target, model, config), shared_vocab_size(target, None)
            vocab = shared_vocab_size(target, model)
            proposer = DraftModelProposer(
                model.model, vocab, config.stop_below, tree=tree, runner=config.runner, quant=config.quant
            )
            return proposer, vocab
        vocab = shared_vocab_size(target, None)
        if config.draft == "none":
            return None, vocab
        if config.draft == "ngram":
            return PromptLookupProposer(config.ngram, tree=tree), vocab
        return draft, vocab  # a Proposer given (draft=custom, or a RolloutEngine's history drafter)

    # --- input handling -------------------------------------------------------------------------------
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

    # --- public API -----------------------------------------------------------------------------------
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
        params = list(params) if isinstance(params, Sequence) else params
        if (
            not isinstance(params, list)
            or len(params) != len(prompts)
            or not all(isinstance(p, SamplingParams) for p in params)
        ):
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
        """Measure the target's cost curve and the draft's step cost at each batch size, for gamma "auto".

        Gamma "auto" then picks each step's draft length from the curve at that step's batch size from the first
        step on (vLLM asks for a hand-set draft length per batch size; here it is measured). Lossless either way:
        only speed moves.

        Args:
            batches: The batch sizes B to measure.
            context: Tokens of context each measured row holds.
            repeats: Timings per point (their median is kept).

        Returns:
            `{B: {"curve": [T_B(1), ..., T_B(max_gamma + 1)], "draft_step": seconds or None}}`.

        Raises:
            ValueError: `batches` is not a non-empty list of integers >= 1.
        """
        if (
            isinstance(batches, int)
            or not batches
            or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in batches)
        ):
            raise ValueError(f"batches must be a non-empty list of integers >= 1, got {batches!r}")
        drafter = getattr(self.proposer, "runner", None)  # a draft model's runner; n-gram drafting costs no forward
        out = {}
        for b in sorted(set(batches)):
            curve = measure_cost_curve(self.runner, self.vocab_size, self.controller.max_gamma + 1, b, context, repeats)
            step = measure_cost_curve(drafter, self.vocab_size, 1, b, context, repeats)[0] if drafter else None
            self.controller.seed_costs(b, curve, step)
            out[b] = {"curve": curve, "draft_step": step}
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
        t_start = time.perf_counter()
        try:
            while not sess.idle:
                for event in sess.step():
                    if event.completion is not None and event.completion.error is not None:
                        raise event.completion.error  # a RowFault: this request failed inside a step
                    yield event
        finally:
            sess.close()  # (a raise, or a caller that stopped iterating: staged prompts freed)
        pooled = sess.stats
        pooled.wall_time = time.perf_counter() - t_start
        pooled.other_time = pooled.wall_time - pooled.draft_time - pooled.verify_time
        self.last_stats = pooled
        self.stats.merge(pooled)


SEEDINGS = ("stream", "position")  # the seedings of `seeding` (SpecConfig's random: auto, stream, position, gumbel)


def _spec_config(config: SpecConfig | None, keywords: dict) -> tuple[SpecConfig, LoadedModel | Proposer | None]:
    """(the config, the object its drafter drafts with) of the constructor's config and the keyword arguments given
    (see the class docstring); ValueError when they disagree or the object does not fit the config's drafter."""
    given = "draft" in keywords
    draft = keywords.pop("draft", None)
    obj = draft if isinstance(draft, (LoadedModel, Proposer)) else None
    if obj is not None and config is None:
        keywords["draft"] = "model" if isinstance(obj, LoadedModel) else "custom"
    elif obj is None and given and not (draft is None and config is not None):  # with a config, None: no object
        keywords["draft"] = draft  # a spelling: "ngram", "self", "none" or None (plain decoding)
    cfg = config_from_keywords(config, keyword_items(keywords), {})
    kind = cfg.drafter
    if isinstance(obj, LoadedModel) and not (kind.model and kind.built_by_generator):
        raise ValueError(f"a draft model was given as draft, but the config drafts with draft={cfg.draft}")
    if isinstance(obj, Proposer) and kind.built_by_generator:
        raise ValueError(
            f"a {type(obj).__name__} was given as draft, but draft={cfg.draft} builds its own drafter: a given "
            "Proposer is draft=custom"
        )
    if obj is None and kind.model and kind.built_by_generator:
        where = f" (load_model({cfg.model!r}))" if cfg.model else ""
        raise ValueError(f"draft=model drafts with a draft model: pass it as draft, a LoadedModel{where}")
    if obj is None and not kind.built_by_generator:
        raise ValueError(
            f"draft={cfg.draft} drafts with a Proposer given as draft (a RolloutEngine builds its history drafter)"
        )
    return cfg, obj


def _cross_vocab(target: LoadedModel, draft, config: SpecConfig) -> bool:
    """Whether the draft model drafts across vocabularies: its tokenizer is another, or cross_vocab forces it."""
    from ..crossvocab import same_tokenizer

    if not isinstance(draft, LoadedModel):
        return False
    return config.cross_vocab != "auto" or not same_tokenizer(target, draft)


def _check_position_seeding(proposer, verifier) -> None:
    """random=position, beyond what the config checks: a Proposer given must draft a draft model's chains, and the
    verification stays token-wise."""
    if proposer is not None and (not isinstance(proposer, DraftModelProposer) or proposer.tree is not None):
        raise ValueError(
            "seeding='position' needs a draft model drafting chains (its q at every position) or no drafter: "
            "prompt lookup's and history's proposals depend on where a step starts, trees on their shape"
        )
    if verifier is not None:
        raise ValueError("seeding='position' verifies token-wise: a verifier override replaces that")


def _eos_ids(tokenizer, model) -> set[int]:
    eos: set[int] = set()
    for source in (
        getattr(tokenizer, "eos_token_id", None),
        getattr(getattr(model, "generation_config", None), "eos_token_id", None),
    ):
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
    if all(isinstance(t, int) and not isinstance(t, bool) for t in prompts) or all(
        isinstance(m, dict) for m in prompts
    ):
        return [prompts]  # one prompt: token ids, or one conversation
    return prompts
