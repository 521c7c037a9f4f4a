"""The generate loop: draft, verify in one target pass, commit, roll back — for a batch of requests.

    gen = SpeculativeGenerator(target, draft)            # draft: a LoadedModel, "ngram", or None (plain)
    outs = gen.generate(["def fib(n):"], SamplingParams(temperature=0.7, seed=1), max_new_tokens=64)
    for event in gen.stream("Hello", SamplingParams()):  # text deltas as they are accepted
        print(event.delta, end="")

Every emitted token follows the target's distribution exactly (verify_chain or verify_block); the target's cache is
rolled back to the accepted prefix after each step, the draft's too. Rows finish independently (EOS,
stop strings, max_new_tokens, the context end) and leave the batch. Each request draws its randomness
from its own generator (SamplingParams.seed, or a seed drawn from torch's global RNG), so with a fixed
gamma a seeded request gives the same tokens alone or in any batch — bit for bit as far as the kernels
are batch-invariant: padding changes summation order in the last bits, which can flip a token only at a
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
from ..model.fast import make_runner
from ..model.loading import LoadedModel, shared_vocab_size
from ..sampling import CHAIN_RULES, SamplingParams, verify_tree
from ..sampling.coupling import COUPLINGS
from .adaptive import GammaController, measure_cost_curve
from .core import EngineCore
from .request import Job, check_limits
from .rows import Completion, StreamEvent
from .session import GenerationSession
from .stats import SpecStats

__all__ = ["Completion", "GenerationSession", "SpeculativeGenerator", "StreamEvent"]


class SpeculativeGenerator:
    """Speculative decoding with a target model and a drafter.

    draft: a `LoadedModel` (draft model), "self" (the target's own weights, quantized: needs draft_quant),
    "ngram" (prompt lookup), a `Proposer`, or None / "none" (plain decoding through the same loop: the
    honest baseline). gamma: drafts per step (an upper bound when a draft model stops early), or "auto".
    draft_stop_below: a draft model stops drafting for a row once its own probability of a drafted token
    falls below this (None: always draft gamma tokens). runner: "auto" (verispec's fast forward where the
    architecture is supported, else transformers'), "fast" or "hf", for target and draft model.
    draft_quant: None, "int8" or "int4": weight-only quantized draft weights (lossless: q is what the
    quantized draft sampled from).
    tree: None (chains) or a token tree per step — a `TreeSpec` or its string form ("4-2-2-1": children per
    node at each depth; "dynamic-D-K-M": EAGLE-2), drafted by the draft model (or, for "ngram", several prompt
    matches as branches; a custom `Proposer` brings its own `tree`) and verified in one tree-masked target pass with verify_tree; tree_rule: how children
    are drawn and verified ("deterministic" top-k, "iid", "without_replacement"). With a tree, gamma only
    switches speculation on or off per request; the tree's shape sets the draft.
    verify: how chains are verified — "token" (token-wise, Leviathan et al.) or "block" (block verification, Sun
    et al. 2025: the same exactness, an accepted prefix at least as long in expectation; `sampling.block`).
    coupling: None, or "gumbel": every output token is the exponential race of the target's p under noise keyed by
    (request seed, output position), and a draft model draws with the same noise (`sampling.coupling`): a seeded
    request then gives plain decoding's output under the same coupling, token for token, for every drafter, gamma,
    tree and batch (per position it keeps a draft with probability between (1 - TV) / (1 + TV) and 1 - TV, the
    optimal rules' acceptance).
    seeding: "stream" (each request's uniforms come from its generator in draw order) or "position" (every uniform
    keyed by (seed, output position, purpose) and the step's last position drafted too, `sampling.positional`): a
    seeded request's tokens then do not depend on gamma (auto included), the batch or timing, with no loss of
    acceptance, for one draft forward more per step; token-wise chains from a draft model (or plain decoding) only.
    Its stats count the drafts fed to the target (the last draft of a step shows in tau, not in `accepted`), and
    gamma auto prices a step's drafts without that last one.
    """

    def __init__(
        self,
        target: LoadedModel,
        draft: LoadedModel | Proposer | str | None = "ngram",
        *,
        gamma: int | str = "auto",
        max_gamma: int = 8,
        ngram_sizes: Sequence[int] = (3, 2, 1),
        draft_stop_below: float | None = 0.3,
        runner: str = "auto",
        draft_quant: str | None = None,
        verify: str = "token",
        coupling: str | None = None,
        seeding: str = "stream",
        verifier=None,
        tree: TreeSpec | str | None = None,
        tree_rule: str | None = None,
        tree_verifier=verify_tree,
    ):
        self.target = target
        self.tokenizer = target.tokenizer
        if verify not in CHAIN_RULES:
            raise ValueError(f"verify must be one of {', '.join(CHAIN_RULES)}, got {verify!r}")
        if verifier is not None and verify != "token":
            raise ValueError(f"verify={verify!r} and a verifier override exclude each other")
        if coupling is not None and coupling not in COUPLINGS:
            raise ValueError(f"coupling must be None or one of {', '.join(COUPLINGS)}, got {coupling!r}")
        if seeding not in SEEDINGS:
            raise ValueError(f"seeding must be one of {', '.join(SEEDINGS)}, got {seeding!r}")
        self.verify = verify
        self.coupling = coupling
        self.seeding = seeding
        # the verification functions (verify_chain's and verify_tree's interfaces): `verispec certify --inject`
        # and the lossy variants of the study swap them, nothing else should
        self.verifier = CHAIN_RULES[verify] if verifier is None else verifier
        self.tree_verifier = tree_verifier
        tree = _tree_spec(tree, tree_rule)
        self.proposer, self.vocab_size = self._proposer(
            target, draft, tree, ngram_sizes, draft_stop_below, runner, draft_quant
        )
        self.tree = self.proposer.tree if self.proposer is not None else None
        if self.tree is not None and verify != "token":
            raise ValueError(
                f"verify={verify!r} verifies chains; a tree is verified by its own rule (tree_rule), drop one of them"
            )
        if seeding == "position":
            _check_position_seeding(self.proposer, verify, coupling, verifier)
        self.controller = GammaController(0 if self.proposer is None else gamma, max_gamma)
        self.runner = make_runner(target.model, self.vocab_size, runner=runner)
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
            coupling=self.coupling,
            seeding=self.seeding,
        )

    @staticmethod
    def _proposer(target, draft, tree, ngram_sizes, stop_below, runner, quant) -> tuple[Proposer | None, int]:
        """The drafter for `draft` (see the class docstring) and the vocabulary size target and draft share."""
        if quant is not None and not (isinstance(draft, LoadedModel) or draft == "self"):
            raise ValueError(f"draft_quant={quant!r} applies to a draft model or draft='self', not to {draft!r}")
        if draft == "self" and quant is None:
            raise ValueError(
                "draft='self' needs draft_quant ('int8' or 'int4'): an unquantized copy of the target "
                "costs as much as the target"
            )
        if isinstance(draft, LoadedModel) or draft == "self":
            model = target if draft == "self" else draft
            vocab = shared_vocab_size(target, model)
            return DraftModelProposer(model.model, vocab, stop_below, tree=tree, runner=runner, quant=quant), vocab
        vocab = shared_vocab_size(target, None)
        if draft is None or draft == "none":
            if tree is not None:
                raise ValueError("a tree needs a drafter (a draft model, 'self' or 'ngram')")
            return None, vocab
        if isinstance(draft, str) and draft == "ngram":
            return PromptLookupProposer(tuple(ngram_sizes), tree=tree), vocab
        if isinstance(draft, Proposer):
            if tree is not None:
                raise ValueError(
                    f"pass the tree to the {type(draft).__name__} itself (its `tree`), not to the generator"
                )
            return draft, vocab
        raise ValueError(f"draft must be a loaded model, 'self', 'ngram', 'none' or a Proposer, got {draft!r}")

    # --- input handling -------------------------------------------------------------------------------
    def encode(self, prompt: str | Sequence[int] | Sequence[dict], chat: bool = False) -> list[int]:
        """A prompt as token ids (`EngineCore.encode`: text, chat messages or token ids)."""
        return self.core.encode(prompt, chat)

    @property
    def weight_version(self) -> int:
        """The target's weight version (counted by `EngineCore.update_weights`)."""
        return self.core.weight_version

    # --- public API -----------------------------------------------------------------------------------
    def generate(
        self,
        prompts,
        params: SamplingParams | Sequence[SamplingParams] = SamplingParams(),
        *,
        max_new_tokens: int = 128,
        stop: str | Sequence[str] | None = (),
        chat: bool = False,
        ignore_eos: bool = False,
    ) -> list[Completion]:
        """Generate for one prompt (text, token ids or chat messages) or a list of them; one Completion each."""
        done: list[Completion] = []
        for event in self.stream(
            prompts, params, max_new_tokens=max_new_tokens, stop=stop, chat=chat, ignore_eos=ignore_eos
        ):
            if event.completion is not None:
                done.append(event.completion)
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
        """Like generate, but yields text deltas per request as steps are accepted."""
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
            self.core.request(p, sp, max_new_tokens=max_new_tokens, stop=stop, chat=chat, ignore_eos=ignore_eos, index=i)
            for i, (p, sp) in enumerate(zip(prompts, params))
        ]
        sess = GenerationSession(self.core)
        sess.submit(Job(requests))
        return self._drive(sess)

    def calibrate(self, batches: Sequence[int] = (1, 2, 4, 8), context: int = 64, repeats: int = 3) -> dict:
        """Measure the target's cost curve T_B(1..max_gamma + 1) and the draft's step cost at each batch size B, and
        give them to gamma "auto", which then picks each step's draft length from the curve at that step's batch
        size from the first step on (vLLM asks for a hand-set draft length per batch size; here it is measured).
        Returns {B: {"curve": [...], "draft_step": seconds or None}}. Lossless either way: only speed moves."""
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
        """A continuous-batching session: jobs join (`submit`, `add`) and leave (finish, `abort`) between steps."""
        return GenerationSession(self.core, max_batch)

    def _drive(self, sess: GenerationSession) -> Iterator[StreamEvent]:
        t_start = time.perf_counter()
        while not sess.idle:
            yield from sess.step()
        pooled = sess.stats
        pooled.wall_time = time.perf_counter() - t_start
        pooled.other_time = pooled.wall_time - pooled.draft_time - pooled.verify_time
        self.last_stats = pooled
        self.stats.merge(pooled)


SEEDINGS = ("stream", "position")


def _check_position_seeding(proposer, verify: str, coupling: str | None, verifier) -> None:
    if proposer is not None and (not isinstance(proposer, DraftModelProposer) or proposer.tree is not None):
        raise ValueError(
            "seeding='position' needs a draft model drafting chains (its q at every position) or no drafter: "
            "prompt lookup's and history's proposals depend on where a step starts, trees on their shape"
        )
    if verify != "token" or verifier is not None:
        raise ValueError("seeding='position' verifies token-wise (block verification's decisions read later positions)")
    if coupling is not None:
        raise ValueError("coupling='gumbel' keys its noise by position already: drop seeding='position'")


def _tree_spec(tree: TreeSpec | str | None, rule: str | None) -> TreeSpec | None:
    if isinstance(tree, str):
        return TreeSpec.parse(tree, rule)
    if rule is not None and (tree is None or tree.rule != rule):
        raise ValueError("tree_rule needs a tree (or matches the TreeSpec's rule)")
    if tree is not None and not isinstance(tree, TreeSpec):
        raise ValueError(f"tree must be a TreeSpec or a string such as '4-2-2-1', got {tree!r}")
    return tree


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
