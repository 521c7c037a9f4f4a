"""A chain draft fitted to each row's grammar before verification (`fit_draft`): cut before a token the grammar
refuses, then extended by the tokens it forces (jump-forward). Exact: a chosen chain cut shorter is still a
deterministic function of the prefix; a sampled chain is never cut (cutting where only some of its tokens are refused
would change the law of those kept; a refused draft has p = 0); jump-forward follows only a fully accepted chain.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..structured.grammar import GrammarState
from .base import Draft, padded

__all__ = ["fit_draft"]


def fit_draft(draft: Draft, grammars: Sequence[GrammarState | None], room: list[int], jump: int) -> Draft:
    """Each chain row cut before its first refused token, then extended by up to `jump` forced tokens (at most room[b]
    tokens in all; room 0 leaves a row as it is). Trees are returned as they are (a refused node has p = 0)."""
    if not draft.chain or not any(g is not None for g in grammars):
        return draft
    ids = draft.token_ids.tolist()  # [B, N]
    rows: list[list[int]] = []
    jumped: list[int] = []  # per row: where its jump-forward tokens begin
    changed = False
    for b, g in enumerate(grammars):
        fitted = chain = ids[b][: draft.num_nodes[b]]
        live = g is not None and room[b] > 0
        if live and draft.probs is None:  # a chosen chain: cut before its first refused token (a sampled one: never)
            fitted = chain[: g.accepts(chain)]
        jumped.append(len(fitted))
        if live:
            fitted = fitted + g.jump(fitted, min(jump, room[b] - len(fitted)))
        changed |= fitted != chain
        rows.append(fitted)
    if not changed:
        return draft  # nothing cut, nothing forced
    new_ids = padded(rows)  # [B, K]
    K, probs = new_ids.shape[1], None
    if draft.probs is not None:  # sampled drafts keep their q; forced ones get a one-hot q
        old = draft.probs
        probs = torch.zeros((old.shape[0], K + 1, old.shape[-1]), dtype=old.dtype, device=old.device)  # [B, K + 1, V]
        width = min(old.shape[1], K + 1)
        probs[:, :width] = old[:, :width]
        for b, r in enumerate(rows):
            for j in range(jumped[b], len(r)):
                probs[b, j] = 0
                probs[b, j, r[j]] = 1
    return Draft.chain_of(new_ids.to(draft.token_ids.device), probs, [len(r) for r in rows])
