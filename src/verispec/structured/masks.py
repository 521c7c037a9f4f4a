"""The grammar inside a speculative step: the mask at every slot of a draft (`allowed_at_nodes`), which the draft's
q and the target's p both read through `BatchView.node_context`, so that they agree at every node."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .grammar import GrammarState

__all__ = ["allowed_at_nodes", "root_allowed"]


def root_allowed(grammars: Sequence[GrammarState | None], vocab_size: int, device) -> Tensor | None:
    """[B, V] bool: each row's mask at its committed state (slot 0 of a draft with no node); None: no grammar."""
    empty = torch.empty((len(grammars), 0), dtype=torch.int64, device=device)
    allowed = allowed_at_nodes(grammars, empty, empty, vocab_size)
    return None if allowed is None else allowed[:, 0]


def allowed_at_nodes(
    grammars: Sequence[GrammarState | None],
    token_ids: Tensor,  # [B, N] int64: draft tokens, -1 padding (a padding slot gets the root's mask)
    parents: Tensor,  # [B, N] int64: -1 = child of the root, else an earlier node
    vocab_size: int,
) -> Tensor | None:  # [B, N + 1, V] bool: the mask at the root (slot 0) and after node n (slot n + 1); None: none
    """Each slot's grammar mask, from the path of drafts to it (chains and trees alike)."""
    if not any(g is not None for g in grammars):
        return None
    B, N = token_ids.shape
    ids, par = token_ids.tolist(), parents.tolist()
    out = torch.ones((B, N + 1, vocab_size), dtype=torch.bool)
    for b, g in enumerate(grammars):
        if g is None:
            continue
        paths: list[tuple[int, ...]] = [()]
        for n in range(N):
            t = ids[b][n]
            paths.append(() if t < 0 else paths[par[b][n] + 1] + (t,))
        out[b] = torch.stack([g.mask(p) for p in paths])
    return out.to(token_ids.device)
