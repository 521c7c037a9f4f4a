"""Logits -> processed probability distributions. Pure tensor code, CPU and CUDA.

`probs_from_logits` is the one function that builds both the target's p and the draft's q: speculative
decoding is lossless only when the draft token was sampled from exactly the q handed to verification, and p
is exactly what plain sampling would have used. Using one function with one `SamplingParams` for both
makes that hold by construction.

Processing order (HF transformers' order for these warpers):
    1. repetition penalty (prompt + output tokens), presence and frequency penalties (output tokens)
    2. temperature (0 = greedy: one-hot on the argmax of the penalised logits, lowest id on ties)
    3. top_k   (ties at the k-th value are broken by token id, via a stable sort)
    4. top_p   (keep a token while the mass of the more probable tokens before it is < top_p)
    5. min_p   (drop tokens with probability < min_p * max probability)
    6. softmax
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .params import SamplingParams
from .tree import tree_ancestors

__all__ = ["counts_at_nodes", "probs_from_logits"]


def _per_row(params: SamplingParams | Sequence[SamplingParams], batch: int) -> list[SamplingParams]:
    if isinstance(params, SamplingParams):
        return [params] * batch
    rows = list(params)
    if len(rows) != batch:
        raise ValueError(f"got {len(rows)} SamplingParams for a batch of {batch} rows")
    for r in rows:
        if not isinstance(r, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(r).__name__}")
    return rows


def probs_from_logits(
    logits: Tensor,  # [B, T, V] or [B, V] float: raw model logits
    params: SamplingParams | Sequence[SamplingParams],  # one for all rows, or one per row
    *,
    prompt_mask: Tensor | None = None,  # [B, V] bool: token occurs in the prompt (repetition penalty)
    output_counts: Tensor | None = None,  # [B, T, V] or [B, V] int/float: occurrences in the output so far
    check: bool = True,
) -> Tensor:  # same shape as logits, float32 (float64 if logits are float64): rows sum to 1
    """Turn logits into the processed distribution that sampling (and verification) uses.

    `output_counts` may differ per position T (a draft position j has seen the drafts before j); see
    `counts_at_nodes`. With `check=True` (default) NaN / +inf logits and rows with no finite
    logit raise ValueError instead of producing NaN probabilities.
    """
    if not isinstance(logits, Tensor) or not logits.is_floating_point():
        raise ValueError("logits must be a floating-point tensor")
    squeeze = logits.dim() == 2
    if squeeze:
        logits = logits.unsqueeze(1)
    if logits.dim() != 3:
        raise ValueError(f"logits must have shape [B, V] or [B, T, V], got {tuple(logits.shape)}")
    B, T, V = logits.shape
    rows = _per_row(params, B)
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    x = logits.to(dtype)
    dev = x.device

    if check:
        row_max = x.amax(dim=-1)  # [B, T]; NaN and +inf propagate, all -inf stays -inf
        if not bool(torch.isfinite(row_max).all()):
            raise ValueError("logits contain NaN or +inf, or a row where every logit is -inf")

    def col(values: list[float]) -> Tensor:  # [B, 1, 1]
        return torch.tensor(values, dtype=dtype, device=dev).view(B, 1, 1)

    if any(r.uses_penalties for r in rows):
        counts = torch.zeros((B, 1, V), dtype=dtype, device=dev) if output_counts is None else output_counts
        if counts.dim() == 2:
            counts = counts.unsqueeze(1)
        if counts.shape[0] != B or counts.shape[-1] != V or counts.shape[1] not in (1, T):
            raise ValueError(
                f"output_counts must have shape [B, V] or [B, T, V] = [{B}, {T}, {V}], got {tuple(counts.shape)}"
            )
        counts = counts.to(dtype)
        in_output = counts > 0
        seen = in_output
        if prompt_mask is not None:
            if tuple(prompt_mask.shape) != (B, V):
                raise ValueError(f"prompt_mask must have shape [B, V] = [{B}, {V}], got {tuple(prompt_mask.shape)}")
            seen = seen | prompt_mask.bool().unsqueeze(1)
        rep = col([r.repetition_penalty for r in rows])
        x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
        x = x - col([r.presence_penalty for r in rows]) * in_output - col([r.frequency_penalty for r in rows]) * counts

    greedy = [r.greedy for r in rows]
    greedy_probs = None
    if any(greedy):
        greedy_probs = torch.zeros_like(x).scatter_(-1, x.argmax(dim=-1, keepdim=True), 1.0)
        if all(greedy):
            return greedy_probs.squeeze(1) if squeeze else greedy_probs

    x = x / col([r.temperature if r.temperature > 0 else 1.0 for r in rows])

    if any(r.uses_truncation for r in rows):
        sorted_x, order = x.sort(dim=-1, descending=True, stable=True)  # [B, T, V]
        rank = torch.arange(V, device=dev)
        top_k = torch.tensor([r.top_k if r.top_k > 0 else V for r in rows], device=dev).view(B, 1, 1)
        sorted_x = sorted_x.masked_fill(rank >= top_k, float("-inf"))
        if any(r.top_p < 1.0 for r in rows):
            sp = sorted_x.softmax(dim=-1)
            mass_before = sp.cumsum(dim=-1) - sp
            top_p = col([r.top_p for r in rows])
            drop = (mass_before >= top_p) & (top_p < 1.0) & (rank > 0)
            sorted_x = sorted_x.masked_fill(drop, float("-inf"))
        x = torch.empty_like(x).scatter_(-1, order, sorted_x)

    if any(r.min_p > 0 for r in rows):
        probs = x.softmax(dim=-1)
        threshold = col([r.min_p for r in rows]) * probs.amax(dim=-1, keepdim=True)
        x = x.masked_fill(probs < threshold, float("-inf"))

    probs = x.softmax(dim=-1)
    if greedy_probs is not None:
        probs = torch.where(torch.tensor(greedy, device=dev).view(B, 1, 1), greedy_probs, probs)
    return probs.squeeze(1) if squeeze else probs


def counts_at_nodes(
    output_counts: Tensor,  # [B, V]: token occurrences in the output before the draft
    token_ids: Tensor,  # [B, N] int64: draft tokens; entries < 0 (padding) are not counted
    parents: Tensor,  # [B, N] int64: -1 = child of the root, else an earlier node (a chain: -1, 0, 1, ...)
) -> Tensor:  # [B, N + 1, V]: counts seen at the root (slot 0) and after node n (slot n + 1, its path included)
    """Per-node output counts for penalties inside a speculative step, for chains and trees alike.

    The distribution after node n is conditioned on the path to n, so its presence / frequency / repetition
    penalties count that path's tokens; p and q are built with the same counts.
    """
    B, N = token_ids.shape
    V = output_counts.shape[-1]
    parents = torch.where(token_ids >= 0, parents, -1)  # padding nodes hang off the root
    anc = tree_ancestors(parents)[0].to(output_counts.dtype)  # [B, N, N]
    onehot = torch.zeros((B, N, V), dtype=output_counts.dtype, device=output_counts.device)
    onehot.scatter_(-1, token_ids.clamp(min=0).unsqueeze(-1), (token_ids >= 0).unsqueeze(-1).to(onehot.dtype))
    along = anc @ onehot  # [B, N, V]: tokens on each node's path, itself included
    root = torch.zeros((B, 1, V), dtype=along.dtype, device=along.device)
    return output_counts.unsqueeze(1) + torch.cat([root, along], 1)
