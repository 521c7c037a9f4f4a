"""Deliberately broken EAGLE-3 heads, for proving that the generator certificate bites on a head's draft vocabulary
(`verispec certify generate --draft EAGLE3_HEAD_DIR --inject NAME`).

An EAGLE-3 head's output layer covers a draft vocabulary of V_d ids, draft id i standing for target id i + d2t[i];
verispec scatters its logits to those target ids and puts every other id FLOOR below the row's lowest
(`verispec.heads.scatter_logits`: probability 0), and the drafted token is drawn from exactly that q. Both bugs
draw each draft as verispec does and hand verification another q, built from the same head logits:

  head-no-d2t       q left in draft-vocabulary ids: the head's logits at ids 0 .. V_d - 1 instead of i + d2t[i]
                    (an engine that maps the sampled token through d2t but not the probabilities). The drafted
                    token t is verified with q(t) = the head's probability of draft id t (0 for t >= V_d).
  head-full-vocab   q over the full vocabulary: the head's logits scattered into a zero-filled target row (where a
                    row of -inf belongs), so the ids outside the draft vocabulary get mass they are never drafted
                    with; every drafted token is verified with q(t) scaled down by the mass outside, accepted too
                    often, and the residual (p - q)+ lacks what q put outside. How far the output is from the
                    target's depends on that mass: large for a head whose logits sit near 0 and its draft
                    vocabulary misses ids, nothing for one that covers the whole vocabulary (refused).

Like the cross-vocabulary bug (crossvocab_bugs.py) they break the engine after the SpeculativeGenerator is built,
chains only, under the stream randomness (coupled drafts are verified as exact matches of one-hot targets, whatever
q says).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ..drafting.base import Draft
from ..drafting.draft_model import DraftModelProposer
from ..drafting.batch import BatchView
from ..sampling.tree import chain_parents

__all__ = ["HEAD_BUGS", "HandedQDraft", "check_head_bug", "inject_head_bug"]

HEAD_BUGS = ("head-no-d2t", "head-full-vocab")


def check_head_bug(name: str, config) -> None:
    """ValueError when the injection does not apply to this SpecConfig (checked before any model loads: a draft
    named by its path must be an EAGLE-3 head's directory)."""
    from ..heads import head_kind

    if name not in HEAD_BUGS:
        raise ValueError(f"unknown head bug {name!r}; choose one of: {', '.join(HEAD_BUGS)}")
    if config.draft != "model" or config.tree is not None:
        raise ValueError(
            f"{name} breaks an EAGLE-3 head's chains: it needs draft=model with a head (--draft HEAD_DIR) and no tree"
        )
    if config.random not in ("stream", "auto"):
        raise ValueError(f"{name} needs the stream randomness (coupled or position-seeded drafts verify otherwise)")
    if config.model is not None and head_kind(config.model) != "eagle3":
        raise ValueError(
            f"{name} breaks an EAGLE-3 head's draft vocabulary: the draft {config.model!r} is not an EAGLE-3 head "
            "directory (config.json with draft_vocab_size)"
        )


def inject_head_bug(gen, name: str) -> None:
    """Break `gen` (a SpeculativeGenerator drafting with an EAGLE-3 head, random stream) in place."""
    from ..heads import PairRunner

    check_head_bug(name, gen.config)
    proposer = gen.proposer
    runner = getattr(proposer, "runner", None)
    ids = getattr(runner, "_ids", None)
    if not isinstance(proposer, DraftModelProposer) or not isinstance(runner, PairRunner) or ids is None:
        raise ValueError(f"{name} breaks an EAGLE-3 head's draft vocabulary; this generator drafts with {proposer!r}")
    if name == "head-no-d2t" and torch.equal(ids.cpu(), torch.arange(len(ids))):
        raise ValueError(f"{name}: the head's d2t is all zeros (draft ids are target ids), there is nothing to break")
    if name == "head-full-vocab" and len(ids) >= runner.vocab_size:
        raise ValueError(f"{name}: the head's draft vocabulary is the whole target vocabulary, nothing lies outside it")
    gen.proposer = gen.core.proposer = HandedQDraft(proposer, name)


class HandedQDraft:
    """An EAGLE-3 head's DraftModelProposer whose chains are drawn as usual and handed to verification with q
    rebuilt from the same head logits as the bug `name` builds it (see the module docstring)."""

    def __init__(self, inner: DraftModelProposer, name: str):
        self.inner, self.bug = inner, name
        self.seen: list[torch.Tensor] = []  # [B, V] per draft forward of the step: the runner's (right) logits
        runner = inner.runner
        forward = runner.forward
        self.ids = runner._ids  # [V_d]: draft id i -> target id i + d2t[i]

        def recording(tokens, logits_at="all", parents=None, tree_start=None):
            out = forward(tokens, logits_at, parents, tree_start)
            self.seen.append(out)
            return out

        runner.forward = recording

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def handed_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The runner's target-vocabulary logits [B, V] -> the broken ones the bug hands verification."""
        own = logits[..., self.ids]  # [B, V_d]: the head's logits, in draft ids
        if self.bug == "head-no-d2t":  # at ids 0 .. V_d - 1, the rest at the runner's floor
            out = logits.amin(-1, keepdim=True).expand_as(logits).clone()
            out[..., : own.shape[-1]] = own
            return out
        out = torch.zeros_like(logits)  # head-full-vocab: a zero-filled row
        out[..., self.ids] = own
        return out

    def propose(self, view: BatchView, caps: list[int]) -> Draft:
        self.seen = []
        draft = self.inner.propose(view, caps)
        if draft.probs is None or max(draft.num_nodes, default=0) == 0:
            return draft
        q = draft.probs.clone()  # [B, k + 1, V]
        B, k = draft.token_ids.shape
        for j, logits in enumerate(self.seen[:k]):  # one head forward per chain position
            ctx = view.node_context(draft.token_ids[:, :j], chain_parents(B, j, draft.token_ids.device)).at(j)
            q[:, j] = view.probs(self.handed_logits(logits), *ctx)
        return replace(draft, probs=q)
