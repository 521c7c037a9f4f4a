"""Deliberately broken structured outputs, for proving that the generator certificate bites on a constraint
(`verispec certify generate --json-schema FILE --inject NAME`; the names and what each breaks: bugs.py).

They break the engine, not a verification function: `inject_grammar_bug(generator, name)` wraps what a
`SpeculativeGenerator` builds, after it is built.

  grammar-stale-mask        every request's grammar state answers the mask at the step's root for every path
                            (`StaleMaskGrammar`): the draft's q and the target's p at every slot read the root's
                            mask, as in an engine that fills one bitmask per step. Emitted tokens the grammar refuses
                            leave the state broken (no mask from then on) instead of stopping the engine, so the
                            certificate sees them (p = 0: the scores' impossible tokens).
  grammar-q-unmasked        the draft model samples from its unmasked q; verification is handed the masked,
                            renormalized q (`UnmaskedDraft(renormalized=True)`).
  grammar-q-unmasked-consistent  (lossless) the same drafts, verification handed the unmasked q they were drawn
                            from (`UnmaskedDraft(renormalized=False)`).

The two q variants hand their chains to verification as one-child trees (rule "iid": on a chain, the token-wise
rule itself), which the engine's `fit_draft` leaves as drafted whatever it does with chains. (It cuts only chosen
chains before a refused token; a sampled chain is verified as drawn: cutting one where only some tokens are refused
would change the law of the drafts kept — at a cut draft x (p(x) = 0) the exact rule rejects x and draws from the
residual (p - q)+ / Z, a cut chain draws from p there instead, so P(y) = min(p, q)(y) + (1 - Q_A) p(y) + (Q_A - 1 +
Z) (p - q)+(y) / Z with Q_A = q's mass on the allowed tokens, which is p(y) only when Q_A = 1.) Verified as
drafted, the consistent variant is exact and the renormalized one is not.
"""

from __future__ import annotations

from dataclasses import fields, replace

import torch

from ..drafting.base import Draft
from ..drafting.draft_model import DraftModelProposer
from ..drafting.batch import BatchView
from .bugs import GRAMMAR_BUGS, GRAMMAR_NON_BUGS

__all__ = ["StaleMaskGrammar", "UnmaskedDraft", "check_grammar_bug", "inject_grammar_bug", "stream_config"]

_Q_BUGS = ("grammar-q-unmasked", "grammar-q-unmasked-consistent")
_STREAM = ("stream", "auto")  # auto runs the stream under an injection (`stream_config`), as under a verifier override


def stream_config(config):
    """The SpecConfig an injected engine runs: random=auto becomes the stream (auto would Gumbel-couple every seeded
    sample, and coupled drafts are verified as exact matches of one-hot targets, whatever q says)."""
    return replace(config, random="stream") if config.random == "auto" else config


def check_grammar_bug(name: str, config) -> None:
    """ValueError when the injection `name` does not apply to this SpecConfig (checked before any model loads)."""
    if name not in GRAMMAR_BUGS + GRAMMAR_NON_BUGS:
        raise ValueError(f"unknown grammar bug {name!r}; choose one of: {', '.join(GRAMMAR_BUGS + GRAMMAR_NON_BUGS)}")
    if name in _Q_BUGS and (config.draft != "model" or config.tree is not None or config.random not in _STREAM):
        raise ValueError(
            f"{name} breaks a draft model's sampled chains: it needs draft=model (a --draft PATH), no tree, and "
            "the stream randomness (coupled or position-seeded drafts are verified otherwise)"
        )
    if name == "grammar-stale-mask" and config.draft == "none":
        raise ValueError("grammar-stale-mask breaks the masks of a step's drafts: it needs a drafter")


def inject_grammar_bug(gen, name: str) -> None:
    """Break `gen` (a SpeculativeGenerator, built with `stream_config`) in place with the grammar bug `name`."""
    check_grammar_bug(name, gen.config)
    core = gen.core
    if name == "grammar-stale-mask":
        fresh = core.grammar_state  # the engine's: a request's GrammarState, or None without a constraint

        def stale_state(req):
            state = fresh(req)
            return None if state is None else StaleMaskGrammar(state)

        core.grammar_state = stale_state
        return
    if not isinstance(gen.proposer, DraftModelProposer) or gen.proposer.tree is not None:
        raise ValueError(f"{name} breaks a draft model's chains; this generator drafts with {gen.proposer!r}")
    gen.proposer = core.proposer = UnmaskedDraft(gen.proposer, renormalized=name == "grammar-q-unmasked")


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


class _UnmaskedView(BatchView):
    """The engine's BatchView whose processed distributions ignore the grammar (every token allowed)."""

    @classmethod
    def of(cls, view: BatchView) -> _UnmaskedView:
        return cls(**{f.name: getattr(view, f.name) for f in fields(view)})

    def probs(self, logits, output_counts=None, recent=None, allowed=None, valid=None):
        everything = torch.ones(logits.shape, dtype=torch.bool, device=logits.device)
        return super().probs(logits, output_counts, recent, everything, valid)


class UnmaskedDraft:
    """A DraftModelProposer that drafts from its unmasked q, its chain handed to verification as a one-child tree
    (module docstring) with that q (renormalized=False: lossless) or with q masked by each slot's grammar mask and
    renormalized (renormalized=True: the bug)."""

    def __init__(self, inner: DraftModelProposer, renormalized: bool):
        self.inner = inner
        self.renormalized = renormalized

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def propose(self, view: BatchView, caps: list[int]) -> Draft:
        if view.grammars is None:
            return self.inner.propose(view, caps)
        draft = self.inner.propose(_UnmaskedView.of(view), caps)
        if draft.probs is None or max(draft.num_nodes, default=0) == 0:
            return draft
        q = draft.probs
        if self.renormalized:
            allowed = view.node_context(draft.token_ids, draft.parents).allowed  # [B, N + 1, V]: each slot's mask
            S = min(q.shape[1], allowed.shape[1])
            masked = q[:, :S] * allowed[:, :S].to(q.dtype)
            q = q.clone()
            q[:, :S] = masked / masked.sum(-1, keepdim=True).clamp_min(torch.finfo(q.dtype).tiny)
        return replace(draft, probs=q, chain=False)
