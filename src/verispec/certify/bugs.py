"""Deliberately broken verification functions (the bugs public engines have shipped: docs/guides/certify.md), each
a drop-in replacement for `verify_chain`, `verify_block` or `verify_tree` that differs from the exact rule in one
place, for `certify kernel --inject BUG` and (through `certify.mutants`) `certify generate --inject BUG`.

Lossless look-alikes (TREE_NON_BUGS) PASS: i.i.d.-sampled children verified with the deterministic rule (that rule
accepts x_i with probability r(x_i) and removes it, which samples r exactly for any candidates drawn independently
of its uniforms: P(emit y) = E_x[1{y = x} r(x) + 1{y != x} (1 - r(x)) r(y) / (1 - r(x))] = r(y)), and a mixed
tree's sampled children verified as chosen.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from ..sampling.block import block_final_weights, block_residual_mass, block_terms
from ..sampling.chain import ChainVerifyOutput, _normalise_args, draw_uniforms, verify_chain
from ..sampling.coupling import onehot_winners
from ..sampling.lossy import chain_interface, draft_q, finish_chain
from ..sampling.tree import TreeVerifyOutput, _TreeWalk, tree_ancestors, verify_tree

__all__ = ["BLOCK_BUGS", "BUGS", "COUPLING_BUGS", "KINDS", "TREE_BUGS", "TREE_NON_BUGS", "broken_block_verifier"]
__all__ += ["broken_coupled_verifier", "broken_tree_verifier", "broken_verifier", "fp32_exponential_race", "raw_q"]

BUGS = (
    "resample_from_p",
    "resample_from_abs_diff",
    "swap_p_q",
    "q_before_temperature",
    "le_zero_uniform",
    "reuse_accept_uniform",
    "bonus_ignores_temperature",
    "wrong_q_raw_logits",
)
TREE_BUGS = (
    "tree_stale_residual",
    "tree_topk_as_sampled",
    "tree_wor_as_iid",
    "tree_mixed_dedup",
    "tree_mixed_chosen_as_sampled",
)
COUPLING_BUGS = ("gumbel_position_unkeyed",)
BLOCK_BUGS = ("block_plain_residual", "block_first_rejection", "block_placeholder_threshold")
TREE_NON_BUGS = ("tree_iid_as_deterministic", "tree_mixed_sampled_as_chosen")  # look wrong, are lossless (docstring)

_Q_TEMPERATURE = 0.7  # q_before_temperature: the draft sampled at this temperature, the verifier saw q at 1
_U_LEVELS = 64  # le_zero_uniform: uniforms on the grid {0, 1/64, ..., 63/64}
_P_TEMPERATURE = 0.7  # bonus_ignores_temperature: the target processed at this temperature, the bonus drawn at 1
_RAW_KEPT = 0.8  # wrong_q_raw_logits: the raw draft mass that top-k kept (Z)
EXP_FLOOR = 2.0**-24  # fp32_exponential_race: the smallest float32 Exp(1) sample vLLM #43150 measured


def broken_verifier(bug: str | None):
    """A chain verifier with one deliberate bug; `None` gives the same straightforward code without a bug
    (a control: it must pass, so failures are the bug's and not the harness's)."""
    if bug is not None and bug not in BUGS:
        raise ValueError(f"unknown bug {bug!r}; choose one of: {', '.join(BUGS)}")
    name = f"broken_verifier_{bug}" if bug else "reference_verifier"
    return chain_interface(name, functools.partial(_broken_chain, bug), broken_verifier)


def _broken_chain(bug, target_probs, draft_token_ids, draft_probs, num_draft_tokens, generators) -> ChainVerifyOutput:
    B, k, V, ids, nd = _normalise_args(target_probs, draft_token_ids, draft_probs, num_draft_tokens)
    dev = target_probs.device
    accept_u, final_u = draw_uniforms(nd, k, generators, dev)  # [B, k], [B] float64
    p = target_probs.double()  # [B, k + 1, V]
    q = draft_q(draft_probs, ids, V)  # [B, k, V]
    if bug == "q_before_temperature":
        q = q.pow(_Q_TEMPERATURE)
        q = q / q.sum(-1, keepdim=True)
    if bug == "wrong_q_raw_logits":
        q = raw_q(q)
    if bug == "swap_p_q":  # the whole rule with the roles exchanged (q treated as the target)
        p = torch.cat([q, p[:, k:]], 1)
        q = target_probs[:, :k].double()
    rows = torch.arange(B, device=dev)
    safe = ids.clamp(0, V - 1)
    p_t = p[:, :k].gather(-1, safe.unsqueeze(-1)).squeeze(-1)  # [B, k]
    q_t = q.gather(-1, safe.unsqueeze(-1)).squeeze(-1)
    if bug == "le_zero_uniform":
        u = torch.floor(accept_u * _U_LEVELS) / _U_LEVELS
        accept = u * q_t <= p_t
    else:
        accept = accept_u * q_t < p_t
    accept &= torch.arange(k, device=dev) < nd.unsqueeze(1)
    na = accept.long().cumprod(1).sum(1)  # [B]
    rejected = na < nd
    p_row = p[rows, na]  # [B, V]
    q_row = q[rows, na.clamp(max=max(k - 1, 0))] * rejected.unsqueeze(1) if k > 0 else torch.zeros_like(p_row)
    if bug == "resample_from_p":
        w = p_row.clone()
    elif bug == "resample_from_abs_diff":
        w = (p_row - q_row).abs()
    else:
        w = (p_row - q_row).clamp_min(0)
    if bug == "bonus_ignores_temperature":  # every draft accepted: p before temperature (p^0.7, renormalized)
        raw = p_row.pow(_P_TEMPERATURE)
        w = torch.where(rejected.unsqueeze(1), w, raw / raw.sum(1, keepdim=True))
    if bug == "reuse_accept_uniform" and k > 0:
        final_u = torch.where(rejected, accept_u[rows, na.clamp(max=k - 1)], final_u)
    return finish_chain(ids, na, w, p_row, final_u)


def raw_q(q: Tensor, kept: float = _RAW_KEPT) -> Tensor:
    """The raw draft distribution that wrong_q_raw_logits hands the verifier for a processed (top-k) q [..., V]:
    kept * q on q's support, the raw mass top-k cut (1 - kept) spread evenly over the tokens where q = 0; with no
    such token, kept * q alone (sub-normalized: the rule reads only q_raw(t) and (p - q_raw)+)."""
    outside = (q <= 0).to(q.dtype)
    count = outside.sum(-1, keepdim=True)
    return kept * q + (1 - kept) * outside / count.clamp_min(1)


def fp32_exponential_race(weights: Tensor, generator: torch.Generator | None = None) -> Tensor:  # [B, V] -> [B]
    """A categorical draw from the rows of `weights` [B, V] (non-negative, any scale) by the exponential race
    argmax_x w(x) / E(x), E i.i.d. Exp(1) in float32 that never falls below EXP_FLOOR = 2^-24 (vLLM #43150: 200M
    float32 exponential samples had their minimum exactly at 2^-24, none below; modelled here as float64 Exp(1)
    samples, -log U, clamped at 2^-24, then cast to float32). Correct for tokens within a factor 2^24 of the winner; a
    token below that can only win when the winner's E exceeds 2^-24 / ratio, so it loses most of its mass (see
    verispec.certify.known_bugs' tail test)."""
    u = torch.empty(weights.shape, dtype=torch.float64, device=weights.device).uniform_(generator=generator)
    e = u.log_().float().neg_().clamp_min_(EXP_FLOOR)  # -log U ~ Exp(1); U = 0 (probability 2^-53) gives inf
    return torch.div(weights.float(), e, out=e).argmax(-1)  # a zero weight scores 0, never above a positive one


