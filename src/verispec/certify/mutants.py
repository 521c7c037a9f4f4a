"""The certifier's mutants: deliberately broken engines (and lossless look-alikes), each behind one interface. A
`Mutant` plugs into `SpeculativeGenerator`'s seams only: a verification strategy (`certify.bugs`, `sampling.lossy`)
or a step observer (a q rebuilt the way a bug builds it, grammar states that answer other masks); `mutant(name,
config)` refuses the configs it does not apply to (for users: docs/guides/certify.md). Every mutant runs the stream
randomness: random=auto would couple each seeded sample, and coupled drafts are verified whatever q says."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from ..drafting import Draft
from ..engine.config import SpecConfig
from ..engine.generator import SpeculativeGenerator
from ..engine.observe import StepObserver
from ..engine.verify import Verification
from ..sampling.lossy import lenient_verifier, spec_rl_verifier, typical_verifier
from ..sampling.tree import chain_parents
from .bugs import (
    BLOCK_BUGS,
    BUGS,
    TREE_BUGS,
    TREE_NON_BUGS,
    broken_block_verifier,
    broken_tree_verifier,
    broken_verifier,
)

__all__ = ["CROSS_VOCAB_BUGS", "ENGINE_MUTANTS", "GRAMMAR_BUGS", "GRAMMAR_NON_BUGS", "HEAD_BUGS", "LOSSY_VERIFIERS"]
__all__ += ["Mutant", "mutant"]

HEAD_BUGS = ("head-no-d2t", "head-full-vocab")
CROSS_VOCAB_BUGS = ("tli-last-write",)
GRAMMAR_BUGS = ("grammar-stale-mask", "grammar-q-unmasked")  # with a constraint
GRAMMAR_NON_BUGS = ("grammar-q-unmasked-consistent",)  # looks wrong, is lossless
LOSSY_VERIFIERS = "lenient:L (L in (0, 1]), typical, spec-rl[:L] (L >= 1)"  # the lossy rules `mutant` knows


@dataclass(frozen=True)
class Mutant:
    """A deliberately changed engine: a verification strategy, or a step observer made fresh for each engine."""

    name: str
    verification: Verification | None = None
    observer: Callable[[str], StepObserver] | None = None  # (name) -> the observer, with `attach(core)`

    def config(self, config: SpecConfig) -> SpecConfig:
        """The config the engine runs: the stream randomness where `config` says auto; a verification that replaces
        the block rule takes its place (verify=block is the verification strategy itself then)."""
        block = config.verify == "block" and self.verification is not None
        return replace(
            config,
            random="stream" if config.random == "auto" else config.random,
            verify=None if block else config.verify,
        )

    def generator(self, target, draft, config: SpecConfig) -> SpeculativeGenerator:
        """The engine `config` describes, with this mutation plugged in (draft: as `SpeculativeGenerator` takes it)."""
        observers = [self.observer(self.name)] if self.observer else []
        gen = SpeculativeGenerator(
            target, draft, config=self.config(config), verification=self.verification, observers=observers
        )
        for o in observers:
            o.attach(gen.core)  # what the observer reads of the built engine (it changes nothing there)
        return gen


def mutant(name: str, config: SpecConfig) -> Mutant:
    """The mutant `name` for an engine `config` describes; ValueError for an unknown name, or a mutant that does not
    apply to this config (it would pass by construction)."""
    if config.random not in ("stream", "auto"):
        raise ValueError(
            f"{name} needs the stream randomness (coupled or position-seeded drafts are verified otherwise: certify "
            "the coupled verifier with `certify kernel --coupling gumbel --inject ...`)"
        )
    if name in ENGINE_MUTANTS:
        observer = ENGINE_MUTANTS[name]
        observer.check(name, config)
        return Mutant(name, observer=observer)
    return Mutant(name, verification=_verification(name, config))


def _verification(name: str, config: SpecConfig) -> Verification:
    """A broken (or lossy) verification function in the place the config's rule gives it."""
    tree, block = config.tree is not None, config.verify == "block"
    if block or name in BLOCK_BUGS:
        if not block:
            raise ValueError(f"{name} is a block verification bug: it needs verify='block'")
        if name not in BLOCK_BUGS:
            raise ValueError(f"with verify='block' the verifier override must be a block bug: {', '.join(BLOCK_BUGS)}")
        return Verification(chain=broken_block_verifier(name))
    usable = [b for b in TREE_BUGS + TREE_NON_BUGS if not b.startswith("tree_mixed_")]
    if tree and name in usable:
        return Verification(tree=broken_tree_verifier(name))
    if tree and name.startswith("tree_mixed_"):  # they act on rule 'mixed' only, which these trees never use
        raise ValueError(f"{name} breaks rule 'mixed' only; certify it with `certify kernel --tree mixed`")
    if tree:
        raise ValueError(f"with a tree the verifier override must be a tree bug: {', '.join(usable)}")
    if name in TREE_BUGS + TREE_NON_BUGS:
        raise ValueError(f"{name} is a tree bug: it needs a tree")
    return Verification(chain=broken_verifier(name) if name in BUGS else _lossy(name))


