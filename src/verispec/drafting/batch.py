"""The engine's batch as drafters see it: `BatchView` (token sequences, per-row sampling parameters, generators and
the batch's sampling metadata). The engine builds one per step; drafters build their q through `BatchView.probs`, so
that p and q come from the same processing."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import Tensor

from ..sampling import (
    SamplingMetadata,
    SamplingParams,
    counts_at_nodes,
    probs_from_logits,
    recent_at_nodes,
    recent_tokens,
)
from ..structured.masks import allowed_at_nodes, root_allowed
from ..sampling.randomness import RANDOMNESS, Randomness

__all__ = ["BatchView", "NodeContext"]

STREAM = RANDOMNESS["stream"]
_NORM_TOL = 1e-3  # |sum - 1| a processed distribution may show in float32 (softmax of 10^5 tokens: ~1e-6)
_FAULT = (
    "the model's distribution for this request is not a finite probability distribution (NaN or inf in its "
    "logits, or its options leave no token)"
)


class NodeContext(NamedTuple):
    """What the processing sees at each slot of a draft (the root, then after every node): None where unused."""

    counts: Tensor | None  # [B, N + 1, V]: penalty counts (the output so far and the path's drafts)
    recent: Tensor | None  # [B, N + 1, M] int64: the last context tokens, for multi-token bad words
    allowed: Tensor | None  # [B, N + 1, V] bool: the grammar's mask after the path (structured outputs)

    def at(self, slot: int) -> NodeContext:
        """The context of one slot ([B, V], [B, M], [B, V])."""
        return NodeContext(*(None if x is None else x[:, slot] for x in self))


@dataclass
class BatchView:
    """What the engine shares with proposers. Row b's last token seqs[b][-1] is the pending token:
    emitted, not yet in any model's cache.

    A drafter builds its q with `probs` (the target's p is built the same way, from the same `sampling`), and the
    per-position context of a draft's nodes with `node_context`, so that p and q at a node agree."""

    seqs: list[list[int]]  # prompt + generated tokens per row
    params: list[SamplingParams]
    generators: list[torch.Generator]  # per-row random streams (draft sampling draws from them)
    prompt_mask: Tensor | None = None  # [B, V] bool, for repetition penalties
    output_counts: Tensor | None = None  # [B, V] generated-token counts, for penalties
    vocab_size: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    seeds: list[int] | None = None  # per-row request seeds (the coupling noise's key)
    positions: list[int] | None = None  # per row: the output position of the next token (tokens emitted so far)
    randomness: Randomness = STREAM  # how drafts are drawn: the engine's setting (engine.randomness)
    keyed: list[bool] | None = None  # per row: random=auto couples it (its request carries a seed); None: no row
    sampling: SamplingMetadata | None = None  # params as tensors, built once per batch membership; None: per call
    recent: Tensor | None = None  # [B, M] int64: last context tokens, most recent first (multi-token bad words)
    grammars: list | None = None  # per row: its structured-output GrammarState, or None; None: no row has one
    faults: dict[int, str] = field(default_factory=dict)  # row -> why its distribution was no distribution (`probs`)

    @property
    def coupling(self) -> str | None:  # (the older name) "gumbel" or None (auto: per row, see `keyed`)
        return "gumbel" if self.randomness.name == "gumbel" else None

    @property
    def seeding(self) -> str:  # (the older name) "position" or "stream"
        return "position" if self.randomness.name == "position" else "stream"

    def __post_init__(self):
        depth = (
            self.sampling.bad_depth
            if self.sampling is not None
            else max((getattr(p, "bad_word_depth", 0) for p in self.params), default=0)  # tests may pass None
        )
        if self.recent is None and depth:
            self.recent = recent_tokens(self.seqs, depth, self.device)

    def probs(
        self,
        logits: Tensor,
        output_counts: Tensor | None = None,
        recent: Tensor | None = None,
        allowed: Tensor | None = None,
        valid: Tensor | None = None,  # [B] or [B, T] bool: the rows / slots whose distribution is used (None: all)
    ) -> Tensor:  # logits' shape ([B, V] or [B, T, V]), rows summing to 1
        """The processed distribution of these logits under the rows' params (`probs_from_logits`); output_counts,
        recent and the grammar's mask `allowed` default to the root's (the position after the pending token).

        One row's fault never fails the batch: a row whose distribution is not finite and normalised (NaN or inf
        logits from the model, or options and grammar that leave no token) is recorded in `faults` and gets a
        placeholder distribution (all mass on token 0), so the batch's math goes on for the other rows, whose
        results do not depend on it (every row draws from its own generator); the engine ends that row with an
        error (`GenerationSession`). `valid` limits the check to the slots that are read (padding slots hold junk)."""
        if allowed is None and self.grammars is not None:
            allowed = root_allowed(self.grammars, logits.shape[-1], logits.device)
        probs = probs_from_logits(
            logits,
            self.sampling if self.sampling is not None else self.params,
            prompt_mask=self.prompt_mask,
            output_counts=self.output_counts if output_counts is None else output_counts,
            recent_tokens=self.recent if recent is None else recent,
            allowed=allowed,
            check=False,
        )
        return self._guard(probs, valid)

    def _guard(self, probs: Tensor, valid: Tensor | None) -> Tensor:  # [B, V] or [B, T, V] -> the same
        """Rows of `probs` with a read slot that is not finite and normalised (one sum: NaN and inf propagate into
        it) are recorded in `faults` and replaced by a placeholder distribution; one host sync."""
        total = probs.sum(-1)  # [B] or [B, T]
        ok = (total - 1.0).abs() <= _NORM_TOL
        if valid is not None:
            ok = ok | ~valid.to(ok.device)
        if ok.dim() == 2:
            ok = ok.all(-1)  # [B]
        if bool(ok.all()):
            return probs
        for b in (~ok).nonzero().flatten().tolist():
            self.faults.setdefault(b, _FAULT)
        placeholder = torch.zeros_like(probs[:1])
        placeholder[..., 0] = 1.0
        return torch.where(ok.view(-1, *[1] * (probs.dim() - 1)), probs, placeholder)

    def node_context(self, token_ids: Tensor, parents: Tensor) -> NodeContext:
        """The context at the root (slot 0) and after every node n (slot n + 1) of a draft (token_ids, parents
        [B, N]): penalty counts [B, N + 1, V] (None without penalties), bad-word context [B, N + 1, M] (None
        without multi-token bad words) and the grammar's mask [B, N + 1, V] (None without a constrained row)."""
        counts = None if self.output_counts is None else counts_at_nodes(self.output_counts, token_ids, parents)
        recent = None if self.recent is None else recent_at_nodes(self.recent, token_ids, parents)
        allowed = None
        if self.grammars is not None:
            allowed = allowed_at_nodes(self.grammars, token_ids, parents, self.vocab_size)
        return NodeContext(counts, recent, allowed)