def broken_block_verifier(bug: str):
    """A block verifier with one deliberate mistake (BLOCK_BUGS), verify_block's interface."""
    if bug not in BLOCK_BUGS:
        raise ValueError(f"unknown block bug {bug!r}; choose one of: {', '.join(BLOCK_BUGS)}")
    return chain_interface(f"broken_block_verifier_{bug}", functools.partial(_broken_block, bug), broken_block_verifier)


def _broken_block(bug, target_probs, draft_token_ids, draft_probs, num_draft_tokens, generators) -> ChainVerifyOutput:
    B, k, _, ids, nd = _normalise_args(target_probs, draft_token_ids, draft_probs, num_draft_tokens)
    dev = target_probs.device
    accept_u, final_u = draw_uniforms(nd, k, generators, dev)
    rho, h = block_terms(target_probs, ids, draft_probs, nd)  # [B, k + 1] each
    rows, pos = torch.arange(B, device=dev), torch.arange(1, k + 1, device=dev)
    if bug == "block_placeholder_threshold" and k > 0 and draft_probs is not None:
        short = nd < k  # the padding slot nd holds a q: use its residual mass at the last real draft
        z = block_residual_mass(target_probs, ids, draft_probs, rho, torch.full_like(nd, k))  # Z at every slot
        z_n, rho_n = z[rows, nd.clamp(max=k - 1)], rho[rows, nd]
        wrong = torch.where(z_n > 0, z_n / (z_n + 1 - rho_n).clamp_min(1e-300), 0.0)
        h[rows, nd] = torch.where(short & (nd > 0), wrong, h[rows, nd])
    passed = accept_u < h[:, 1:]  # [B, k]
    if bug == "block_first_rejection":
        tau = (passed | (pos > nd.unsqueeze(1))).long().cumprod(1).sum(1).clamp(max=nd)
    else:
        tau = torch.where(passed, pos, 0).amax(1) if k > 0 else torch.zeros_like(nd)
    if bug == "block_plain_residual":
        rho = torch.ones_like(rho)
    w = block_final_weights(target_probs, ids, draft_probs, nd, rho, tau)
    return finish_chain(ids, tau, w, target_probs[rows, tau], final_u)


