"""The one drafter factory: `build_proposer(config, target, draft)` makes every proposer (generation, serving,
rollouts, benchmarks, the certifier, head training) and the target's runner beside it. A drafter kind is one row of
`BUILDERS` (key: SpecConfig's `draft`; its needs: `config.DRAFTERS`' row) and its builder.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from ..crossvocab import BridgedRunner, SlemProposer, VocabMap, same_tokenizer, vocab_sizes
from ..drafting import (
    CombinedProposer,
    DraftModelProposer,
    HistoryProposer,
    PromptLookupProposer,
    Proposer,
    SwitchProposer,
)
from ..heads import HeadLoadError, LoadedHead, MedusaHeads, bind_head, head_kind, head_runner, load_head, mtp_head
from ..heads.learn import default_aux_layers
from ..heads.online import OnlineHeadProposer, OnlineLearner, OnlineSettings
from ..model.fast import make_runner
from ..model.loading import LoadedModel, load_model, parse_dtype, shared_vocab_size
from ..model.protocol import Runner
from ..model.runner import HFRunner
from .config import SpecConfig
from .observe import StepObserver
from .stats import SpecStats

__all__ = ["BUILDERS", "Drafting", "build_proposer", "describe_drafter", "describe_fallback", "load_draft"]


@dataclass(frozen=True)
class Drafting:
    """What `build_proposer` makes: the drafter, the target's runner, and the vocabulary both share."""

    proposer: Proposer | None  # None: plain decoding (draft=none)
    runner: Runner  # the target's
    vocab_size: int  # ids target and draft share
    observers: tuple = ()  # step observers the drafter needs (draft=online: its proposer, which learns from p)
    learner: OnlineLearner | None = None  # draft=online: the head being trained


@dataclass(frozen=True)
class _Inputs:
    config: SpecConfig
    target: LoadedModel
    draft: LoadedModel | LoadedHead | Proposer | None
    history: object | None  # a RolloutHistory (the history drafters)


def load_draft(path: str, **load) -> LoadedModel | LoadedHead:
    """A draft from disk: a hidden-state head's directory (its config.json says EAGLE-3, EAGLE or Medusa) as that
    head, anything else as a model (`load_model(path, **load)`)."""
    if head_kind(path) in ("eagle3", "eagle", "medusa"):
        if load.get("backend", "torch") == "llamacpp":
            raise HeadLoadError(f"{path} is a draft head, not a GGUF model: load it with torch")
        where = {k: v for k, v in load.items() if k == "device"}
        return load_head(path, dtype=parse_dtype(load.get("dtype") or torch.float32), **where)
    return load_model(path, **load)


def build_proposer(config: SpecConfig, target: LoadedModel, draft=None, *, history=None) -> Drafting:
    """The drafter `config` names, drafting with `draft` (a LoadedModel or LoadedHead for draft=model, a Proposer
    for draft=custom; None: the config's `model=` path is loaded, or the kind needs nothing), and the target's
    runner. history: the RolloutHistory the history drafters read.

    Raises:
        ValueError: `draft` does not fit the config's drafter (a HeadLoadError / ModelLoadError where a head or a
            draft model cannot draft for this target).
    """
    if isinstance(target, LoadedHead):
        raise ValueError(f"{target.name} is {target.described}, not a model: pass it as the draft")
    kind = config.drafter
    if kind.online:
        return _online(config, target, draft)
    if draft is None and kind.model and config.model is not None:
        draft = load_draft(config.model, dtype=_dtype(target), device=str(target.device))
    if draft is None and kind.target_head:
        draft = mtp_head(target)
    _check_given(config, draft)
    if isinstance(draft, LoadedHead):
        return _head(config, target, draft)
    proposer, vocab = BUILDERS[config.draft](_Inputs(config, target, draft, history))
    return Drafting(proposer, make_runner(target.model, vocab, runner=config.runner), vocab)


