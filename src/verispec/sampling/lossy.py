"""Lossy acceptance rules, opt-in and labelled: they trade exactness for acceptance, so that `verispec certify
study` can measure how far each moves the output from the target's distribution and show that the certificate
catches them. The engine uses them only when told to (a `verispec.engine.verify.Verification` strategy). Same
interface as verify_chain.

  lenient(l)            accept t with probability min(1, p(t) / (l q(t))), l in (0, 1] (Leviathan et al.'s
                        "lenience"; l = 1 is exact); at a rejection draw from (p - q)+ / Z as usual
  typical(eps, delta)   Medusa's typical acceptance: accept t iff p(t) > min(eps, delta exp(-H(p))); at the
                        first rejection draw from p (no residual)
  spec_rl(l)            SPEC-RL's rollout reuse (Liu et al. 2025), q = the old policy's rollout: accept t with
                        probability min(1, l p(t) / q(t)), l >= 1 (the paper's rule at l = 1; its `--bias b` is
                        l = e^b); at the first rejection a fresh draw from p, not from (p - q)+ / Z. Biased: at
                        l = 1 the first position's law is min(p, q) + (1 - alpha) p, not p (the seed's "resample
                        from p" mistake, verispec.certify.bugs' resample_from_p)

`one_step_law_*` give the exact law of the token emitted at the first draft position, for measuring deviations.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

from .chain import ChainVerifyOutput, _normalise_args, draw_uniforms, emitted, sample_from_weights

__all__ = [
    "lenient_verifier",
    "one_step_law_lenient",
    "one_step_law_mismatched_q",
    "one_step_law_spec_rl",
    "one_step_law_typical",
    "spec_rl_verifier",
    "typical_verifier",
]


def draft_q(draft_probs: Tensor | None, ids: Tensor, V: int) -> Tensor:
    """q [B, k, V] in float64: draft_probs, or one-hot at the draft ids for one-hot drafts (None)."""
    return (
        draft_probs.double()
        if draft_probs is not None
        else torch.nn.functional.one_hot(ids.clamp(0, V - 1), V).double()
    )


def finish_chain(ids: Tensor, na: Tensor, w: Tensor, p_row: Tensor, final_u: Tensor) -> ChainVerifyOutput:
    """A chain step's output: the na accepted drafts, then a token drawn with final_u from the weights w [B, V]
    (p_row where w has no mass), then -1."""
    w = torch.where(w.sum(1, keepdim=True) > 0, w, p_row)
    return ChainVerifyOutput(token_ids=emitted(ids, na, sample_from_weights(w, final_u)), num_accepted=na)


def chain_interface(name: str, impl, owner):
    """impl(target_probs, draft_token_ids, draft_probs, num_draft_tokens, generators) -> ChainVerifyOutput as a
    function with verify_chain's interface (its `check` is accepted and ignored), named `name`; reports label it
    as a closure of `owner`, the factory that builds it."""

    def verify(target_probs, draft_token_ids, draft_probs=None, num_draft_tokens=None, generators=None, *, check=True):
        return impl(target_probs, draft_token_ids, draft_probs, num_draft_tokens, generators)

    verify.__name__ = name
    verify.__module__, verify.__qualname__ = owner.__module__, f"{owner.__qualname__}.<locals>.verify"
    return verify


def _verify(accept_fn, residual_fn, target_probs, draft_token_ids, draft_probs, num_draft_tokens, generators):
    B, k, V, ids, nd = _normalise_args(target_probs, draft_token_ids, draft_probs, num_draft_tokens)
    dev = target_probs.device
    accept_u, final_u = draw_uniforms(nd, k, generators, dev)
    p = target_probs.double()  # [B, k + 1, V]
    q = draft_q(draft_probs, ids, V)
    safe = ids.clamp(0, V - 1).unsqueeze(-1)
    accept = accept_fn(accept_u, p[:, :k], q, safe) & (torch.arange(k, device=dev) < nd.unsqueeze(1))
    na = accept.long().cumprod(1).sum(1)
    rows = torch.arange(B, device=dev)
    rejected = na < nd
    p_row = p[rows, na]  # [B, V]
    if k > 0:
        q_row = q[rows, na.clamp(max=k - 1)]
        w = torch.where(rejected.unsqueeze(1), residual_fn(p_row, q_row), p_row)
    else:
        w = p_row
    return finish_chain(ids, na, w, p_row, final_u)


def _chain_verifier(name: str, accept_fn, residual_fn):
    """A function with verify_chain's interface that accepts with accept_fn(u, p, q, ids) and, at the first
    rejection, draws from residual_fn(p, q) (normalised)."""
    return chain_interface(name, functools.partial(_verify, accept_fn, residual_fn), _chain_verifier)


def lenient_verifier(lenience: float):
    if not 0 < lenience <= 1:
        raise ValueError(f"lenience must lie in (0, 1], got {lenience}")

    def accept(u, p, q, safe):  # u [B, k], p / q [B, k, V]
        return u * lenience * q.gather(-1, safe).squeeze(-1) < p.gather(-1, safe).squeeze(-1)

    return _chain_verifier(f"lenient_{lenience:g}", accept, lambda p, q: (p - q).clamp_min(0))


def _typical_threshold(p: Tensor, eps: float, delta: float) -> Tensor:  # p [..., V] -> [...]
    ent = -(p * p.clamp_min(1e-300).log()).sum(-1)
    return torch.minimum(torch.full_like(ent, eps), delta * torch.exp(-ent))


def typical_verifier(eps: float = 0.3, delta: float = 0.09):
    def accept(u, p, q, safe):
        return p.gather(-1, safe).squeeze(-1) > _typical_threshold(p, eps, delta)

    return _chain_verifier(f"typical_{eps:g}_{delta:g}", accept, lambda p, q: p)


def spec_rl_verifier(lenience: float = 1.0):
    """SPEC-RL's reuse rule: accept iff u q(t) < l p(t) (probability min(1, l p / q)); at the first rejection draw
    from p. Lossy for every l (see the module docstring)."""
    if not (math.isfinite(lenience) and lenience >= 1):
        raise ValueError(f"SPEC-RL's lenience must be a finite number >= 1 (1 = the paper's rule), got {lenience}")

    def accept(u, p, q, safe):  # u [B, k], p / q [B, k, V]
        return u * q.gather(-1, safe).squeeze(-1) < lenience * p.gather(-1, safe).squeeze(-1)

    return _chain_verifier(f"spec_rl_{lenience:g}", accept, lambda p, q: p)


def _one_step_law(p: Tensor, q_sampled: Tensor, q_used: Tensor, lenience: float = 1.0) -> Tensor:  # [..., V] each
    """Drafts from q_sampled kept with probability min(1, p / (l q_used)); at a rejection a draw from (p - q_used)+."""
    a = torch.where(q_used > 0, torch.minimum(torch.ones_like(p), p / (lenience * q_used).clamp_min(1e-300)), 0.0)
    acc = q_sampled * a
    r = (p - q_used).clamp_min(0)
    z = r.sum(-1, keepdim=True)
    r = torch.where(z > 0, r / z.clamp_min(1e-300), p)
    return acc + (1 - acc.sum(-1, keepdim=True)) * r


def one_step_law_lenient(p: Tensor, q: Tensor, lenience: float) -> Tensor:  # p, q [..., V] -> [..., V]
    return _one_step_law(p, q, q, lenience)


def one_step_law_typical(p: Tensor, q: Tensor, eps: float = 0.3, delta: float = 0.09) -> Tensor:
    acc = q * (p > _typical_threshold(p, eps, delta).unsqueeze(-1))
    return acc + (1 - acc.sum(-1, keepdim=True)) * p


def one_step_law_spec_rl(p: Tensor, q: Tensor, lenience: float = 1.0) -> Tensor:  # p, q [..., V] -> [..., V]
    """Accepted mass min(q, l p); the rest redrawn from p. At l = 1: min(p, q) + (1 - alpha) p."""
    acc = torch.minimum(q, lenience * p)
    return acc + (1 - acc.sum(-1, keepdim=True)) * p


def one_step_law_mismatched_q(p: Tensor, q_sampled: Tensor, q_used: Tensor) -> Tensor:
    """Drafts sampled from q_sampled, verified as if from q_used (the exact rule otherwise)."""
    return _one_step_law(p, q_sampled, q_used)