def _lossy(name: str):
    """A lossy acceptance rule by name (LOSSY_VERIFIERS)."""
    rule, _, lenience = name.partition(":")
    try:
        if rule == "lenient":
            return lenient_verifier(float(lenience or 0.5))
        if rule == "spec-rl":
            return spec_rl_verifier(float(lenience or 1.0))
    except ValueError:
        usage = (
            "lenient takes a lenience in (0, 1]: 'lenient:0.5'"
            if rule == "lenient"
            else "spec-rl takes a finite lenience >= 1: 'spec-rl' (l = 1) or 'spec-rl:2'"
        )
        raise ValueError(f"{usage}, got {name!r}") from None
    if name == "typical":
        return typical_verifier()
    raise ValueError(f"unknown verifier {name!r}: one of {', '.join(BUGS)}, {LOSSY_VERIFIERS}")


# --- the observers --------------------------------------------------------------------------------------


class _Mutation(StepObserver):
    """A mutant's observer: `check` refuses the configs it does not apply to, `attach` reads the built engine."""

    def __init__(self, name: str):
        self.name = name

    @classmethod
    def check(cls, name: str, config: SpecConfig) -> None:
        """ValueError when the mutant does not apply to `config` (before any model loads)."""

    def attach(self, core) -> None:
        """The engine is built (`core`: its EngineCore, read only)."""


def _drafts_chains(name: str, config: SpecConfig, what: str) -> None:
    if config.draft != "model" or config.tree is not None:
        raise ValueError(f"{name} breaks {what}: it needs draft=model (a --draft PATH) and no tree")


def with_q(view, draft: Draft, logits: Tensor) -> Draft:
    """The chain `draft` with its q at position j rebuilt from logits[:, j] ([B, k, V]) as the drafter builds it
    (the context after drafts 0 .. j - 1)."""
    q = draft.probs.clone()  # [B, k + 1, V]
    (B, k), dev = draft.token_ids.shape, draft.token_ids.device
    for j in range(k):
        ctx = view.node_context(draft.token_ids[:, :j], chain_parents(B, j, dev)).at(j)
        q[:, j] = view.probs(logits[:, j], *ctx, valid=torch.tensor([n > j for n in draft.num_nodes], device=dev))
    return replace(draft, probs=q)


def _sampled(draft: Draft) -> bool:
    return draft.probs is not None and max(draft.num_nodes, default=0) > 0


