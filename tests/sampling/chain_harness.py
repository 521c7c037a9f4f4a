"""Shared harness for distribution tests of chain verification (and deliberately broken variants).

A "case" fixes per-position target distributions p[j] (j = 0..k, row k is the bonus position) and draft
distributions q[j] (or fixed one-hot draft tokens) that do not depend on the prefix, so that the correct
output of a speculative step is: token at position j ~ p[j], independently, for every position reached.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from verispec.certify.stats import GofResult, chisquare_gof
from verispec.sampling import sample_from_weights

LEVEL = 1e-4  # significance level of every single chi-square test in the chain tests


def draw_drafts(q: torch.Tensor, n: int, gen: torch.Generator) -> torch.Tensor:  # q [k, V] -> ids [n, k]
    return torch.stack([torch.multinomial(q[j], n, replacement=True, generator=gen) for j in range(q.shape[0])], 1)


def run_case(sampler, p, q, n, *, onehot_ids=None, ragged=False, seed=0):
    """Run n independent speculative steps. p [k+1, V]; q [k, V] (sampled drafts) or None with
    onehot_ids [k] (deterministic drafts, one-hot q). Returns token_ids [n, k+1], num_accepted [n], num_draft [n]."""
    k1, V = p.shape
    k = k1 - 1
    gen = torch.Generator().manual_seed(seed)
    if q is not None:
        ids = draw_drafts(q, n, gen)
        draft_probs = q.unsqueeze(0).expand(n, k, V).contiguous()
    else:
        ids = onehot_ids.unsqueeze(0).expand(n, k).contiguous()
        draft_probs = None
    num_draft = torch.randint(0, k + 1, (n,), generator=gen) if ragged else None
    target = p.unsqueeze(0).expand(n, k1, V).contiguous()
    torch.manual_seed(seed + 1)
    out = sampler(target, ids, draft_probs, num_draft)
    nd = num_draft if num_draft is not None else torch.full((n,), k)
    return out.token_ids, out.num_accepted, nd


def residual(p_j: torch.Tensor, q_j: torch.Tensor) -> torch.Tensor:
    r = (p_j.double() - q_j.double()).clamp_min(0)
    return r / r.sum()


def position_tests(p, q, token_ids, num_accepted, num_draft, onehot_ids=None) -> dict[str, GofResult]:
    """Chi-square GOF per emitted position (vs p[j]), per recovered position (vs the residual), for the
    bonus position (vs p[k]) and for the number of accepted drafts (vs the product of alphas)."""
    k1, V = p.shape
    k = k1 - 1
    if q is None:
        q = F.one_hot(onehot_ids, V).to(p.dtype)
    tok = token_ids.numpy()
    na = num_accepted.numpy()
    nd = num_draft.numpy()
    emitted = na + 1
    results: dict[str, GofResult] = {}
    for j in range(k1):
        rows = emitted > j
        results[f"pos{j}"] = chisquare_gof(np.bincount(tok[rows, j], minlength=V), p[j].double().numpy())
        if j < k:
            rec = (na == j) & (nd > j)
            if rec.sum() > 0 and residual(p[j], q[j]).sum() > 0:
                results[f"recovered{j}"] = chisquare_gof(np.bincount(tok[rec, j], minlength=V),
                                                         residual(p[j], q[j]).numpy())
    bonus = (na == nd) & (nd == k)
    results["bonus"] = chisquare_gof(np.bincount(tok[bonus, k], minlength=V), p[k].double().numpy())
    alpha = torch.minimum(p[:k].double(), q.double()).sum(-1).clamp(max=1.0).numpy()  # [k]
    full = nd == k
    probs = np.array([np.prod(alpha[:m]) * (1 - alpha[m]) for m in range(k)] + [np.prod(alpha)])
    probs = probs / probs.sum()
    results["num_accepted"] = chisquare_gof(np.bincount(na[full], minlength=k + 1), probs)
    return results


def failing(results: dict[str, GofResult], level: float = LEVEL) -> list[str]:
    return [f"{name}: p={r.pvalue:.3g} (stat {r.statistic:.1f}, dof {r.dof}, n {r.n}, impossible {r.impossible})"
            for name, r in results.items() if r.rejects(level)]


def broken_verify(bug: str | None):
    """A plain vectorized chain verifier with one deliberate bug (None = the correct rule, as a control).

    bugs: resample_from_p, resample_from_abs_diff, swap_p_q, reuse_accept_uniform.
    """
    def verify(target_probs, ids, draft_probs=None, num_draft_tokens=None):
        B, k1, V = target_probs.shape
        k = k1 - 1
        q = draft_probs if draft_probs is not None else F.one_hot(ids, V).to(target_probs.dtype)
        nd = num_draft_tokens if num_draft_tokens is not None else torch.full((B,), k)
        u = torch.rand(B, k, dtype=torch.float64)
        v = torch.rand(B, dtype=torch.float64)
        p_t = target_probs[:, :k].gather(-1, ids.unsqueeze(-1)).squeeze(-1).double()
        q_t = q.gather(-1, ids.unsqueeze(-1)).squeeze(-1).double()
        accept = (u * p_t < q_t) if bug == "swap_p_q" else (u * q_t < p_t)
        accept &= torch.arange(k) < nd.unsqueeze(1)
        na = accept.long().cumprod(1).sum(1)
        rej = na < nd
        rows = torch.arange(B)
        p_row = target_probs[rows, na].double()
        q_row = q[rows, na.clamp(max=k - 1)].double() * rej.unsqueeze(1)
        if bug == "resample_from_p":
            w = p_row
        elif bug == "resample_from_abs_diff":
            w = (p_row - q_row).abs()
        elif bug == "swap_p_q":
            w = torch.where(rej.unsqueeze(1), (q_row - p_row).clamp_min(0), p_row)
        else:
            w = (p_row - q_row).clamp_min(0)
        w = torch.where(w.sum(1, keepdim=True) > 0, w, p_row)
        if bug == "reuse_accept_uniform":
            v = torch.where(rej, u[rows, na.clamp(max=k - 1)], v)
        final = sample_from_weights(w, v)
        tok = torch.where(torch.arange(k) < na.unsqueeze(1), ids, -1)
        tok = torch.cat([tok, torch.full((B, 1), -1)], 1)
        tok[rows, na] = final

        class Out:
            token_ids, num_accepted = tok, na
        return Out()
    return verify