def _check_given(config: SpecConfig, draft) -> None:
    kind = config.drafter
    if draft is not None and not isinstance(draft, (LoadedModel, LoadedHead, Proposer)):
        raise ValueError(
            f"draft must be a LoadedModel, a hidden-state head, a Proposer or None, got {draft!r} (the drafter's "
            "kind is the config's draft key: SpecConfig(draft=...))"
        )
    if isinstance(draft, LoadedHead) and config.draft not in ("model", "mtp"):
        raise HeadLoadError(f"{draft.described} drafts alone (draft=model): draft={config.draft} cannot use it")
    if isinstance(draft, (LoadedModel, LoadedHead)) and not kind.model and not kind.target_head:
        raise ValueError(f"a draft model was given as draft, but the config drafts with draft={config.draft}")
    if isinstance(draft, Proposer) and not kind.given:
        raise ValueError(
            f"a {type(draft).__name__} was given as draft, but draft={config.draft} builds its own drafter: a given "
            "Proposer is draft=custom"
        )
    if draft is None and kind.model:
        raise ValueError(f"draft={config.draft} drafts with a draft model: pass it as draft, or name it (model=PATH)")
    if draft is None and kind.given:
        raise ValueError("draft=custom drafts with a Proposer given as draft")


def _dtype(target: LoadedModel):
    params = getattr(target.model, "parameters", None)
    return next(params()).dtype if params is not None else None


def _runner(config: SpecConfig) -> Callable:
    """The factory (model, vocab_size) -> a draft model's runner, as the config's runner and quant say."""
    return partial(make_runner, runner=config.runner, quant=config.quant)


def _ngram(x: _Inputs):
    return PromptLookupProposer(x.config.ngram, tree=x.config.tree_spec), shared_vocab_size(x.target, None)


def _given(x: _Inputs):
    """The Proposer given (draft=custom), or None (draft=none: `_check_given` let no draft through)."""
    return x.draft, shared_vocab_size(x.target, None)


def _model(x: _Inputs):
    """A draft model (the target's own weights for draft=self): the same tokenizer, or across vocabularies."""
    cfg = x.config
    model = x.target if cfg.drafter.target_weights else x.draft
    if not cfg.drafter.target_weights and (cfg.cross_vocab != "auto" or not same_tokenizer(x.target, model)):
        return _cross_vocab(x), shared_vocab_size(x.target, None)
    vocab = shared_vocab_size(x.target, model)
    proposer = DraftModelProposer(
        model.model, vocab, cfg.stop_below, tree=cfg.tree_spec, runner=_runner(cfg), draft_context=cfg.draft_context
    )
    return proposer, vocab


def _cross_vocab(x: _Inputs) -> Proposer:
    """A draft model with another tokenizer: token-level intersection (its runner bridged into the target's ids) or
    string-level exact match (cross_vocab=slem)."""
    cfg = x.config
    v_t, v_d = vocab_sizes(x.target, x.draft)
    slem = cfg.cross_vocab == "slem"
    vocab = VocabMap.build(x.target.tokenizer, x.draft.tokenizer, v_t, v_d, need_overlap=not slem)
    if slem:
        return SlemProposer(
            x.draft.model, x.target.tokenizer, vocab, v_t, v_d, runner=_runner(cfg), draft_context=cfg.draft_context
        )

    def bridged(model, v_draft):
        return BridgedRunner(_runner(cfg)(model, v_draft), vocab, v_t)

    return DraftModelProposer(
        x.draft.model, v_d, cfg.stop_below, tree=cfg.tree_spec, runner=bridged, draft_context=cfg.draft_context
    )


def _switch(x: _Inputs):
    """Prompt lookup or a draft model (the target's own quantized weights for ngram+self), per row and step."""
    lookup, _ = _ngram(x)
    model, vocab = _model(x)
    return SwitchProposer([lookup, model]), vocab