class HeadQ(_Mutation):
    """head-no-d2t (q handed over in draft-vocabulary ids 0 .. V_d - 1, not i + d2t[i]), head-full-vocab (scattered
    into a zero-filled row, where -inf belongs): q rebuilt from the head's logits at each chain position, read back
    from the head runner's cache (the state it fed back at the slot whose logits drew the draft)."""

    @classmethod
    def check(cls, name: str, config: SpecConfig) -> None:
        from ..heads import head_kind

        _drafts_chains(name, config, "an EAGLE-3 head's chains (draft=model with a head: --draft HEAD_DIR)")
        if config.model is not None and head_kind(config.model) != "eagle3":
            raise ValueError(
                f"{name} breaks an EAGLE-3 head's draft vocabulary: the draft {config.model!r} is not an EAGLE-3 head "
                "directory (config.json with draft_vocab_size)"
            )

    def attach(self, core) -> None:
        from ..heads import PairRunner

        runner = getattr(core.proposer, "runner", None)
        ids = getattr(runner, "_ids", None)  # [V_d]: draft id i -> target id i + d2t[i]
        if not isinstance(runner, PairRunner) or ids is None:
            raise ValueError(
                f"{self.name} breaks an EAGLE-3 head's draft vocabulary; this engine drafts with {core.proposer!r}"
            )
        if self.name == "head-no-d2t" and torch.equal(ids.cpu(), torch.arange(len(ids))):
            raise ValueError(
                f"{self.name}: the head's d2t is all zeros (draft ids are target ids), there is nothing to break"
            )
        if self.name == "head-full-vocab" and len(ids) >= runner.vocab_size:
            raise ValueError(
                f"{self.name}: the head's draft vocabulary is the whole target vocabulary, nothing lies outside it"
            )
        self.runner, self.ids = runner, ids

    def after_draft(self, view, draft: Draft) -> Draft | None:
        return with_q(view, draft, self.handed(self.head_logits(draft))) if _sampled(draft) else None

    def head_logits(self, draft: Draft) -> Tensor:
        """[B, k, V_d]: the head's logits that drew each draft. Row b's draft j came from the state fed back at cache
        slot lengths[b] - num_nodes[b] + j (the pending token's, then each fed draft's; the last draft is not fed)."""
        from ..heads.modules import rms_norm

        cache, head = self.runner.cache, self.runner.head
        B, k = draft.token_ids.shape
        start = torch.tensor(cache.lengths) - torch.tensor(draft.num_nodes)  # [B]
        slots = (start.unsqueeze(1) + torch.arange(k)).clamp(0, cache.extras[0].shape[1] - 1)  # [B, k]
        fed_back = cache.extras[0][torch.arange(B).unsqueeze(1), slots.to(cache.extras[0].device)]  # [B, k, H]
        with torch.inference_mode():
            return head.lm_head(rms_norm(fed_back, head.norm.weight, head.eps)).float()

    def handed(self, own: Tensor) -> Tensor:
        """The head's logits [..., V_d] -> the target-vocabulary logits [..., V] the bug hands verification."""
        V = self.runner.vocab_size
        if self.name == "head-no-d2t":  # at ids 0 .. V_d - 1, the rest at the runner's floor (`scatter_logits`)
            from ..heads import scatter_logits

            out = scatter_logits(own, self.ids, V).amin(-1, keepdim=True).expand(*own.shape[:-1], V).clone()
            out[..., : own.shape[-1]] = own
            return out
        out = torch.zeros((*own.shape[:-1], V), dtype=own.dtype, device=own.device)  # a zero-filled row
        out[..., self.ids] = own
        return out


class LastWrite(_Mutation):
    """tli-last-write: q rebuilt from the draft's own logits merged by last write (`VocabMap(merge="last")`); the
    logits come from a forward of the draft model over each row's spelled context (its runner's cache untouched)."""

    @classmethod
    def check(cls, name: str, config: SpecConfig) -> None:
        _drafts_chains(name, config, "a token-level-intersection draft model's chains (another tokenizer)")
        if config.cross_vocab == "slem":
            raise ValueError(f"{name} breaks token-level intersection: it needs cross_vocab auto or tli")

    def attach(self, core) -> None:
        from ..crossvocab import BridgedRunner

        runner = getattr(core.proposer, "runner", None)
        if not isinstance(runner, BridgedRunner):
            raise ValueError(
                f"{self.name} breaks a draft with another tokenizer; this engine's draft shares the target's"
            )
        self.model, self.runner = core.proposer.model, runner
        self.last = replace(runner.map, merge="last", _spell={})

    def after_draft(self, view, draft: Draft) -> Draft | None:
        if not _sampled(draft):
            return None
        V = self.runner.vocab_size
        return with_q(view, draft, self.last.target_logits(self.draft_logits(view, draft), V))

    @torch.inference_mode()
    def draft_logits(self, view, draft: Draft) -> Tensor:
        """[B, k, V_d]: the draft model's logits after each row's context and drafts 0 .. j - 1, in draft ids (a
        target token spelled by no draft id leaves the logits before it)."""
        (B, k), V_d = draft.token_ids.shape, self.runner.map.d2t.numel()
        out = torch.zeros((B, k, V_d), device=draft.token_ids.device)
        for b, row in enumerate(draft.token_ids.tolist()):
            ends, ids = [], []
            for t in list(view.seqs[b]) + row[: max(draft.num_nodes[b] - 1, 0)]:
                ids += self.runner.map.spell(int(t))
                ends.append(len(ids))
            if ids and draft.num_nodes[b]:
                logits = self.model(input_ids=torch.tensor([ids], device=self.model.device)).logits[0, :, :V_d]
                at = torch.tensor(ends[len(view.seqs[b]) - 1 :]).clamp(min=1) - 1  # [num_nodes]
                out[b, : len(at)] = logits[at.to(logits.device)].float().to(out.device)
        return out


