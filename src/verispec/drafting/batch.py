"""The engine's batch as drafters see it (`BatchView`), built by the engine once per step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import Tensor

from ..sampling import SamplingMetadata, SamplingParams
from ..sampling.processors import counts_at_nodes, probs_from_logits, recent_at_nodes, recent_tokens
from ..sampling.randomness import RANDOMNESS, Randomness
from ..structured.masks import allowed_at_nodes, root_allowed

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
    """What the engine shares with proposers. Row b's last token seqs[b][-1] is the pending token: emitted, not yet in
    any model's cache. A drafter builds its q with `probs` and a draft's per-node context with `node_context`, as the
    target's p is built (from the same `sampling`), so that p and q at a node agree."""

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
    faults: dict[int, str] = field(default_factory=dict)  # row -> why its distribution was no distribution (`settle`)
    bad: Tensor | None = None  # [B] bool: rows whose distribution `probs` replaced (on the device until `settle`)
    sources: list[int] | None = None  # per row: the draft source the engine chose (`Proposer.signals`); None: 0

    def __post_init__(self):
        if self.sampling is not None:
            depth = self.sampling.bad_depth
        else:  # (tests may pass None params)
            depth = max((getattr(p, "bad_word_depth", 0) for p in self.params), default=0)
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
        logits, or options and grammar that leave no token) gets a placeholder (all mass on token 0) and is marked
        in `bad`; the other rows' results do not depend on it, and the engine ends it with an error (`settle`).
        `valid` limits the check to the slots that are read (padding slots hold junk)."""
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
        it) get a placeholder distribution and are marked in `bad`, on the device (no host sync: the step reads
        `bad` with its results, `settle`)."""
        total = probs.sum(-1)  # [B] or [B, T]
        ok = (total - 1.0).abs() <= _NORM_TOL
        if valid is not None:
            ok = ok | ~valid.to(ok.device)
        if ok.dim() == 2:
            ok = ok.all(-1)  # [B]
        self.bad = ~ok if self.bad is None else self.bad | ~ok
        placeholder = torch.zeros_like(probs[:1])
        placeholder[..., 0] = 1.0
        return torch.where(ok.view(-1, *[1] * (probs.dim() - 1)), probs, placeholder)

    def settle(self, rows: list[list[float]]) -> list[list[float]]:
        """The step's results moved to the host, each row led by its `bad` flag: the failed rows recorded in
        `faults`; returns `rows` as they are."""
        for b, row in enumerate(rows):
            if row[0]:
                self.faults.setdefault(b, _FAULT)
        return rows

    def node_context(self, token_ids: Tensor, parents: Tensor) -> NodeContext:
        """The context at the root (slot 0) and after every node n (slot n + 1) of a draft (token_ids, parents
        [B, N]): penalty counts [B, N + 1, V] (None without penalties), bad-word context [B, N + 1, M] (None
        without multi-token bad words) and the grammar's mask [B, N + 1, V] (None without a constrained row)."""
        return NodeContext(
            None if self.output_counts is None else counts_at_nodes(self.output_counts, token_ids, parents),
            None if self.recent is None else recent_at_nodes(self.recent, token_ids, parents),
            None if self.grammars is None else allowed_at_nodes(self.grammars, token_ids, parents, self.vocab_size),
        )