def _history(x: _Inputs):
    """Earlier rollouts of the same prompt (a RolloutEngine's history), beside a draft model's chain for
    model+history and self+history."""
    cfg = x.config
    if x.history is None:
        raise ValueError(f"draft={cfg.draft} drafts from a RolloutHistory: a RolloutEngine builds it")
    trie = HistoryProposer(x.history, tree=cfg.tree_spec, min_share=cfg.min_share)
    if not cfg.drafter.uses_model:
        return trie, shared_vocab_size(x.target, None)
    model = x.target if cfg.drafter.target_weights else x.draft
    vocab = shared_vocab_size(x.target, model)
    sampler = DraftModelProposer(
        model.model, vocab, cfg.stop_below, runner=_runner(cfg), draft_context=cfg.draft_context
    )
    return CombinedProposer(trie, sampler, cfg.gamma, choose_depth=cfg.choose_depth), vocab


def _head(config: SpecConfig, target: LoadedModel, head: LoadedHead) -> Drafting:
    """A hidden-state head (EAGLE-3, EAGLE, Medusa, an MTP layer): the draft model's proposer over the head's runner,
    which reads the target runner's hidden states (built first)."""
    if config.quant is not None:
        raise HeadLoadError(f"[quant] quantizes a draft model's weights; {head.described} runs as it is")
    if config.cross_vocab != "auto":
        raise HeadLoadError(f"{head.described} drafts in the target's vocabulary: [cross_vocab] does not apply")
    if config.draft == "mtp" and head.kind != "mtp":
        raise HeadLoadError(f"draft=mtp drafts with an MTP layer, not {head.described}")
    tree = config.tree_spec
    if isinstance(head.model, MedusaHeads) and tree is not None and tree.max_depth > head.model.num_heads:
        raise HeadLoadError(
            f"the tree is {tree.max_depth} deep and the checkpoint has {head.model.num_heads} Medusa heads"
        )
    vocab = bind_head(head, target)
    runner = make_runner(target.model, vocab, runner=config.runner)
    proposer = DraftModelProposer(
        head.model, vocab, config.stop_below, tree=tree, runner=lambda m, v: head_runner(m, runner, v)
    )
    proposer.name = f"{head.kind}-head"
    return Drafting(proposer, runner, vocab)


def _online(config: SpecConfig, target: LoadedModel, head) -> Drafting:
    """Prompt lookup and an EAGLE-3 head trained online (`heads.online`), per row and step: the head starts from
    `head` (or the config's `model=` directory, its training state resumed) or, with none, from the target once the
    first tokens are verified."""
    if head is None and config.model is not None:  # float32, as a fresh head trains (and its optimizer's moments)
        head = load_draft(config.model, dtype=torch.float32, device=str(target.device))
    if head is not None and not (isinstance(head, LoadedHead) and head.kind == "eagle3"):
        what = head.described if isinstance(head, LoadedHead) else type(head).__name__
        raise HeadLoadError(f"draft=online trains an EAGLE-3 head: it cannot start from {what}")
    vocab = bind_head(head, target) if head is not None else shared_vocab_size(target, None)
    runner = make_runner(target.model, vocab, runner=config.runner)
    if not isinstance(runner, HFRunner):
        raise ValueError(
            "draft=online reads the target's hidden states: the target must run on the fast or the transformers "
            f"runner, not {type(runner).__name__} (llama.cpp does not expose them)"
        )
    aux = head.model.layers_read if head is not None else default_aux_layers(runner.num_layers)
    settings = OnlineSettings(budget=config.online_budget, buffer_tokens=config.online_buffer)
    learner = OnlineLearner(target.model, vocab, aux, settings, head.model if head is not None else None)
    if config.model is not None:
        learner.resume(config.model)
    online = OnlineHeadProposer(learner, runner, vocab, config.stop_below)
    lookup = PromptLookupProposer(config.ngram)
    return Drafting(SwitchProposer([lookup, online]), runner, vocab, (_Targets(online),), learner)


