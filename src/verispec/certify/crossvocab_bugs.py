"""A deliberately broken cross-vocabulary draft, for proving that the generator certificate bites on token-level
intersection (`verispec certify generate --draft OTHER_TOKENIZER_MODEL --inject tli-last-write`).

  tli-last-write   the draft token is drawn from the right law — the draft's probabilities of every draft id
                   standing for a target token, added up — but verification is handed q built from one of those ids
                   alone (the last written: transformers' `AssistantToTargetTranslator` scatters the draft's logits
                   into the target's vocabulary with an index assignment, where of several draft ids with one string
                   the last write wins). Where a pair has such ids with mass (SentencePiece byte fallback beside the
                   ordinary piece, or two pieces one string after normalization), q handed to verification is not the
                   law the drafts came from, and the output is not the target's.

Like the grammar bugs (grammar_bugs.py) it breaks the engine, after the SpeculativeGenerator is built, and runs the
stream randomness (coupled drafts are verified as exact matches of one-hot targets, whatever q says).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ..drafting.base import Draft
from ..drafting.draft_model import DraftModelProposer
from ..drafting.batch import BatchView
from ..sampling.tree import chain_parents

__all__ = ["CROSS_VOCAB_BUGS", "LastWriteDraft", "check_cross_vocab_bug", "inject_cross_vocab_bug"]

CROSS_VOCAB_BUGS = ("tli-last-write",)


def check_cross_vocab_bug(name: str, config) -> None:
    """ValueError when the injection does not apply to this SpecConfig (checked before any model loads)."""
    if name not in CROSS_VOCAB_BUGS:
        raise ValueError(f"unknown cross-vocabulary bug {name!r}; choose one of: {', '.join(CROSS_VOCAB_BUGS)}")
    if config.draft != "model" or config.tree is not None or config.cross_vocab == "slem":
        raise ValueError(
            f"{name} breaks a token-level-intersection draft model's chains: it needs draft=model (a --draft PATH "
            "with another tokenizer), no tree, and cross_vocab auto or tli"
        )
    if config.random not in ("stream", "auto"):
        raise ValueError(f"{name} needs the stream randomness (coupled or position-seeded drafts verify otherwise)")


def inject_cross_vocab_bug(gen, name: str) -> None:
    """Break `gen` (a SpeculativeGenerator over a cross-vocabulary draft, random stream) in place."""
    from ..crossvocab import BridgedRunner

    check_cross_vocab_bug(name, gen.config)
    proposer = gen.proposer
    if not isinstance(proposer, DraftModelProposer) or not isinstance(proposer.runner, BridgedRunner):
        raise ValueError(f"{name} breaks a draft with another tokenizer; this generator's draft shares the target's")
    gen.proposer = gen.core.proposer = LastWriteDraft(proposer)


class LastWriteDraft:
    """A cross-vocabulary DraftModelProposer whose chains are drawn as usual and handed to verification with q
    rebuilt from the same draft logits merged by last write (`VocabMap(merge="last")`)."""

    def __init__(self, inner: DraftModelProposer):
        self.inner = inner
        self.seen: list[torch.Tensor] = []  # [B, V_d] per draft forward of the step: the draft's own logits
        runner = inner.runner
        draft_forward = runner.draft_forward

        def recording(tokens, logits_at="all", parents=None, tree_start=None):
            out = draft_forward(tokens, logits_at, parents, tree_start)
            self.seen.append(out)
            return out

        runner.draft_forward = recording
        self.last = replace(runner.map, merge="last", _spell={})

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def propose(self, view: BatchView, caps: list[int]) -> Draft:
        self.seen = []
        draft = self.inner.propose(view, caps)
        if draft.probs is None or max(draft.num_nodes, default=0) == 0:
            return draft
        q = draft.probs.clone()  # [B, k + 1, V_t]
        B, k = draft.token_ids.shape
        V = self.inner.runner.vocab_size
        for j, logits in enumerate(self.seen[:k]):
            ctx = view.node_context(draft.token_ids[:, :j], chain_parents(B, j, draft.token_ids.device)).at(j)
            q[:, j] = view.probs(self.last.target_logits(logits, V), *ctx)
        return replace(draft, probs=q)
