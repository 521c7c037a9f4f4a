"""Logits -> processed probability distributions. Pure tensor code, CPU and CUDA.

`probs_from_logits` is the one function that builds both the target's p and the draft's q: speculative
decoding is lossless only when the draft token was sampled from exactly the q handed to verification, and p
is exactly what plain sampling would have used. Using one function with one `SamplingParams` for both
makes that hold by construction.

Processing order (vLLM's for the grammar mask and the token options, then HF transformers' order for the warpers):
   -1. structured output: `allowed` (the grammar's mask at the position; the others -> -inf)
    0. token options: allowed_token_ids (the others -> -inf), bad_words (one-token words -> -inf everywhere;
       a longer word's last token -> -inf where the context ends with its other tokens), logit_bias (added)
    1. repetition penalty (prompt + output tokens), presence and frequency penalties (output tokens)
    2. temperature (0 = greedy: one-hot on the argmax of the logits after 0 and 1, lowest id on ties), applied to the
       logits shifted so that their largest is 0 (the same distribution; no temperature overflows)
    3. top_k   (ties at the k-th value are broken by token id, via a stable sort)
    4. top_p   (keep a token while the mass of the more probable tokens before it is < top_p)
    5. min_p   (drop tokens with probability < min_p * max probability)
    6. softmax

Inside a speculative step each position has its own context: the drafts on the path to it count for the
penalties (`counts_at_nodes`), for the bad words (`recent_at_nodes`) and for the grammar's mask (the matcher's
state after the path: `verispec.structured`), for p and q alike.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .metadata import SamplingMetadata
from .params import SamplingParams
from .tree import tree_ancestors

__all__ = ["counts_at_nodes", "probs_from_logits", "recent_at_nodes", "recent_tokens"]


def _metadata(params, logits: Tensor) -> SamplingMetadata:
    """`params` as the batch's SamplingMetadata (one SamplingParams for all rows, one per row, or built already),
    checked against the logits [B, T, V]."""
    B, V = logits.shape[0], logits.shape[-1]
    meta = params
    if isinstance(params, SamplingParams):
        meta = SamplingMetadata.build([params] * B, V, logits.device)
    elif not isinstance(params, SamplingMetadata):
        rows = list(params)
        if len(rows) != B:
            raise ValueError(f"got {len(rows)} SamplingParams for a batch of {B} rows")
        meta = SamplingMetadata.build(rows, V, logits.device)  # (it refuses anything but SamplingParams)
    meta.check(B, V, logits.device)
    return meta


def probs_from_logits(
    logits: Tensor,
    params: SamplingParams | Sequence[SamplingParams] | SamplingMetadata,
    *,
    prompt_mask: Tensor | None = None,
    output_counts: Tensor | None = None,
    recent_tokens: Tensor | None = None,
    allowed: Tensor | None = None,
    check: bool = True,
) -> Tensor:
    """Turn logits into the processed distribution that sampling (and verification) uses.

    The same function builds the target's p and the draft's q: that is what makes verification exact. The order of
    the steps is the module docstring's (grammar mask, token options, penalties, temperature, top-k/p, min-p).

    ```python
    p = probs_from_logits(target_logits, params)   # [B, k+1, V]
    q = probs_from_logits(draft_logits, params)    # [B, k, V]
    ```

    Args:
        logits: [B, T, V] or [B, V] float: raw model logits.
        params: One SamplingParams for all rows, one per row, or a `SamplingMetadata` built once for the batch.
        prompt_mask: [B, V] bool: the token occurs in the prompt (for the repetition penalty).
        output_counts: [B, T, V] or [B, V]: occurrences in the output so far, per position (`counts_at_nodes`).
        recent_tokens: [B, T, M] or [B, M] int64: each position's last context tokens, most recent first, -1
            padded (`recent_at_nodes`); needed for multi-token bad words (M >= the metadata's `bad_depth`).
        allowed: [B, T, V] or [B, V] bool: the tokens a structured-output grammar allows (`verispec.structured`).
        check: Raise on NaN / +inf logits and on rows with no finite logit, instead of producing NaN.

    Returns:
        The processed distributions, the shape of `logits`, float32 (float64 for float64 logits); rows sum to 1.

    Raises:
        ValueError: With `check`, NaN / +inf logits or a row with no finite logit; mismatched shapes or parameters.
    """
    logits, squeeze = _with_positions(logits)  # [B, T, V]
    meta = _metadata(params, logits)
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    x = _restricted(logits.to(dtype), meta, allowed, recent_tokens, check)
    if meta.any_penalties:
        x = _penalise(x, meta, prompt_mask, output_counts)
    greedy_probs = _greedy(x, check) if meta.any_greedy else None
    if meta.all_greedy:
        return greedy_probs.squeeze(1) if squeeze else greedy_probs
    if meta.any_temperature:  # (all 1: nothing to divide)
        x = _temperature(x, meta)
    if meta.any_truncation:
        x = _truncate(x, meta)
    if meta.any_min_p:
        x = _min_p(x, meta)
    probs = x.softmax(dim=-1)
    if greedy_probs is not None:
        probs = torch.where(meta.greedy.view(-1, 1, 1), greedy_probs, probs)
    return probs.squeeze(1) if squeeze else probs


def _restricted(x: Tensor, meta: SamplingMetadata, allowed: Tensor | None, recent: Tensor | None, check: bool):
    """Steps -1 and 0 on x [B, T, V]: the grammar's mask, then the token options; with `check`, ValueError for
    NaN / +inf logits, a row with no finite logit, or a position where the masks leave no token."""
    if check and not bool(torch.isfinite(x.amax(dim=-1)).all()):  # NaN and +inf propagate, all -inf stays -inf
        raise ValueError("logits contain NaN or +inf, or a row where every logit is -inf")
    if allowed is not None:
        x = x.masked_fill(~_allowed_mask(allowed, x.shape), float("-inf"))
    elif meta.any_constraint:
        raise ValueError("a row has a structured-output constraint: pass its grammar's mask (`allowed`)")
    x = _token_options(x, meta, recent)
    if check and (meta.blocked is not None or allowed is not None) and not bool(torch.isfinite(x.amax(dim=-1)).all()):
        raise ValueError(
            "every token a row allows has logit -inf (the grammar, allowed_token_ids and bad_words leave nothing)"
        )
    return x


def _greedy(x: Tensor, check: bool) -> Tensor:  # [B, T, V] -> [B, T, V]
    """Step 2 for greedy rows: one-hot on the argmax (lowest id on ties). Without `check`, a position with a NaN or
    +inf logit, or none finite, stays no distribution (NaN), as a sampled row's softmax does."""
    onehot = torch.zeros_like(x).scatter_(-1, x.argmax(dim=-1, keepdim=True), 1.0)
    return onehot if check else onehot.add_(0.0 * x.amax(dim=-1, keepdim=True))


def _temperature(x: Tensor, meta: SamplingMetadata) -> Tensor:  # [B, T, V] -> [B, T, V]
    """Step 2: the logits shifted so that their largest is 0, divided by the temperature. Softmax and the warpers
    after it are shift-invariant, and no temperature overflows (x / t did past |x| > 3.4e38 t: NaN); a greedy row's
    column is 1 (its result is never read)."""
    return (x - x.amax(dim=-1, keepdim=True)) / meta.col("temperature", x.dtype)


def _with_positions(logits) -> tuple[Tensor, bool]:  # ([B, T, V] logits, whether the input was [B, V])
    """logits as [B, T, V] (a [B, V] input gains T = 1); ValueError for anything but a float tensor of those shapes."""
    if not isinstance(logits, Tensor) or not logits.is_floating_point():
        raise ValueError("logits must be a floating-point tensor")
    squeeze = logits.dim() == 2
    if squeeze:
        logits = logits.unsqueeze(1)
    if logits.dim() != 3:
        raise ValueError(f"logits must have shape [B, V] or [B, T, V], got {tuple(logits.shape)}")
    return logits, squeeze


def _allowed_mask(allowed: Tensor, shape: torch.Size) -> Tensor:  # [B, T, V] bool
    """A grammar mask ([B, V] or [B, T, V] bool) checked against the logits' [B, T, V] shape."""
    if not isinstance(allowed, Tensor) or allowed.dtype != torch.bool:
        raise ValueError("allowed must be a bool tensor")
    if allowed.dim() == 2:
        allowed = allowed.unsqueeze(1)
    B, T, V = shape
    if allowed.dim() != 3 or allowed.shape[0] != B or allowed.shape[1] not in (1, T) or allowed.shape[2] != V:
        raise ValueError(f"allowed must have shape [B, V] or [B, T, V] = [{B}, {T}, {V}], got {tuple(allowed.shape)}")
    return allowed


def _min_p(x: Tensor, meta: SamplingMetadata) -> Tensor:  # [B, T, V] -> [B, T, V]
    """Step 5: -inf where a token's probability is below min_p times the position's largest."""
    probs = x.softmax(dim=-1)
    threshold = meta.col("min_p", x.dtype) * probs.amax(dim=-1, keepdim=True)
    return x.masked_fill(probs < threshold, float("-inf"))


def _token_options(x: Tensor, meta: SamplingMetadata, recent: Tensor | None) -> Tensor:
    """Step 0: allowed_token_ids and one-token bad words (-inf), multi-token bad words, logit_bias (vLLM's order)."""
    B, T = x.shape[:2]
    if meta.blocked is not None:
        x = x.masked_fill(meta.blocked.unsqueeze(1), float("-inf"))
    if meta.bad_depth:
        x = _ban_bad_words(x, meta, recent)
    if meta.bias_ids is not None:
        K = meta.bias_ids.shape[1]
        x = x.scatter_add(-1, meta.bias_ids.unsqueeze(1).expand(B, T, K), meta.bias_as(x.dtype).expand(B, T, K))
    return x


def _ban_bad_words(x: Tensor, meta: SamplingMetadata, recent: Tensor | None) -> Tensor:
    """-inf on the last token of every multi-token bad word whose other tokens end the position's context; a
    position where that would leave no token keeps its static bans only (the same rule for p, q and plain)."""
    B, T = x.shape[:2]
    M = meta.bad_depth
    if recent is None:
        raise ValueError("multi-token bad_words need recent_tokens (each position's last context tokens)")
    if recent.dim() == 2:
        recent = recent.unsqueeze(1)
    if recent.dim() != 3 or recent.shape[0] != B or recent.shape[1] not in (1, T) or recent.shape[2] < M:
        raise ValueError(
            f"recent_tokens must have shape [B, M'] or [B, T, M'] = [{B}, {T}, >= {M}], got {tuple(recent.shape)}"
        )
    recent = recent[..., :M].to(device=x.device, dtype=torch.int64)
    hit = (recent.unsqueeze(2) == meta.bad_prefix.unsqueeze(1)) | meta.bad_free.unsqueeze(1)  # [B, T', W, M]
    match = (hit.all(-1) & meta.bad_valid.unsqueeze(1)).expand(B, T, -1)  # [B, T, W]
    W = match.shape[-1]
    hits = torch.zeros_like(x).scatter_add_(-1, meta.bad_last.unsqueeze(1).expand(B, T, W), match.to(x.dtype))
    banned = x.masked_fill(hits > 0, float("-inf"))
    return torch.where(torch.isfinite(banned.amax(-1, keepdim=True)), banned, x)


def _penalise(x: Tensor, meta: SamplingMetadata, prompt_mask: Tensor | None, output_counts: Tensor | None) -> Tensor:
    """Step 1: repetition penalty on prompt + output tokens, presence / frequency penalties on output tokens."""
    B, T, V = x.shape
    dtype = x.dtype
    counts = torch.zeros((B, 1, V), dtype=dtype, device=x.device) if output_counts is None else output_counts
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
    rep = meta.col("repetition", dtype)
    x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    return x - meta.col("presence", dtype) * in_output - meta.col("frequency", dtype) * counts


def _truncate(x: Tensor, meta: SamplingMetadata) -> Tensor:
    """Steps 3 and 4: top_k, then top_p, on the temperature-scaled logits (one stable sort)."""
    B, V = x.shape[0], x.shape[-1]
    sorted_x, order = x.sort(dim=-1, descending=True, stable=True)  # [B, T, V]
    rank = torch.arange(V, device=x.device)
    sorted_x = sorted_x.masked_fill(rank >= meta.top_k.view(B, 1, 1), float("-inf"))
    if meta.any_top_p:
        sp = sorted_x.softmax(dim=-1)
        mass_before = sp.cumsum(dim=-1) - sp
        top_p = meta.col("top_p", x.dtype)
        drop = (mass_before >= top_p) & (top_p < 1.0) & (rank > 0)
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
    return torch.empty_like(x).scatter_(-1, order, sorted_x)


def counts_at_nodes(
    output_counts: Tensor,  # [B, V]: token occurrences in the output before the draft
    token_ids: Tensor,  # [B, N] int64: draft tokens; entries < 0 (padding) are not counted
    parents: Tensor,  # [B, N] int64: -1 = child of the root, else an earlier node (a chain: -1, 0, 1, ...)
) -> Tensor:  # [B, N + 1, V]: counts seen at the root (slot 0) and after node n (slot n + 1, its path included)
    """Per-node output counts for penalties inside a speculative step (chains and trees): the distribution after
    node n is conditioned on the path to n, so its penalties count that path's tokens, for p and q alike."""
    B, N = token_ids.shape
    V = output_counts.shape[-1]
    parents = torch.where(token_ids >= 0, parents, -1)  # padding nodes hang off the root
    anc = tree_ancestors(parents)[0].to(output_counts.dtype)  # [B, N, N]
    onehot = torch.zeros((B, N, V), dtype=output_counts.dtype, device=output_counts.device)
    onehot.scatter_(-1, token_ids.clamp(min=0).unsqueeze(-1), (token_ids >= 0).unsqueeze(-1).to(onehot.dtype))
    along = anc @ onehot  # [B, N, V]: tokens on each node's path, itself included
    root = torch.zeros((B, 1, V), dtype=along.dtype, device=along.device)
    return output_counts.unsqueeze(1) + torch.cat([root, along], 1)


def recent_tokens(seqs: Sequence[Sequence[int]], depth: int, device: torch.device | str = "cpu") -> Tensor:
    """[B, depth] int64: each sequence's last `depth` tokens, most recent first, -1 where it is shorter (the
    context multi-token bad words look at; a row's sequence is its prompt + output, pending token included)."""
    rows = [list(s[-depth:])[::-1] if depth else [] for s in seqs]
    return (
        torch.tensor([r + [-1] * (depth - len(r)) for r in rows], dtype=torch.int64).view(len(seqs), depth).to(device)
    )


def recent_at_nodes(
    recent: Tensor,  # [B, M] int64: the last M context tokens before the draft (the root), most recent first
    token_ids: Tensor,  # [B, N] int64: draft tokens; entries < 0 (padding) hang off the root
    parents: Tensor,  # [B, N] int64: -1 = child of the root, else an earlier node (a chain: -1, 0, 1, ...)
) -> Tensor:  # [B, N + 1, M]: the last M tokens at the root (slot 0) and after node n (slot n + 1, n included)
    """Per-node bad-word context inside a speculative step, for chains and trees alike: the position after node n
    sees n, its ancestors (most recent first), then the root's context. p and q are built with the same one."""
    B, N = token_ids.shape
    M = recent.shape[-1]
    if N == 0 or M == 0:
        return recent.unsqueeze(1).expand(B, N + 1, M)
    parents = torch.where(token_ids >= 0, parents, -1)
    cur = torch.arange(N, device=token_ids.device).expand(B, N)  # the node each slot reads next (-1: the root)
    cur = torch.where(token_ids >= 0, cur, -1)  # a padding node's slot (never read) gets the root's context
    behind = torch.zeros((B, N), dtype=torch.int64, device=token_ids.device)  # root tokens read so far
    out = torch.empty((B, N, M), dtype=torch.int64, device=token_ids.device)
    for m in range(M):
        on_path = cur >= 0
        node = cur.clamp(min=0)
        out[:, :, m] = torch.where(on_path, token_ids.gather(1, node), recent.gather(1, behind.clamp(max=M - 1)))
        behind = behind + (~on_path).long()
        cur = torch.where(on_path, parents.gather(1, node), -1)
    return torch.cat([recent.unsqueeze(1), out], 1)
