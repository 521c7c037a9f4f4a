"""Position-keyed token-wise verification: a seeded request's output independent of gamma, batch and timing.

With the classic rule the realised sample depends on where steps end: a position verified as a draft emits
"x~ accepted, else a residual draw", the last position of a step emits a bonus draw from p — two different
functions of the randomness — and the uniforms come from one stream whose offset depends on every earlier step's
draft length. Two changes make every emitted position a function of (p_i, q_i, U(seed, i)) only:

  1. every random number is keyed: U(seed, i, purpose) for output position i and purpose draft / accept / final,
     a counter-based uniform (a hash of the three), never a position in a stream;
  2. the last position of a step is drafted too: the drafter samples one token more than the target is fed
     (x~_{n+1} from q_n, with U(seed, i, draft)), and it is verified against the target's p_n like any draft —
     kept if u q(x~) < p(x~), else replaced from (p_n - q_n)+ / Z — instead of a bonus draw from p_n.

Then at every output position i the token is g(p_i, q_i, U(seed, i, .)) with
    g = x~                          if U_accept q(x~) < p(x~),   x~ = F_q^{-1}(U_draft)
        F_r^{-1}(U_final)           otherwise,                    r = (p - q)+ / Z.
Invariance, by induction on i: the first i tokens agree whatever the step boundaries, so p_i and q_i (functions of
the prefix, for a given target and drafter) agree, and so does g. A draft computed after a rejected token is
discarded and its position re-drafted from the true prefix with the same key: a decision at position j reads only
U(seed, j, .), never a later key, so the re-used key is fresh for everything the prefix depended on.
Exactness: each position is the classic accept / residual step (P(emit y) = min(p, q)(y) + (p - q)+(y) = p(y)) with
its own independent uniforms. Token-wise only: block verification's decision at i reads later positions.

The cost is one draft forward more per step (the last draft's q), nothing on the target's side, and no acceptance:
the step emits as many tokens as the classic one (n accepted + one), its last from an accept/residual mixture.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .chain import ChainVerifyOutput, sample_from_weights
from .coupling import _MASK64, _splitmix64

__all__ = ["ACCEPT", "DRAFT", "FINAL", "keyed_uniform", "keyed_uniforms", "positional_verifier", "verify_positional"]

DRAFT, ACCEPT, FINAL = 1, 2, 3  # the purposes a position's uniforms are keyed by


def keyed_uniform(seed: int, position: int, purpose: int) -> float:
    """U(seed, position, purpose) in [0, 1): 53 bits of a splitmix64 hash of the three."""
    h = _splitmix64(_splitmix64(_splitmix64(seed & _MASK64) ^ (position & _MASK64)) ^ purpose)
    return (h >> 11) * 2.0**-53


def keyed_uniforms(
    seeds: Sequence[int], positions: Sequence[Sequence[int]], purpose: int, device: torch.device | str = "cpu"
) -> Tensor:  # [B, T] float64
    """U(seeds[b], positions[b][t], purpose) for every row b and slot t."""
    values = [[keyed_uniform(s, i, purpose) for i in row] for s, row in zip(seeds, positions)]
    return torch.tensor(values, dtype=torch.float64, device=device)


def verify_positional(
    target_probs: Tensor,  # [B, n + 1, V] float: p at the n + 1 slots the step emits from (slot n: after the fed drafts)
    draft_token_ids: Tensor,  # [B, n + 1] int64: drafts at every slot up to num_fed[b] (slot num_fed[b]: not fed)
    draft_probs: Tensor,  # [B, n + 1, V] float: the q each draft was sampled from
    num_fed: Tensor,  # [B] int64: drafts fed to the target (row b's slots are 0..num_fed[b])
    accept_u: Tensor,  # [B, n + 1] float64: U(seed, position of slot j, ACCEPT)
    final_u: Tensor,  # [B, n + 1] float64: U(seed, position of slot j, FINAL)
    has_last: Tensor | None = None,  # [B] bool: slot num_fed[b] holds a draft (else it is a bonus draw from p)
) -> ChainVerifyOutput:  # token_ids [B, n + 1]; num_accepted [B] in [0, num_fed]: kept fed drafts
    """The module docstring's rule, batched. A row keeps its accepted prefix of fed drafts; the token after it is
    the last slot's draft when every draft up to it was accepted, else a residual draw with that slot's uniform."""
    B, K1, V = target_probs.shape
    dev = target_probs.device
    pos = torch.arange(K1, device=dev)
    ids = draft_token_ids.clamp(0, V - 1)
    present = pos <= num_fed.unsqueeze(1)  # [B, n + 1]
    if has_last is not None:
        present &= (pos < num_fed.unsqueeze(1)) | has_last.to(dev).unsqueeze(1)
    p_t = target_probs.gather(-1, ids.unsqueeze(-1)).squeeze(-1).double()
    q_t = draft_probs.gather(-1, ids.unsqueeze(-1)).squeeze(-1).double()
    accept = (accept_u * q_t < p_t) & present
    run = accept.long().cumprod(1).sum(1)  # [B]: accepted slots, up to num_fed + 1
    kept = torch.minimum(run, num_fed)  # fed drafts kept
    all_kept = run > num_fed  # the last slot's draft is the step's final token
    row0 = torch.arange(B, device=dev)
    p_row = target_probs[row0, kept]  # [B, V]
    q_row = torch.where(present[row0, kept].unsqueeze(1), draft_probs[row0, kept], 0.0)  # 0 without a draft
    w = (p_row - q_row.to(p_row.dtype)).clamp_min(0.0)
    w = torch.where(w.sum(1, keepdim=True) > 0, w, p_row)  # Z = 0 only in inexact arithmetic
    resid = sample_from_weights(w, final_u[row0, kept])
    final = torch.where(all_kept, ids[row0, kept], resid)
    token_ids = torch.where(pos < kept.unsqueeze(1), draft_token_ids, -1)
    token_ids.scatter_(1, kept.unsqueeze(1), final.unsqueeze(1))
    return ChainVerifyOutput(token_ids=token_ids, num_accepted=kept)


def positional_verifier(
    target_probs, draft_token_ids, draft_probs=None, num_draft_tokens=None, generators=None, *, check=True
):
    """verify_chain's interface for certificates (`certify kernel --seeding position`): a row's num_draft[b] drafts
    are its slots 0..num_draft[b] - 1, the last one not fed (verified like the others, no bonus after it); a row
    without drafts draws from p at slot 0. Uniforms from torch's global generator (the same law as keyed ones)."""
    from .chain import _check_inputs, _normalise_args

    B, k, V, ids, nd = _normalise_args(target_probs, draft_token_ids, draft_probs, num_draft_tokens)
    if check:
        _check_inputs(target_probs, ids, draft_probs, nd)
    q = draft_probs if draft_probs is not None else torch.nn.functional.one_hot(ids.clamp(0, V - 1), V).to(target_probs)
    q = torch.cat([q, torch.zeros_like(target_probs[:, :1])], 1)  # [B, k + 1, V]: slot k never holds a draft
    ids = torch.cat([ids, torch.full((B, 1), -1, dtype=torch.int64, device=ids.device)], 1)
    u = torch.rand((2, B, k + 1), dtype=torch.float64, device=target_probs.device)
    return verify_positional(target_probs, ids, q, (nd - 1).clamp(min=0), u[0], u[1], has_last=nd > 0)