class StaleMask(_Mutation):
    """grammar-stale-mask: every request's grammar state wrapped in `StaleMaskGrammar`."""

    @classmethod
    def check(cls, name: str, config: SpecConfig) -> None:
        if config.draft == "none":
            raise ValueError(f"{name} breaks the masks of a step's drafts: it needs a drafter")

    def grammar(self, request, state):
        return None if state is None else StaleMaskGrammar(state)


class StaleMaskGrammar:
    """A request's GrammarState that answers every path's mask with the root's (the committed state's)."""

    def __init__(self, inner):
        self.inner = inner
        self.broken = False  # an emitted token the grammar refused: no mask from then on

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def mask(self, path=()):
        return self.inner._all if self.broken else self.inner.mask(())

    def accepts(self, path) -> int:
        return len(path) if self.broken else self.inner.accepts(path)

    def jump(self, path, limit: int) -> list[int]:
        return [] if self.broken else self.inner.jump(path, limit)

    @property
    def stuck(self) -> bool:  # a broken state never ends its row: its tokens reach the certificate
        return not self.broken and self.inner.stuck

    def advance(self, tokens) -> int:
        """Every token is kept (the engine's cut would hide the bug from the certificate)."""
        if self.broken:
            return len(tokens)
        tokens = [int(t) for t in tokens]
        n = self.inner.accepts(tokens)
        ended = self.inner.matcher.is_terminated()  # a stop token accepted: what follows it is not output
        self.inner.advance(tokens[:n])
        self.broken = n < len(tokens) and not ended
        return len(tokens)


class UnmaskedQ(_Mutation):
    """grammar-q-unmasked (renormalized) and -consistent: the grammar states answer every mask with "all tokens"
    while the proposer drafts (from the end of a step to the draft), their own masks from the draft on; the chain
    is then handed over with q masked by each slot's grammar mask and renormalized, or with the unmasked q itself."""

    drafting = True

    @classmethod
    def check(cls, name: str, config: SpecConfig) -> None:
        _drafts_chains(name, config, "a draft model's sampled chains")

    def grammar(self, request, state):
        return None if state is None else _Unmasked(state, self)

    def after_draft(self, view, draft: Draft) -> Draft | None:
        self.drafting = False  # fit, scores and verification read the grammar's own masks
        if view.grammars is None or not _sampled(draft):
            return None
        q = draft.probs
        if self.name == "grammar-q-unmasked":
            allowed = view.node_context(draft.token_ids, draft.parents).allowed  # [B, N + 1, V]: each slot's mask
            S = min(q.shape[1], allowed.shape[1])
            masked = q[:, :S] * allowed[:, :S].to(q.dtype)
            q = q.clone()
            q[:, :S] = masked / masked.sum(-1, keepdim=True).clamp_min(torch.finfo(q.dtype).tiny)
        return replace(draft, probs=q, chain=False)

    def after_commit(self, view, out) -> None:
        self.drafting = True  # the next step's draft reads no mask


class _Unmasked:
    """A request's GrammarState whose mask allows every token while `owner.drafting`."""

    def __init__(self, inner, owner: UnmaskedQ):
        self.inner, self.owner = inner, owner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def mask(self, path=()):
        return self.inner._all if self.owner.drafting else self.inner.mask(path)


ENGINE_MUTANTS: dict[str, type[_Mutation]] = {
    **dict.fromkeys(HEAD_BUGS, HeadQ),
    **dict.fromkeys(CROSS_VOCAB_BUGS, LastWrite),
    "grammar-stale-mask": StaleMask,
    **dict.fromkeys(("grammar-q-unmasked", *GRAMMAR_NON_BUGS), UnmaskedQ),
}
