"""A draft fitted to each row's grammar before verification (`fit_draft`): chains cut before a token the grammar
refuses, then extended by the tokens it forces (jump-forward).

Both keep verification exact. A chosen (deterministic) chain cut shorter is still a deterministic function of the
prefix. A sampled chain is never cut: its drafts were drawn from the q it hands over (masked by the grammar for
the engine's drafters, so never refused but at a dead end; a custom drafter's unmasked q is verified as drawn, a
refused draft having p = 0), and cutting it where only some tokens are refused would change the law of the drafts
kept. Jump-forward tokens follow a chain only where the grammar accepts all of it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..structured.grammar import GrammarState
from .base import Draft

__all__ = ["fit_draft"]


def fit_draft(draft: Draft, grammars: Sequence[GrammarState | None], room: list[int], jump: int) -> Draft:
    """A chain draft fitted to each row's grammar: cut before the first token it refuses, then extended by up to
    `jump` tokens it forces after that (at most room[b] tokens in all; room 0 leaves a row as it is). Trees are
    returned as they are (a refused node has p = 0 and is rejected; the slots below it take a live mask)."""
    if not draft.chain or not any(g is not None for g in grammars):
        return draft
    ids = draft.token_ids.tolist()  # [B, N]
    rows: list[list[int]] = []
    jumped: list[int] = []  # per row: where its jump-forward tokens begin
    changed = False
    for b, g in enumerate(grammars):
        chain = ids[b][: draft.num_nodes[b]]
        fitted = chain
        if g is not None and room[b] > 0:
            if draft.probs is None:  # a chosen chain: cut before its first refused token (a sampled one is not cut)
                fitted = chain[: g.accepts(chain)]
            jumped.append(len(fitted))
            fitted = fitted + g.jump(fitted, min(jump, room[b] - len(fitted)))
        else:
            jumped.append(len(chain))
        changed |= fitted != chain
        rows.append(fitted)
    if not changed:
        return draft  # nothing cut, nothing forced
    K = max((len(r) for r in rows), default=0)
    dev = draft.token_ids.device
    new_ids = torch.full((len(rows), K), -1, dtype=torch.int64)  # [B, K]
    for b, r in enumerate(rows):
        new_ids[b, : len(r)] = torch.as_tensor(r, dtype=torch.int64)
    probs = None
    if draft.probs is not None:  # sampled drafts keep their q; forced ones get a one-hot q
        old = draft.probs
        probs = torch.zeros((old.shape[0], K + 1, old.shape[-1]), dtype=old.dtype, device=old.device)  # [B, K + 1, V]
        width = min(old.shape[1], K + 1)
        probs[:, :width] = old[:, :width]
        for b, r in enumerate(rows):
            for j in range(jumped[b], len(r)):
                probs[b, j] = 0
                probs[b, j, r[j]] = 1
    return Draft.chain_of(new_ids.to(dev), probs, [len(r) for r in rows])
