"""Block verification (Sun, Mendlovic, Leviathan, Aharoni, Beirami, Ro, Suresh, "Block verification accelerates
speculative decoding", ICLR 2025): the optimal exact rule for one drafted chain, batched.

Notation (one row; p = target, q = draft): drafts X_1..X_n were sampled X_{i+1} ~ Q_i = q(. | c, X^i); the target
gives P_i = p(. | c, X^i) for i = 0..n (P_n: the bonus position). Token-wise verification stops at the first
rejection; block verification decides the accepted prefix from the whole block:

    rho_0 = 1,   rho_i = min(1, rho_{i-1} P_{i-1}(X_i) / Q_{i-1}(X_i))          (capped prefix ratio)
    Z_i   = sum_x (rho_i P_i(x) - Q_i(x))+                                     (block residual mass, i < n)
    h_i   = Z_i / (Z_i + 1 - rho_i) for 1 <= i < n  (0 where Z_i = 0),   h_n = rho_n
    tau   = the LAST i in 1..n with u_i < h_i (0 if none),  u_i ~ U[0, 1) independent
    emit X_1..X_tau, then Y ~ (rho_tau P_tau - Q_tau)+ / Z_tau if tau < n, Y ~ P_n if tau = n.

Why it is exact (proof sketch; the tests check it to 1e-12 by enumeration on prefix-dependent p and q).
(1) P(tau >= i | X^i) = rho_i. Backwards in i: for i = n it is P(u_n < h_n) = rho_n. For i < n,
    P(tau < i | X^i) = (1 - h_i) E_{X_{i+1} ~ Q_i}[P(tau < i + 1 | X^{i+1})] = (1 - h_i) E[1 - rho_{i+1}], and
    E_{Q_i}[rho_{i+1}] = sum_x min(rho_i P_i(x), Q_i(x)) = rho_i - Z_i, so this is
    (1 - h_i)(1 - rho_i + Z_i) = 1 - rho_i (any h_i works where Z_i + 1 - rho_i = 0: that factor is 0).
(2) Hence the step keeps the prefix x^i with probability W(x^i) = q(x^i) rho_i(x^i), and stops exactly at i with
    probability W(x^i) - sum_y W(x^i y) = q(x^i) Z_i (i < n). Let D(x^i) be the probability that the step ends
    (emits its last token) at or before length i consistently with x^i; the tokens after it come from p.
    Induction on i: W(x^i) + D(x^i) = p(x^i). For y at position i + 1 < n + 1:
        W(x^i y) + [stop at i, Y = y] + D(x^i) P_i(y)
      = q(x^i) min(rho_i P_i(y), Q_i(y)) + q(x^i) (rho_i P_i(y) - Q_i(y))+ + D(x^i) P_i(y)
      = (q(x^i) rho_i + D(x^i)) P_i(y) = p(x^i) P_i(y) = p(x^i y),
    and at i = n the bonus draw gives W(x^n) P_n(y) + D(x^n) P_n(y) = p(x^n y). So every prefix of the output
    (continued by the next steps) has the target's probability: the rule is lossless.
(3) Token-wise verification keeps x^i with probability q(x^i) prod_j min(1, P_{j-1}(x_j) / Q_{j-1}(x_j)) <= W(x^i)
    (the product of capped ratios is at most the capped running product), so block verification's expected
    accepted length sum_i E[rho_i] is never smaller.

Properties that the implementation keeps (each is tested):
  * one-hot drafts (draft_probs None: q = onehot(X)): rho_i = prod P(X_j), Z_i = rho_i (1 - P_i(X_{i+1})), so
    P(tau >= i) equals token-wise verification's and the residual is P_tau with the draft token removed: the same
    output law as token-wise (not the same realised tokens under the same uniforms); a one-hot p (greedy) gives
    exact-match verification and the target's argmax, for any uniforms;
  * strict `<` with u in [0, 1): a prefix through a p = 0 draft has rho = 0, so it is never kept;
  * uniforms as in verify_chain: row b consumes num_draft[b] + 1 of them from its own generator, whatever the
    outcome (the acceptance uniforms of its drafts, then one for the final draw);
  * ragged rows (num_draft[b] < k): the block ends at the row's last real draft (h = rho there), positions past
    it are never read for a decision;
  * the residual is read at each row's stopping position only; Z = 0 falls back to p (inexact arithmetic only).
Cost over token-wise: one read of p and q at the k drafted positions (the block residual masses Z_i), k [B, V]
passes with no [B, k, V] temporary.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .chain import ChainVerifyOutput, _normalise_args, emitted, prepared, sample_from_weights

__all__ = ["block_final_weights", "block_stop_law", "block_terms", "verify_block", "verify_block_with_uniforms"]


def block_terms(
    target_probs: Tensor,  # [B, k + 1, V] float: P_0..P_k
    draft_token_ids: Tensor,  # [B, k] int64 (entries >= num_draft: padding, never read for a decision)
    draft_probs: Tensor | None,  # [B, k, V] float: Q_0..Q_{k-1}; None = one-hot drafts
    num_draft: Tensor,  # [B] int64 in [0, k]
) -> tuple[Tensor, Tensor]:  # rho [B, k + 1] float64 (rho[:, 0] = 1), h [B, k + 1] float64 (h[:, 0] = 0)
    """The prefix ratios rho_i and the stopping thresholds h_i of the module docstring (0 past num_draft)."""
    B, K1, V = target_probs.shape
    k = K1 - 1
    dev = target_probs.device
    pos = torch.arange(1, K1, device=dev)  # [k]: 1..k
    real = pos <= num_draft.unsqueeze(1)  # [B, k]: X_pos is a real draft
    ids = draft_token_ids.clamp(0, V - 1)
    p_t = target_probs[:, :k].gather(-1, ids.unsqueeze(-1)).squeeze(-1).double()  # [B, k]: P_{i-1}(X_i)
    q_t = (
        torch.ones_like(p_t) if draft_probs is None else draft_probs.gather(-1, ids.unsqueeze(-1)).squeeze(-1).double()
    )
    # log rho_i = S_i - max(0, S_1..S_i) with S_i = sum_{j <= i} log(p_t / q_t): the capped running product
    log_ratio = torch.where(real, p_t.log() - q_t.log(), 0.0)  # [B, k]; -inf where p_t = 0
    s = torch.cat([torch.zeros(B, 1, dtype=torch.float64, device=dev), log_ratio.cumsum(1)], 1)  # [B, k + 1]
    rho = (s - s.cummax(1).values).exp()  # [B, k + 1]
    z = block_residual_mass(target_probs, ids, draft_probs, rho, num_draft)  # [B, k]: Z_0..Z_{k-1}
    z_i, rho_i = z[:, 1:], rho[:, 1:k]  # [B, k - 1]: positions 1..k-1
    denom = z_i + (1.0 - rho_i)
    h_mid = torch.where(z_i > 0, z_i / denom.clamp_min(torch.finfo(torch.float64).tiny), 0.0)
    zero = torch.zeros(B, 1, dtype=torch.float64, device=dev)
    h = torch.cat([zero, h_mid, zero], 1) if k > 0 else zero  # [B, k + 1]
    last = num_draft.unsqueeze(1)  # h_n = rho_n at each row's last real draft; 0 past it
    idx = torch.arange(K1, device=dev)
    h = torch.where(idx == last, rho, torch.where(idx < last, h, 0.0))
    h[:, 0] = 0.0  # tau = 0 is the default, not a decision
    return rho, h


def block_residual_mass(
    target_probs: Tensor, ids: Tensor, draft_probs: Tensor | None, rho: Tensor, num_draft: Tensor
) -> Tensor:  # [B, k] float64: Z_i = sum_x (rho_i P_i(x) - Q_i(x))+ for i = 0..k-1 (0 at i >= num_draft)
    B, K1, V = target_probs.shape
    k = K1 - 1
    dev = target_probs.device
    if draft_probs is None:  # q = onehot(X_{i+1}): Z_i = rho_i (1 - P_i(X_{i+1})), since rho_i P_i <= 1
        p_next = target_probs[:, :k].gather(-1, ids.unsqueeze(-1)).squeeze(-1).double()
        z = rho[:, :k] * (1.0 - p_next).clamp_min(0.0)
    else:
        z = torch.zeros(B, k, dtype=torch.float64, device=dev)
        buf = torch.empty(B, V, dtype=target_probs.dtype, device=dev)
        for i in range(k):  # one [B, V] buffer for every position: no [B, k, V] temporary
            # buf = Q_i - rho_i P_i, so Z_i = -sum(min(buf, 0)); a sum in the inputs' dtype (pairwise, relative
            # error ~1e-7 in float32): summing float32 into float64 costs 60x more on CPU
            torch.addcmul(draft_probs[:, i], target_probs[:, i], rho[:, i : i + 1].to(buf.dtype), value=-1, out=buf)
            z[:, i] = buf.clamp_max_(0.0).sum(1).neg().double()
    return torch.where(torch.arange(k, device=dev) < num_draft.unsqueeze(1), z, 0.0)


def block_stop_law(
    target_probs: Tensor, draft_token_ids: Tensor, draft_probs: Tensor | None = None, num_draft_tokens=None
) -> Tensor:  # [B, k + 1] float64: P(tau = i | the drafts), i = 0..k (0 past num_draft)
    """The exact law of the accepted length given the drafts: P(tau = i) = h_i prod_{j > i} (1 - h_j)."""
    _, _, _, ids, nd = _normalise_args(target_probs, draft_token_ids, draft_probs, num_draft_tokens)
    _, h = block_terms(target_probs, ids, draft_probs, nd)
    first = torch.cat([torch.ones_like(h[:, :1]), h[:, 1:]], 1)  # [B, k + 1]: tau = 0 is the default
    suffix = (1.0 - h[:, 1:]).flip(1).cumprod(1).flip(1)  # [B, k]: suffix[:, m] = prod_{j >= m + 1} (1 - h_j)
    return first * torch.cat([suffix, torch.ones_like(h[:, :1])], 1)  # h_i prod_{j > i} (1 - h_j)


def block_final_weights(
    target_probs: Tensor,  # [B, k + 1, V] float
    draft_token_ids: Tensor,  # [B, k] int64
    draft_probs: Tensor | None,  # [B, k, V] float or None (one-hot drafts)
    num_draft: Tensor,  # [B] int64
    rho: Tensor,  # [B, k + 1] float64 (block_terms)
    tau: Tensor,  # [B] int64: the kept prefix length
) -> Tensor:  # [B, V] in target_probs' dtype, positive mass: (rho_tau P_tau - Q_tau)+, or P_n when tau = n
    """The (unnormalised) law of the token emitted after the kept prefix."""
    B, K1, V = target_probs.shape
    k = K1 - 1
    row0 = torch.arange(B, device=target_probs.device)
    p_row = target_probs[row0, tau]  # [B, V]: P_tau
    bonus = tau >= num_draft  # [B]: the whole block was kept, Y ~ P_n
    rho_tau = rho.gather(1, tau.unsqueeze(1)).to(p_row.dtype)  # [B, 1]
    weights = p_row * torch.where(bonus.unsqueeze(1), 1.0, rho_tau)  # rho_tau P_tau, or P_n
    if k > 0:
        stop = tau.clamp(max=k - 1)
        if draft_probs is not None:
            q_row = draft_probs[row0, stop]  # [B, V]: Q_tau (garbage on bonus rows: masked, never multiplied)
            weights = torch.where(bonus.unsqueeze(1), weights, weights - q_row).clamp_min_(0.0)
        else:  # (rho P - onehot(t))+ is rho P with t removed, since rho P(t) <= 1
            t = draft_token_ids.clamp(0, V - 1).gather(1, stop.unsqueeze(1))  # [B, 1]
            weights.scatter_(1, t, torch.where(bonus.unsqueeze(1), weights.gather(1, t), 0.0))
    z = weights.sum(dim=1, keepdim=True)
    return torch.where(z > 0, weights, p_row)  # Z = 0 only in inexact arithmetic: fall back to p


def verify_block_with_uniforms(
    target_probs: Tensor,  # [B, k + 1, V] float: processed target distributions; row k is the bonus position
    draft_token_ids: Tensor,  # [B, k] int64
    draft_probs: Tensor | None,  # [B, k, V] float or None (one-hot drafts)
    num_draft: Tensor,  # [B] int64 in [0, k]
    accept_u: Tensor,  # [B, k] float64 in [0, 1): u_1..u_k (entries >= num_draft unused)
    final_u: Tensor,  # [B] float64 in [0, 1): uniform for the recovered / bonus draw
) -> ChainVerifyOutput:
    """Block verification with explicit randomness; inputs are assumed valid (see verify_block)."""
    B, K1, _ = target_probs.shape
    k = K1 - 1
    dev = target_probs.device
    rho, h = block_terms(target_probs, draft_token_ids, draft_probs, num_draft)
    pos = torch.arange(1, K1, device=dev)
    passed = accept_u < h[:, 1:]  # [B, k]; h = 0 past num_draft and where nothing is left to stop at
    tau = torch.where(passed, pos, 0).amax(1) if k > 0 else torch.zeros(B, dtype=torch.int64, device=dev)  # [B]
    weights = block_final_weights(target_probs, draft_token_ids, draft_probs, num_draft, rho, tau)
    final = sample_from_weights(weights, final_u)  # [B]
    return ChainVerifyOutput(token_ids=emitted(draft_token_ids, tau, final), num_accepted=tau)


def verify_block(
    target_probs: Tensor,
    draft_token_ids: Tensor,
    draft_probs: Tensor | None = None,
    num_draft_tokens: Tensor | None = None,
    generators: Sequence[torch.Generator | None] | None = None,
    *,
    check: bool = True,
) -> ChainVerifyOutput:
    """Verify a batch of draft chains by block verification (Sun et al. 2025), exactly.

    The kept prefix is decided from the whole block (the rule and its proof sketch: the module docstring): it keeps
    the last i whose uniform falls below h_i = Z_i / (Z_i + 1 - rho_i), then draws the next token from
    (rho_i p - q)+ / Z_i, or from p after the whole block. The accepted prefix is at least as long in expectation
    as token-wise verification's, and equal at k = 1 and for one-hot drafts.

    Args:
        target_probs: [B, k + 1, V] float: processed target distributions; the last row is the bonus position.
        draft_token_ids: [B, k] int64: the drafted tokens.
        draft_probs: [B, k, V] float: the distributions the drafts were sampled from; None means one-hot drafts.
        num_draft_tokens: [B] int64: row b uses its first num_draft_tokens[b] drafts (default: all k).
        generators: One torch.Generator (or None) per row: per-request seeds.
        check: Validate the inputs, as `verify_chain`.

    Returns:
        `token_ids` [B, k + 1] and `num_accepted` [B], as `verify_chain`.

    Raises:
        ValueError: With `check`, bad input (as `verify_chain`).
    """
    args = prepared(target_probs, draft_token_ids, draft_probs, num_draft_tokens, generators, check)
    return verify_block_with_uniforms(target_probs, *args)
