"""Chain verification: the exact speculative-sampling rule of Leviathan et al. (2023), batched.

Notation: p = target distribution, q = draft distribution. For a draft token t at position j,
    accept t            iff  u * q(t) < p(t),  u ~ U[0, 1)     (so P(accept) = min(1, p(t) / q(t)))
    at the first reject      draw from the residual (p - q)+ / Z,  Z = sum (p - q)+ = 1 - alpha
    after k accepts          draw a bonus token from p at position k + 1.
Then P(emit x) = q(x) min(1, p(x)/q(x)) + (1 - alpha) (p(x) - q(x))+ / (1 - alpha)
              = min(p(x), q(x)) + (p(x) - q(x))+ = p(x):  the output follows p exactly.

Properties that the implementation keeps (each is tested):
  * strict `<` with u in [0, 1): a token with p(t) = 0 is never accepted, not even when u = 0;
  * the residual is built lazily, only at each row's stopping position, in reused buffers (`workspace`);
  * Z = 0 (p == q) cannot produce NaN: the row falls back to p (unreachable in exact arithmetic,
    since a rejection needs p(t) < q(t); detecting it costs one host sync per call);
  * acceptance and the final draw use separate uniforms: row b consumes exactly
    num_draft_tokens[b] + 1 uniforms from its generator, whatever the outcome, in this order:
    the acceptance uniforms for its drafts, then one for the recovered / bonus draw;
  * a one-hot p (greedy) gives exact-match verification and the argmax as the final token, for any uniforms;
  * no Python loop over positions or vocabulary; the only loop over rows draws each row's uniforms
    from its own generator (per-request seeds make that unavoidable), so a row's output does not
    depend on the rest of the batch.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["ChainVerifyOutput", "draw_uniforms", "sample_from_weights", "verify_chain", "verify_chain_with_uniforms"]


@dataclass(frozen=True)
class ChainVerifyOutput:
    """What chain verification (`verify_chain`, `verify_block`) returns.

    Attributes:
        token_ids: [B, k + 1] int64: the accepted drafts, then the recovered or bonus token, then -1 padding.
        num_accepted: [B] int64: accepted drafts per row; each row emits `num_accepted + 1` tokens.
    """

    token_ids: Tensor  # [B, k + 1] int64: accepted drafts, then the recovered or bonus token, then -1
    num_accepted: Tensor  # [B] int64: accepted drafts per row; emitted tokens = num_accepted + 1

    @property
    def num_emitted(self) -> Tensor:  # [B] int64
        """[B] int64: tokens emitted per row (`num_accepted + 1`)."""
        return self.num_accepted + 1


def _prob_tol(dtype: torch.dtype) -> float:
    return 1e-3 if dtype in (torch.float32, torch.float64) else 2e-2


def check_probability_rows(name: str, probs: Tensor, used: Tensor) -> None:
    """Raise ValueError unless every row probs[b, j] with used[b, j] is a distribution (finite, >= 0, sums to 1).
    probs [B, T, V], used [B, T] bool."""
    sums = probs.sum(dim=-1)  # [B, T]; NaN / inf propagate into the sum
    mins = probs.amin(dim=-1)
    bad_sum = used & ~((sums - 1.0).abs() <= _prob_tol(probs.dtype))
    if bool(bad_sum.any()):
        b, j = (int(i) for i in bad_sum.nonzero()[0])
        s = float(sums[b, j])
        what = "contain NaN or inf" if s != s or abs(s) == float("inf") else f"sum to {s:.6g}, not 1"
        raise ValueError(f"{name}[{b}, {j}] is not a probability distribution: values {what}")
    bad_min = used & (mins < 0)
    if bool(bad_min.any()):
        b, j = (int(i) for i in bad_min.nonzero()[0])
        raise ValueError(f"{name}[{b}, {j}] has a negative probability ({float(mins[b, j]):.6g})")


def _check_inputs(target_probs: Tensor, draft_token_ids: Tensor, draft_probs: Tensor | None, num_draft: Tensor) -> None:
    """Raise ValueError on any input the math cannot honour. Reads each probability tensor twice."""
    _, K1, V = target_probs.shape
    k = K1 - 1
    pos = torch.arange(K1, device=target_probs.device)
    used_target = pos <= num_draft.unsqueeze(1)  # [B, k + 1]: positions that can be emitted
    used_draft = pos[:k] < num_draft.unsqueeze(1)  # [B, k]: real drafts

    check_probability_rows("target_probs", target_probs, used_target)
    ids_bad = used_draft & ((draft_token_ids < 0) | (draft_token_ids >= V))
    if bool(ids_bad.any()):
        b, j = (int(i) for i in ids_bad.nonzero()[0])
        raise ValueError(f"draft_token_ids[{b}, {j}] = {int(draft_token_ids[b, j])} is outside [0, {V})")
    if draft_probs is not None:
        check_probability_rows("draft_probs", draft_probs, used_draft)
        q_t = draft_probs.gather(-1, draft_token_ids.clamp(0, V - 1).unsqueeze(-1)).squeeze(-1)
        zero_q = used_draft & (q_t <= 0)
        if bool(zero_q.any()):
            b, j = (int(i) for i in zero_q.nonzero()[0])
            raise ValueError(
                f"draft token {int(draft_token_ids[b, j])} at [{b}, {j}] has q = 0 under draft_probs: "
                "draft_probs must be the distribution the token was sampled from"
            )


def _normalise_args(target_probs, draft_token_ids, draft_probs, num_draft_tokens):
    if not isinstance(target_probs, Tensor) or target_probs.dim() != 3:
        raise ValueError("target_probs must be a tensor of shape [B, k + 1, V]")
    if not target_probs.is_floating_point():
        raise ValueError(f"target_probs must be floating point, got {target_probs.dtype}")
    B, K1, V = target_probs.shape
    if K1 < 1 or V < 1:
        raise ValueError(f"target_probs has an empty dimension: shape {tuple(target_probs.shape)}")
    k = K1 - 1
    dev = target_probs.device
    if not isinstance(draft_token_ids, Tensor) or tuple(draft_token_ids.shape) != (B, k):
        shape = tuple(draft_token_ids.shape) if isinstance(draft_token_ids, Tensor) else type(draft_token_ids).__name__
        raise ValueError(
            f"draft_token_ids must have shape [B, k] = [{B}, {k}] to match target_probs "
            f"[B, k + 1, V] = {tuple(target_probs.shape)}, got {shape}"
        )
    if draft_token_ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"draft_token_ids must be int64 (or int32), got {draft_token_ids.dtype}")
    if draft_token_ids.device != dev:
        raise ValueError(f"draft_token_ids is on {draft_token_ids.device}, target_probs on {dev}")
    draft_token_ids = draft_token_ids.long()
    if draft_probs is not None:
        if not isinstance(draft_probs, Tensor) or tuple(draft_probs.shape) != (B, k, V):
            shape = tuple(draft_probs.shape) if isinstance(draft_probs, Tensor) else type(draft_probs).__name__
            raise ValueError(f"draft_probs must have shape [B, k, V] = [{B}, {k}, {V}], got {shape}")
        if not draft_probs.is_floating_point():
            raise ValueError(f"draft_probs must be floating point, got {draft_probs.dtype}")
        if draft_probs.device != dev:
            raise ValueError(f"draft_probs is on {draft_probs.device}, target_probs on {dev}")
        if draft_probs.dtype != target_probs.dtype:
            raise ValueError(
                f"draft_probs is {draft_probs.dtype} but target_probs is {target_probs.dtype}: pass both in one dtype"
            )
    return B, k, V, draft_token_ids, row_counts("num_draft_tokens", num_draft_tokens, B, k, "k", dev)


def row_counts(name: str, counts, B: int, n: int, letter: str, dev) -> Tensor:  # [B] int64 on dev, in [0, n]
    """A per-row count argument (`num_draft_tokens`, `num_nodes`): None means n for every row."""
    if counts is None:
        return torch.full((B,), n, dtype=torch.int64, device=dev)
    if isinstance(counts, (list, tuple)):  # host counts: checked on the host (no device sync)
        if len(counts) != B or not all(isinstance(c, int) and not isinstance(c, bool) for c in counts):
            raise ValueError(f"{name} must be {B} integers, got {counts!r}")
        if any(not 0 <= c <= n for c in counts):
            raise ValueError(f"{name} must lie in [0, {letter}] = [0, {n}], got {list(counts)}")
        return torch.tensor(counts, dtype=torch.int64, device=dev)
    counts = torch.as_tensor(counts)
    if tuple(counts.shape) != (B,) or counts.is_floating_point():
        raise ValueError(
            f"{name} must be an integer tensor of shape [B] = [{B}], got {counts.dtype} {tuple(counts.shape)}"
        )
    counts = counts.to(device=dev, dtype=torch.int64)
    if bool(((counts < 0) | (counts > n)).any()):
        raise ValueError(f"{name} must lie in [0, {letter}] = [0, {n}], got {counts.tolist()}")
    return counts


def draw_uniforms(
    num_draft: Tensor,  # [B] int64 in [0, k]
    k: int,
    generators: Sequence[torch.Generator | None] | None,
    device: torch.device,
    host: Sequence[int] | None = None,  # num_draft as host integers, where the caller has them (no transfer)
) -> tuple[Tensor, Tensor]:  # accept_u [B, k] float64 (0 where unused), final_u [B] float64
    """The uniforms verify_chain consumes: num_draft[b] acceptance uniforms, then one for the final draw; row b
    draws from generators[b] (its numbers independent of other rows), or all from the global generator."""
    B = num_draft.shape[0]
    pos = torch.arange(k, device=device)
    if generators is None:
        u = torch.rand((B, k + 1), dtype=torch.float64, device=device)
    else:
        if isinstance(generators, torch.Generator) or len(generators) != B:
            got = "one generator" if isinstance(generators, torch.Generator) else len(generators)
            raise ValueError(f"generators must have one entry per row: got {got} for {B} rows")
        bad = [g for g in generators if g is not None and not isinstance(g, torch.Generator)]
        if bad:
            raise ValueError(f"generators must be torch.Generator objects or None, got {type(bad[0]).__name__}")
        u = _rows_of_uniforms(
            num_draft.tolist() if host is None else list(host), k + 1, generators, device
        )  # [B, k + 1]
    accept_u = u[:, :k].masked_fill(pos >= num_draft.unsqueeze(1), 0.0)
    final_u = u.gather(1, num_draft.unsqueeze(1)).squeeze(1)
    return accept_u, final_u


def _rows_of_uniforms(
    counts: list[int], width: int, generators: Sequence[torch.Generator | None], device: torch.device
) -> Tensor:  # [B, width] float64: row b holds counts[b] + 1 uniforms from generators[b], then zeros
    """One torch.rand per row, written in place (rows on the generators' device, moved once)."""
    gdev = next((g.device for g in generators if g is not None), torch.device(device))
    gdev = gdev if all(g is None or g.device == gdev for g in generators) else torch.device("cpu")
    u = torch.zeros((len(counts), width), dtype=torch.float64, device=gdev)
    for b, (g, n) in enumerate(zip(generators, counts)):
        if g is not None and g.device != gdev:
            u[b, : n + 1] = torch.rand((n + 1,), dtype=torch.float64, generator=g, device=g.device).to(gdev)
        else:
            torch.rand((n + 1,), dtype=torch.float64, generator=g, device=gdev, out=u[b, : n + 1])
    return u.to(device)


_local = threading.local()


def workspace(name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """A reused scratch tensor of `shape` (uninitialised), one per name and thread: the hot path's large
    temporaries (fresh multi-MB allocations cost page faults on CPU). Valid until the next call with this name."""
    pool = _local.__dict__.setdefault("pool", {})
    n = math.prod(shape)
    buf = pool.get(name)
    if buf is None or buf.numel() < n or buf.dtype != dtype or buf.device != torch.device(device):
        with torch.inference_mode(False):  # a normal tensor: writable inside and outside inference mode alike
            buf = pool[name] = torch.empty((n,), dtype=dtype, device=device)
    return buf[:n].view(shape)


def sample_from_weights(
    weights: Tensor,  # [B, V] non-negative float
    u: Tensor,  # [B] float64 in [0, 1)
    block: int = 256,
    fallback: Tensor | None = None,  # [B, V]: rows of weights with no mass sample from this row instead
) -> Tensor:  # [B] int64: the first index whose cumulative weight exceeds u * total
    """Inverse-CDF sampling with one explicit uniform per row; never returns a zero-weight index.

    Two levels, so no [B, V] temporary is built: pick a block of `block` tokens from the block masses
    (float64 cumulative sums over float32 block sums), then a token inside it (float64 cumulative sum).
    A token's probability is exact up to the float rounding of the inputs (relative ~1e-7 in float32).
    Each row of `weights` needs positive mass, or a `fallback` row that has it (checked with one host sync).
    """
    B, V = weights.shape
    n_full = V // block
    mass = torch.empty((B, n_full + 1), dtype=weights.dtype, device=weights.device)  # [B, n_blocks]
    torch.sum(weights[:, : n_full * block].unflatten(1, (n_full, block)), dim=-1, out=mass[:, :n_full])
    torch.sum(weights[:, n_full * block :], dim=-1, out=mass[:, n_full])  # 0 when V % block == 0
    mass = mass.to(torch.float64)
    cdf = mass.cumsum(dim=1)  # monotone: the first block with cdf > x has positive mass
    total = cdf[:, -1:]
    if fallback is not None:
        empty = total <= 0  # [B, 1]: Z = 0 (inexact arithmetic only)
        if bool(empty.any()):
            return sample_from_weights(torch.where(empty, fallback, weights), u, block)
    x = torch.minimum(u.unsqueeze(1) * total, torch.nextafter(total, torch.zeros_like(total)))  # [B, 1], x < total
    blk = torch.searchsorted(cdf, x, right=True)  # [B, 1]
    x = x - (cdf.gather(1, blk) - mass.gather(1, blk))  # mass left to cover inside the chosen block
    cols = blk * block + torch.arange(block, device=weights.device)  # [B, block]
    inside = weights.gather(1, cols.clamp(max=V - 1)).to(torch.float64) * (cols < V)  # [B, block]
    cum = inside.cumsum(dim=1)
    last = cum[:, -1:]
    x = torch.minimum(x.clamp_min(0.0), torch.nextafter(last, torch.zeros_like(last)))
    return (blk * block + torch.searchsorted(cum, x, right=True)).squeeze(1)


def verify_chain_with_uniforms(
    target_probs: Tensor,
    draft_token_ids: Tensor,
    draft_probs: Tensor | None,
    num_draft: Tensor,
    accept_u: Tensor,
    final_u: Tensor,
) -> ChainVerifyOutput:
    """Token-wise chain verification with the randomness given explicitly; inputs are assumed valid.

    `verify_chain` checks its inputs, draws the uniforms from per-request generators and calls this.

    Args:
        target_probs: [B, k + 1, V] float: processed target distributions; row k is the bonus position.
        draft_token_ids: [B, k] int64: the drafted tokens.
        draft_probs: [B, k, V] float: the distributions the drafts were sampled from, or None for one-hot drafts.
        num_draft: [B] int64 in [0, k]: row b uses its first num_draft[b] drafts.
        accept_u: [B, k] float64 in [0, 1): the acceptance uniforms (entries at and beyond num_draft unused).
        final_u: [B] float64 in [0, 1): the uniform of the recovered or bonus draw.

    Returns:
        The accepted tokens and counts, as `verify_chain`.
    """
    _, K1, V = target_probs.shape
    k = K1 - 1
    pos = torch.arange(K1, device=target_probs.device)
    ids = draft_token_ids.clamp(0, V - 1)  # padding (-1) must not index; masked out below

    p_t = target_probs[:, :k].gather(-1, ids.unsqueeze(-1)).squeeze(-1).to(torch.float64)  # [B, k]
    if draft_probs is None:
        q_t = torch.ones_like(p_t)
    else:
        q_t = draft_probs.gather(-1, ids.unsqueeze(-1)).squeeze(-1).to(torch.float64)  # [B, k]
    accept = (accept_u * q_t < p_t) & (pos[:k] < num_draft.unsqueeze(1))  # [B, k]
    num_accepted = accept.to(torch.int64).cumprod(dim=1).sum(dim=1)  # [B]: length of the accepted prefix
    rejected = num_accepted < num_draft  # [B]: stopped at a draft (recovered) rather than after all (bonus)
    residual, p_row = _residual_at_stop(target_probs, ids, draft_probs, num_accepted, rejected)
    final = sample_from_weights(residual, final_u, fallback=p_row)  # [B]; Z = 0 (inexact arithmetic): p
    return ChainVerifyOutput(token_ids=emitted(draft_token_ids, num_accepted, final), num_accepted=num_accepted)


def emitted(ids: Tensor, num_accepted: Tensor, final: Tensor) -> Tensor:  # [B, k + 1] int64
    """A step's tokens: the first num_accepted[b] of ids [B, k] (a path's tokens), then final [B], then -1."""
    B, k = ids.shape
    on_path = torch.arange(k, device=ids.device) < num_accepted.unsqueeze(1)
    tok = torch.cat([torch.where(on_path, ids, -1), torch.full((B, 1), -1, dtype=torch.int64, device=ids.device)], 1)
    return tok.scatter_(1, num_accepted.unsqueeze(1), final.unsqueeze(1))


def _residual_at_stop(
    target_probs: Tensor,  # [B, k + 1, V]
    ids: Tensor,  # [B, k] int64 draft tokens (padding clamped into [0, V))
    draft_probs: Tensor | None,  # [B, k, V] or None (one-hot drafts)
    num_accepted: Tensor,  # [B] int64
    rejected: Tensor,  # [B] bool
) -> tuple[Tensor, Tensor]:  # residual (p - q)+ [B, V] (p on bonus rows), p at the stop [B, V]: workspace views
    """(p - q)+ at each row's stopping position only, in two reused [B, V] buffers (no fresh large
    temporaries, and full-vocabulary passes only, no [B, 1]-broadcast masked ops: those are slow on CPU)."""
    B, K1, V = target_probs.shape
    k = K1 - 1
    dev, dtype = target_probs.device, target_probs.dtype
    row0 = torch.arange(B, device=dev)
    p_row = workspace("p_row", (B, V), dtype, dev)
    torch.index_select(target_probs.reshape(B * K1, V), 0, row0 * K1 + num_accepted, out=p_row)
    residual = workspace("residual", (B, V), dtype, dev)
    stop = num_accepted.clamp(max=max(k - 1, 0))
    if k > 0 and draft_probs is not None:  # q at the stopping position, zeroed on bonus rows
        q_flat = draft_probs.reshape(B * k, V)
        torch.index_select(q_flat if q_flat.dtype == dtype else q_flat.to(dtype), 0, row0 * k + stop, out=residual)
        # a bonus row's q slot may hold garbage (NaN, inf): the product with 0 is 0 or NaN, and nan_to_num zeroes
        # it; a rejected row's q is a distribution, which neither step changes
        residual.mul_(rejected.to(dtype).unsqueeze(1)).nan_to_num_(0.0, 0.0, 0.0)
        torch.sub(p_row, residual, out=residual).clamp_min_(0.0)
    else:  # one-hot q: (p - onehot(t))+ is p with p(t) zeroed
        residual.copy_(p_row)
        if k > 0:
            t = ids.gather(1, stop.unsqueeze(1))  # [B, 1]
            residual.scatter_(1, t, torch.where(rejected.unsqueeze(1), 0.0, residual.gather(1, t)))
    return residual, p_row


def verify_chain(
    target_probs: Tensor,
    draft_token_ids: Tensor,
    draft_probs: Tensor | None = None,
    num_draft_tokens: Tensor | Sequence[int] | None = None,
    generators: Sequence[torch.Generator | None] | None = None,
    *,
    check: bool = True,
) -> ChainVerifyOutput:
    """Verify a batch of draft chains against the target, exactly (token-wise; Leviathan et al. 2023).

    Draft i is accepted when `u * q(x_i) < p(x_i)`; at the first rejection a recovered token is drawn from the
    residual `(p - q)+ / Z`; after all k are accepted, a bonus token is drawn from p at position k + 1. Every
    emitted token then follows p. A row with a seeded generator consumes exactly `num_draft_tokens[b] + 1`
    uniforms whatever the outcome, so its output does not depend on the rest of the batch. A temperature-0
    (one-hot) p verifies by exact match and returns plain greedy output.

    Args:
        target_probs: [B, k + 1, V] float: processed target distributions (`probs_from_logits`); the last row is
            the bonus position.
        draft_token_ids: [B, k] int64: the drafted tokens, sampled from `draft_probs`.
        draft_probs: [B, k, V] float: the distributions the drafts were sampled from; None means one-hot drafts
            (a greedy draft, prompt lookup).
        num_draft_tokens: [B] int64: row b uses its first num_draft_tokens[b] drafts (ragged batches; default:
            all k).
        generators: One torch.Generator (or None) per row: per-request seeds. None draws from torch's global
            generator.
        check: Validate the inputs (two read passes); switch it off on a hot path with trusted inputs. Only the
            positions a verification can reach are checked (positions <= num_draft_tokens[b]).

    Returns:
        `token_ids` [B, k + 1] (accepted drafts, then the recovered or bonus token, then -1 padding) and
        `num_accepted` [B].

    Raises:
        ValueError: With `check`, bad input: NaN / inf / negative probabilities, rows not summing to 1, shape /
            dtype / device mismatches, token ids outside [0, V), a draft token with q = 0.
    """
    args = prepared(target_probs, draft_token_ids, draft_probs, num_draft_tokens, generators, check)
    return verify_chain_with_uniforms(target_probs, *args)


def prepared(target_probs, draft_token_ids, draft_probs, num_draft_tokens, generators, check: bool) -> tuple:
    """verify_chain's arguments checked and its uniforms drawn: the rest of `verify_chain_with_uniforms`' arguments."""
    _, k, _, ids, num_draft = _normalise_args(target_probs, draft_token_ids, draft_probs, num_draft_tokens)
    if check:
        _check_inputs(target_probs, ids, draft_probs, num_draft)
    host = num_draft_tokens if isinstance(num_draft_tokens, (list, tuple)) else None
    return ids, draft_probs, num_draft, *draw_uniforms(num_draft, k, generators, target_probs.device, host)