def broken_coupled_verifier(bug: str):
    """A coupled (Gumbel) chain verifier with one deliberate mistake (COUPLING_BUGS)."""
    if bug not in COUPLING_BUGS:
        raise ValueError(f"unknown coupling bug {bug!r}; choose one of: {', '.join(COUPLING_BUGS)}")

    def impl(target_probs, draft_token_ids, draft_probs, num_draft_tokens, generators):
        B, K1, V = target_probs.shape
        u = torch.rand((B, 1, V), dtype=torch.float64, device=target_probs.device)
        exps = u.neg_().log1p_().neg_().expand(B, K1, V)  # one noise vector per row, for every position
        return verify_chain(onehot_winners(target_probs, exps), draft_token_ids, draft_probs, num_draft_tokens)

    return chain_interface(f"broken_coupled_verifier_{bug}", impl, broken_coupled_verifier)


_WRONG_RULE = {  # bug: (the drafting rule, the rule the broken verifier uses for it instead)
    "tree_topk_as_sampled": ("deterministic", "iid"),
    "tree_wor_as_iid": ("without_replacement", "iid"),
    "tree_iid_as_deterministic": ("iid", "deterministic"),
}


def broken_tree_verifier(bug: str):
    """A tree verifier with one deliberate mistake (TREE_BUGS), or a lossless look-alike in TREE_NON_BUGS."""
    if bug not in TREE_BUGS + TREE_NON_BUGS:
        raise ValueError(f"unknown tree bug {bug!r}; choose one of: {', '.join(TREE_BUGS + TREE_NON_BUGS)}")

    def verify(
        target_probs,
        draft_token_ids,
        parents,
        draft_probs=None,
        num_nodes=None,
        generators=None,
        *,
        rule: str = "deterministic",
        check: bool = True,
        sampled=None,
    ):
        B, N = draft_token_ids.shape
        nn = torch.full((B,), N, dtype=torch.int64) if num_nodes is None else torch.as_tensor(num_nodes).long()
        tree = (target_probs, draft_token_ids.long(), parents.long(), draft_probs, nn)
        if bug == "tree_stale_residual":
            return _stale_residual(*tree, generators, rule, sampled)
        if rule == "mixed" and bug in _MIXED_BUGS and N > 0:
            return _MIXED_BUGS[bug](*tree, generators, sampled)
        used, instead = _WRONG_RULE.get(bug, (None, None))
        return verify_tree(*tree, generators, rule=instead if rule == used else rule, check=False, sampled=sampled)

    verify.__name__ = f"broken_tree_verifier_{bug}"
    return verify


def _stale_residual(target_probs, ids, parents, draft_probs, nn, generators, rule, sampled) -> TreeVerifyOutput:
    """tree_stale_residual behind verify_tree's interface: the uniforms verify_tree would draw, then its walk with the
    bug (after a sibling is rejected, the next one is tested against the old residual: r is not updated)."""
    accept_u, final_u = draw_uniforms(nn, ids.shape[1], generators, target_probs.device)
    if ids.shape[1] == 0 or draft_probs is None:
        rule = "deterministic"
    q = None if rule == "deterministic" else draft_probs
    walk = _StaleResidualWalk(target_probs, ids, parents, q, nn, rule, accept_u, sampled if rule == "mixed" else None)
    return walk.run(final_u)