class _Targets(StepObserver):
    """Hands each verified step's target distributions (`StepOutput.targets`) to an online head's proposer."""

    def __init__(self, proposer: OnlineHeadProposer):
        self.proposer, self.keep_top = proposer, proposer.keep_top

    def after_verify(self, view, draft, out) -> None:
        self.proposer.observe_targets(out.targets)


BUILDERS: dict[str, Callable[[_Inputs], tuple[Proposer | None, int]]] = {
    "none": _given,
    "ngram": _ngram,
    "model": _model,
    "self": _model,
    "history": _history,
    "model+history": _history,
    "self+history": _history,
    "custom": _given,
    "ngram+model": _switch,
    "ngram+self": _switch,
    # "online": prompt lookup and a head trained online (`_online`)
    # "mtp": the target checkpoint's MTP layer, a head (`_head`)
}


HEAD_NAMES = {"eagle3": "EAGLE-3 head", "eagle": "EAGLE head", "medusa": "Medusa heads", "mtp": "MTP layer"}
"""How `describe_drafter` names each hidden-state head kind (`heads.HEAD_KINDS`)."""


def describe_drafter(proposer: Proposer | None, target_model=None) -> str:
    """What drafts, read from the built proposer (`build_proposer`'s, or a given one), as the CLI's summary line and
    `--json` stats name it: "none", "prompt lookup", "EAGLE-3 head", "draft model", "int4 draft model
    (cross-vocabulary bridge)", "int4 self-draft", "rollout history + draft model", ...

    Args:
        proposer: The engine's proposer (None: plain decoding).
        target_model: The target's model, to tell the target's own (quantized) weights from a draft model's.

    Returns:
        A short description of the drafter.
    """
    if proposer is None:
        return "none"
    if isinstance(proposer, PromptLookupProposer):
        return "prompt lookup"
    if isinstance(proposer, HistoryProposer):
        return "rollout history"
    if isinstance(proposer, OnlineHeadProposer):
        return "EAGLE-3 head (online)"
    if isinstance(proposer, SwitchProposer):
        return " or ".join(describe_drafter(part, target_model) for part in proposer.parts)
    if isinstance(proposer, CombinedProposer):
        return " + ".join(describe_drafter(part, target_model) for part in (proposer.chooser, proposer.sampler))
    if isinstance(proposer, SlemProposer):
        return _quantized(proposer.runner, "draft model (cross-vocabulary, string-level match)")
    if isinstance(proposer, DraftModelProposer):
        head = proposer.name.removesuffix("-head") if proposer.name.endswith("-head") else None
        if head in HEAD_NAMES:  # `_head` names it
            return HEAD_NAMES[head]
        if target_model is not None and proposer.model is target_model:
            return _quantized(proposer.runner, "self-draft")
        bridged = " (cross-vocabulary bridge)" if isinstance(proposer.runner, BridgedRunner) else ""
        return _quantized(proposer.runner, "draft model" + bridged)
    return f"custom ({type(proposer).__name__})"


def _quantized(runner, what: str) -> str:
    quant = getattr(runner, "quant", None)  # (a BridgedRunner reads its draft runner's)
    return f"{quant} {what}" if quant else what


def describe_fallback(stats: SpecStats, drafting: bool = True) -> str | None:
    """The steps on which a drafter drafted nothing (the target then decodes plainly): gamma 0, gamma auto judging
    that drafting does not pay (or its plain-decoding probe), a drafter with nothing to propose (no n-gram match),
    a budget with one token left. None when every step drafted (or there is no drafter: `drafting` False).

    Args:
        stats: A call's stats (one request's, or pooled).
        drafting: Whether a drafter was built.

    Returns:
        "no draft on N of M steps" (M: the target's passes), or None.
    """
    plain, steps = stats.steps_by_drafted.get(0, 0), stats.target_passes
    if not drafting or not plain:
        return None
    return f"no draft on {plain} of {steps} step{'s' if steps != 1 else ''}"