class _StaleResidualWalk(_TreeWalk):
    """The exact tree walk of sampling.tree but for its one step `reject`, which leaves r as it was."""

    def reject(self, r, q, q_scale, sampled, x, rej) -> None:
        return None  # the bug: no r <- normalise((r - q)+) after a rejection


def _mixed_chosen_as_sampled(target_probs, ids, parents, draft_probs, nn, generators, sampled):
    """Every child whose parent slot has a q (within draft_probs) is tested as if sampled from it."""
    as_sampled = sampled.to(ids.device) | (parents + 1 < draft_probs.shape[1])
    return verify_tree(
        target_probs, ids, parents, draft_probs, nn, generators, rule="mixed", check=False, sampled=as_sampled
    )


def _mixed_sampled_as_chosen(target_probs, ids, parents, draft_probs, nn, generators, sampled):
    """Every child verified as chosen (one-hot q): lossless, see the module docstring."""
    return verify_tree(target_probs, ids, parents, None, nn, generators, rule="deterministic", check=False)


def _mixed_dedup(target_probs, ids, parents, draft_probs, nn, generators, sampled):
    """Sampled children equal to an earlier chosen sibling are removed with their subtrees (the other nodes keep
    their order), and the rest is verified exactly; the path is reported in the caller's node indices."""
    B, N = ids.shape
    dev = ids.device
    sampled = sampled.to(dev)
    valid = torch.arange(N, device=dev) < nn.unsqueeze(1)  # [B, N]
    earlier = torch.ones((N, N), dtype=torch.bool, device=dev).tril(-1)  # [n, m]: m < n
    twin = (parents.unsqueeze(2) == parents.unsqueeze(1)) & (ids.unsqueeze(2) == ids.unsqueeze(1))  # [B, n, m]
    drop = valid & sampled & (twin & earlier & ~sampled.unsqueeze(1)).any(2)
    anc, _ = tree_ancestors(torch.where(valid, parents, -1))  # [B, n, m]: m is n or an ancestor of n
    keep = valid & ~(anc & drop.unsqueeze(1)).any(2)
    new_to_old = torch.sort((~keep).to(torch.int8), dim=1, stable=True).indices  # kept nodes first, in order
    old_to_new = keep.long().cumsum(1) - 1
    old_par = parents.gather(1, new_to_old)
    new_par = torch.where(old_par >= 0, old_to_new.gather(1, old_par.clamp(min=0)), -1)
    slots = torch.cat([torch.zeros((B, 1), dtype=torch.int64, device=dev), new_to_old + 1], 1)  # [B, N + 1]
    S = draft_probs.shape[1]  # slots beyond draft_probs have only chosen children: their q is never read
    q = torch.cat([draft_probs, draft_probs[:, :1].expand(B, N + 1 - S, -1)], 1)

    def take(t: Tensor) -> Tensor:  # [B, N + 1, V], slots renumbered
        return t.gather(1, slots.unsqueeze(-1).expand(-1, -1, t.shape[-1]))

    kept = (take(target_probs), ids.gather(1, new_to_old), new_par, take(q), keep.sum(1))
    out = verify_tree(*kept, generators, rule="mixed", check=False, sampled=sampled.gather(1, new_to_old))
    path = torch.where(out.path >= 0, new_to_old.gather(1, out.path.clamp(min=0)), -1)
    return TreeVerifyOutput(token_ids=out.token_ids, num_accepted=out.num_accepted, path=path)


_MIXED_BUGS = {
    "tree_mixed_dedup": _mixed_dedup,
    "tree_mixed_chosen_as_sampled": _mixed_chosen_as_sampled,
    "tree_mixed_sampled_as_chosen": _mixed_sampled_as_chosen,
}


KINDS = {  # the verifier each kind of bug replaces -> (its bugs and look-alikes, the broken verifier's factory)
    "chain": (BUGS, broken_verifier),
    "block": (BLOCK_BUGS, broken_block_verifier),
    "coupling": (COUPLING_BUGS, broken_coupled_verifier),
    "tree": (TREE_BUGS + TREE_NON_BUGS, broken_tree_verifier),
}
