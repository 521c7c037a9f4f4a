"""Tree verification: lossless multi-draft speculative sampling over a token tree, batched.

A row's tree hangs below the committed prefix (the root). Node n carries a draft token and a parent (-1: a child
of the root, else an earlier node), so siblings appear in the order they were drafted. The target's processed
distribution is known at the root and at every node (one tree-masked target pass); the draft's distribution at
a node is the one its children were drawn from. Verification walks down from the root: at the current node it
tests the children one after another against a running residual r (initially p at that node); the first child
accepted becomes the current node; when every child is rejected, or the node is a leaf, one token is drawn from
r and the walk ends. The row emits the accepted path's tokens and that final token.

One mechanism, three rules (and their mix) — they differ only in the distribution q_i that child i was drawn from,
given the earlier siblings:
  "iid"                  children i.i.d. from q (SpecInfer's multi-round rejection):        q_i = q
  "without_replacement"  children drawn from q without replacement (recursive rejection sampling,
                         Jeon et al. 2024): q_i = q with siblings 1..i-1 removed, renormalised
  "deterministic"        children are chosen, not sampled (top-k of q, n-gram matches, any rule that uses only
                         the draft's side): q_i = one-hot(x_i) — accept x_i with probability r(x_i), the
                         EAGLE / SGLang target-only rule
  "mixed"                each node says (`sampled`) whether it was drawn from its parent slot's q (q_i = q) or
                         chosen (q_i = one-hot): e.g. trie branches from earlier rollouts beside a chain sampled
                         by a draft model. draft_probs may then cover only the first S slots (the slots whose
                         children include sampled ones); the other slots' children are all chosen.
Round i accepts x_i iff u_i * q_i(x_i) < r(x_i) (strict, u in [0, 1)), and on rejection sets
r <- (r - q_i)+ / Z (for one-hot q_i: r with x_i zeroed, renormalised).

Proof sketch. Claim: entering round i with residual r_i, the token the walk emits at this depth has law r_i.
Round i is one step of ordinary speculative sampling with target r_i and proposal q_i: P(accept x) =
q_i(x) min(1, r_i(x)/q_i(x)) = min(r_i(x), q_i(x)), P(reject) = Z_i = sum (r_i - q_i)+. After a rejection the
next round (whatever the next sibling's proposal is, as long as the sibling was drawn from it given the history,
and whether a next sibling exists or not) emits with law r_{i+1} = (r_i - q_i)+ / Z_i by induction (no sibling
left: the final draw is from r_{i+1} itself). So P(emit x) = min(r_i, q_i)(x) + (r_i - q_i)+(x) = r_i(x), and with
r_1 = p the emitted token follows p. An accepted child's subtree was drawn given that child, independently of
the acceptance uniform, so the walk below it repeats the argument with the target's conditional there: the whole
emitted sequence follows the target. Two consequences the code relies on: a rejected x_i has r_i(x_i) < q_i(x_i),
so r_{i+1}(x_i) = 0 — without replacement, later siblings are never x_i and nothing is lost; and Z_i > 0 at every
rejection in exact arithmetic (Z = 0 in floats falls back to r_i, as verify_chain falls back to p).
What a drafter must guarantee: whether sibling i exists may depend on the history (earlier siblings, the path),
never on x_i itself — an EAGLE-2 style global re-ranking of *sampled* nodes by their probability violates this,
so dynamic trees are drafted with deterministic children.

Greedy (a one-hot p): every rule accepts exactly the child equal to the target's argmax, so the walk follows the
longest argmax-matching path (siblings of a deterministic tree are distinct) and emits the target's greedy
continuation.

Randomness: row b consumes exactly num_nodes[b] + 1 uniforms from its generator, whatever the outcome — node n's
acceptance uniform (used at most once, when n is tested), then the final draw's — so rows are independent of the
batch, and no uniform is reused. Loops: over depth levels and sibling ranks (each vectorized over the batch), no
loop over rows or vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from .chain import check_probability_rows, draw_uniforms, sample_from_weights, workspace

__all__ = [
    "TREE_RULES",
    "VERIFY_RULES",
    "TreeVerifyOutput",
    "chain_parents",
    "tree_ancestors",
    "tree_children",
    "verify_tree",
    "verify_tree_with_uniforms",
]

TREE_RULES = ("iid", "without_replacement", "deterministic")  # how a drafter draws the children of a node
VERIFY_RULES = (*TREE_RULES, "mixed")  # what verification accepts: also per-node sampled / chosen children


@dataclass(frozen=True)
class TreeVerifyOutput:
    token_ids: Tensor  # [B, D + 1] int64: the accepted path's tokens, then the recovered / bonus token, then -1
    num_accepted: Tensor  # [B] int64: accepted nodes per row (the path's length); emitted = num_accepted + 1
    path: Tensor  # [B, D] int64: node indices of the accepted path, root's child first, -1 padded
    # (D = the deepest node of the batch, at least 1: an empty tree still gives [B, 2] and [B, 1])

    @property
    def num_emitted(self) -> Tensor:  # [B] int64
        return self.num_accepted + 1


def chain_parents(batch: int, k: int, device: torch.device | str = "cpu") -> Tensor:  # [batch, k] int64
    """The parents of a chain written as a tree: -1, 0, 1, ..., k - 2 (node j hangs below node j - 1)."""
    return (torch.arange(k, device=device) - 1).expand(batch, k).contiguous()


def tree_ancestors(
    parents: Tensor,  # [B, N] int64: -1 = child of the root, else an earlier node (padding: set it to -1)
) -> tuple[
    Tensor, Tensor
]:  # anc [B, N, N] bool (anc[b, n, m]: m is n or an ancestor of n), depth [B, N] (root's children: 1)
    """Ancestor-or-self relation and depth of every node; one pass in node order (parents precede children)."""
    B, N = parents.shape
    anc = torch.eye(N, dtype=torch.bool, device=parents.device).repeat(B, 1, 1)
    rows = torch.arange(B, device=parents.device)
    for n in range(N):
        par = parents[:, n]
        anc[:, n] |= anc[rows, par.clamp(min=0)] & (par >= 0).unsqueeze(1)
    return anc, anc.sum(-1)


def tree_children(
    parents: Tensor,  # [B, N] int64: -1 = child of the root, else an earlier node; entries >= num_nodes ignored
    num_nodes: Tensor,  # [B] int64
) -> tuple[Tensor, Tensor]:  # children [B, N + 1, W] (slot 0 = root, slot n + 1 = node n; -1 padded), depth [B, N]
    """Children of every node in drafting order, and each node's depth (1 for the root's children)."""
    B, N = parents.shape
    dev = parents.device
    valid = torch.arange(N, device=dev) < num_nodes.unsqueeze(1)  # [B, N]
    parents = torch.where(valid, parents, -1)  # padding entries may hold anything
    slot = torch.where(valid, parents + 1, -1)  # [B, N]: parent's slot, -1 for padding
    earlier = torch.ones((N, N), dtype=torch.bool, device=dev).tril(-1)  # [n, n']: n' < n
    same = (slot.unsqueeze(2) == slot.unsqueeze(1)) & valid.unsqueeze(1) & earlier  # [B, N, N]
    rank = same.sum(-1)  # [B, N]: earlier siblings
    W = int(rank.masked_fill(~valid, -1).max()) + 1 if N else 0
    children = torch.full((B, N + 1, max(W, 1)), -1, dtype=torch.int64, device=dev)
    b_idx = torch.arange(B, device=dev).unsqueeze(1).expand(B, N)
    children[b_idx[valid], slot[valid], rank[valid]] = torch.arange(N, device=dev).expand(B, N)[valid]
    depth = tree_ancestors(parents)[1]
    return children, depth.masked_fill(~valid, 0)


def verify_tree_with_uniforms(
    target_probs: Tensor,  # [B, N + 1, V] float: p at the root (slot 0) and after each node (slot n + 1)
    draft_token_ids: Tensor,  # [B, N] int64
    parents: Tensor,  # [B, N] int64
    draft_probs: Tensor | None,  # [B, N + 1, V] float: q each slot's children were drawn from; None: deterministic
    num_nodes: Tensor,  # [B] int64
    rule: str,
    accept_u: Tensor,  # [B, N] float64 in [0, 1): node n's acceptance uniform
    final_u: Tensor,  # [B] float64 in [0, 1): the final draw's uniform
    *,
    sampled: Tensor | None = None,  # [B, N] bool, rule "mixed": node drawn from its parent slot's q (else chosen)
    _stale_residual: bool = False,  # a deliberate bug, for certify.bugs only: r is not updated after a rejection
) -> TreeVerifyOutput:
    """The tree walk with explicit randomness; inputs are assumed valid (see verify_tree)."""
    B, N1, V = target_probs.shape
    N = N1 - 1
    dev = target_probs.device
    rows = torch.arange(B, device=dev)
    children, depth = tree_children(parents, num_nodes)  # [B, N + 1, W], [B, N]
    W = children.shape[-1]
    D = int(depth.max()) if N else 0
    ids = draft_token_ids.clamp(0, V - 1)
    path = torch.full((B, max(D, 1)), -1, dtype=torch.int64, device=dev)
    num_accepted = torch.zeros(B, dtype=torch.int64, device=dev)
    final_w = torch.empty((B, V), dtype=target_probs.dtype, device=dev)  # each row's final residual
    cur = torch.zeros(B, dtype=torch.int64, device=dev)  # current slot (0 = root)
    active = torch.ones(B, dtype=torch.bool, device=dev)
    for _ in range(D + 1):
        r = target_probs[rows, cur].clone()  # [B, V]: running residual, normalised
        q_cur = None
        if rule == "mixed":  # slots beyond draft_probs have only chosen children: their q is never read
            q_cur = draft_probs[rows, cur.clamp(max=draft_probs.shape[1] - 1)].to(r.dtype)  # [B, V]
        elif rule != "deterministic":
            q_cur = draft_probs[rows, cur].to(r.dtype)  # [B, V]
            if rule == "without_replacement":
                q_cur = q_cur.clone()
        q_scale = None  # [B, 1]: without_replacement's normalisation of q_cur
        took = torch.full((B,), -1, dtype=torch.int64, device=dev)  # accepted child per row
        searching = active.clone()
        for i in range(W):
            child = children[rows, cur, i]  # [B]
            test = searching & (child >= 0)
            if not bool(test.any()):
                break
            c = child.clamp(min=0)
            x = ids[rows, c]  # [B]
            r_x = r.gather(1, x.unsqueeze(1)).squeeze(1).double()
            s = None
            if rule == "deterministic":
                q_i = None
                q_x = torch.ones_like(r_x)
            elif rule == "mixed":
                s = sampled[rows, c] & test  # [B]: this child was sampled from q_cur
                q_i = q_cur
                q_x = torch.where(s, q_cur.gather(1, x.unsqueeze(1)).squeeze(1).double(), 1.0)
            else:
                q_i = q_cur
                q_x = q_cur.gather(1, x.unsqueeze(1)).squeeze(1).double()
                if rule == "without_replacement":  # q_cur renormalised: the siblings drawn before x are gone
                    q_scale = 1.0 / q_cur.sum(-1, keepdim=True).clamp_min(torch.finfo(q_cur.dtype).tiny)  # [B, 1]
                    q_x = q_x * q_scale.squeeze(1).double()
            acc = test & (accept_u[rows, c] * q_x < r_x)
            took = torch.where(acc, c, took)
            rej = test & ~acc
            if not _stale_residual:
                _reject(r, workspace("tree_residual", (B, V), r.dtype, dev), q_i, q_scale, s, x, rej)
            if rule == "without_replacement":  # the next sibling was drawn with x removed
                q_cur.scatter_(1, x.unsqueeze(1), torch.where(test.unsqueeze(1), 0.0, q_cur.gather(1, x.unsqueeze(1))))
            searching &= ~acc
        moved = took >= 0
        stop = active & ~moved
        final_w[stop] = r[stop]
        if bool(moved.any()):
            path[rows[moved], num_accepted[moved]] = took[moved]
        num_accepted += moved.long()
        cur = torch.where(moved, took + 1, cur)
        active = moved
        if not bool(active.any()):
            break
    if bool(active.any()):  # unreachable: a row can descend at most D levels, and leaves stop it
        raise RuntimeError("tree walk did not terminate")
    final = sample_from_weights(final_w, final_u)  # [B]
    Dp = path.shape[1]
    on_path = torch.arange(Dp, device=dev) < num_accepted.unsqueeze(1)  # [B, D]
    tok = torch.where(on_path, ids.gather(1, path.clamp(min=0)), -1) if N else torch.full_like(path, -1)
    tok = torch.cat([tok, torch.full((B, 1), -1, dtype=torch.int64, device=dev)], 1)  # [B, D + 1]
    tok.scatter_(1, num_accepted.unsqueeze(1), final.unsqueeze(1))
    return TreeVerifyOutput(token_ids=tok, num_accepted=num_accepted, path=path)


def _reject(
    r: Tensor,  # [B, V]: running residual, updated in place on the rejected rows
    buf: Tensor,  # [B, V]: scratch
    q: Tensor | None,  # [B, V]: the slot's q (None: deterministic children, one-hot q)
    q_scale: Tensor | None,  # [B, 1]: a factor on q (without_replacement's renormalisation), or None
    sampled: Tensor | None,  # [B] bool, rule "mixed": the child was sampled from q (else chosen: one-hot)
    x: Tensor,  # [B] int64: the child's token
    rej: Tensor,  # [B] bool: rows whose child was rejected
) -> None:
    """r <- normalise((r - q)+) on the rejected rows (r with x zeroed for a one-hot q; Z = 0 keeps r), in place: no
    [B, V] temporaries, no host sync. Rows not rejected keep r exactly, whatever their q holds (a leaf's q slot may
    be garbage: products with 0 weight are zeroed by nan_to_num)."""
    x = x.unsqueeze(1)
    if q is None:
        buf.copy_(r).scatter_(1, x, 0.0)
    else:
        factor = q_scale if q_scale is not None else torch.ones_like(r[:, :1])  # [B, 1]
        if sampled is None:
            torch.addcmul(r, q, -factor, out=buf).clamp_min_(0.0)
        else:  # chosen children subtract nothing (their slot's q may be garbage: zeroed) and zero x below
            torch.mul(q, factor * sampled.to(r.dtype).unsqueeze(1), out=buf).nan_to_num_(0.0, 0.0, 0.0)
            torch.sub(r, buf, out=buf).clamp_min_(0.0)
            buf.scatter_(1, x, torch.where(sampled.unsqueeze(1), buf.gather(1, x), 0.0))
    z = buf.sum(-1, keepdim=True)  # [B, 1]
    w = (rej.unsqueeze(1) & (z > 0)).to(r.dtype)  # [B, 1]: rows that take the new residual
    buf.mul_(w / z.clamp_min(torch.finfo(r.dtype).tiny)).nan_to_num_(0.0, 0.0, 0.0)
    r.mul_(1.0 - w).add_(buf)


def _check_tree(
    target_probs: Tensor,
    draft_token_ids: Tensor,
    parents: Tensor,
    draft_probs: Tensor | None,
    num_nodes: Tensor,
    rule: str,
    sampled: Tensor | None = None,
) -> None:
    """Raise ValueError on input the walk cannot honour."""
    B, N1, V = target_probs.shape
    N = N1 - 1
    dev = target_probs.device
    valid = torch.arange(N, device=dev) < num_nodes.unsqueeze(1)  # [B, N]
    node = torch.arange(N, device=dev).expand(B, N)
    bad_par = valid & ((parents < -1) | (parents >= node))
    if bool(bad_par.any()):
        b, n = (int(i) for i in bad_par.nonzero()[0])
        raise ValueError(
            f"parents[{b}, {n}] = {int(parents[b, n])}: a node's parent must be -1 (the root) or an earlier node"
        )
    bad_id = valid & ((draft_token_ids < 0) | (draft_token_ids >= V))
    if bool(bad_id.any()):
        b, n = (int(i) for i in bad_id.nonzero()[0])
        raise ValueError(f"draft_token_ids[{b}, {n}] = {int(draft_token_ids[b, n])} is outside [0, {V})")
    slots = torch.cat([torch.ones((B, 1), dtype=torch.bool, device=dev), valid], 1)  # [B, N + 1]
    has_children = torch.zeros_like(slots)
    has_children[torch.arange(B, device=dev).unsqueeze(1).expand(B, N)[valid], (parents + 1)[valid]] = True

    check_probability_rows("target_probs", target_probs, slots)
    ids = draft_token_ids.clamp(0, V - 1)
    same_parent = (parents.unsqueeze(2) == parents.unsqueeze(1)) & valid.unsqueeze(1) & valid.unsqueeze(2)
    dup = (
        same_parent & (ids.unsqueeze(2) == ids.unsqueeze(1)) & torch.ones((N, N), dtype=torch.bool, device=dev).tril(-1)
    )
    if rule == "mixed":  # only chosen siblings must be distinct (a sampled child may repeat any sibling)
        dup &= ~sampled.unsqueeze(1) & ~sampled.unsqueeze(2)
        drawn = valid & sampled
        has_children = torch.zeros_like(slots)  # slots with a sampled child: their q must be a distribution
        has_children[torch.arange(B, device=dev).unsqueeze(1).expand(B, N)[drawn], (parents + 1)[drawn]] = True
    if rule != "iid" and bool(dup.any()):
        b, n, m = (int(i) for i in dup.nonzero()[0])
        raise ValueError(
            f"row {b}: nodes {m} and {n} are siblings with the same token {int(ids[b, n])}; rule "
            f"{rule!r} needs distinct siblings (only 'iid' children can repeat)"
        )
    if rule == "deterministic":
        return
    S = draft_probs.shape[1]
    check_probability_rows("draft_probs", draft_probs, has_children[:, :S])
    q_par = draft_probs.gather(1, (parents + 1).clamp(0, S - 1).unsqueeze(-1).expand(B, N, V))  # [B, N, V]
    q_x = q_par.gather(2, ids.unsqueeze(-1)).squeeze(-1)  # [B, N]
    zero = valid & (q_x <= 0) & (sampled if rule == "mixed" else True)
    if bool(zero.any()):
        b, n = (int(i) for i in zero.nonzero()[0])
        raise ValueError(
            f"node {n} of row {b} (token {int(ids[b, n])}) has q = 0 under its parent's draft_probs: "
            "draft_probs must be the distribution the children were drawn from"
        )
    if rule == "without_replacement":  # the mass left for each sibling must be positive
        before = same_parent & torch.ones((N, N), dtype=torch.bool, device=dev).tril(-1)  # [B, n, n'] n' < n
        earlier_mass = torch.einsum("bnm,bm->bn", before.to(q_x.dtype), q_x)  # q mass of earlier siblings
        left = 1.0 - earlier_mass
        bad = valid & (left <= 1e-12)
        if bool(bad.any()):
            b, n = (int(i) for i in bad.nonzero()[0])
            raise ValueError(
                f"node {n} of row {b}: its earlier siblings exhaust q, so it cannot have been drawn without replacement"
            )


def verify_tree(
    target_probs: Tensor,  # [B, N + 1, V] float: processed p at the root (slot 0) and after each node (slot n + 1)
    draft_token_ids: Tensor,  # [B, N] int64: node tokens (-1 / anything beyond num_nodes[b]: padding)
    parents: Tensor,  # [B, N] int64: -1 = child of the root, else the index of an earlier node
    draft_probs: Tensor | None = None,  # [B, N + 1, V] float: the q each slot's children were drawn from
    num_nodes: Tensor | None = None,  # [B] int64: row b uses its first num_nodes[b] nodes (default: all N)
    generators: Sequence[torch.Generator | None] | None = None,  # one per row (per-request seeds)
    *,
    rule: str = "deterministic",  # "iid", "without_replacement", "deterministic" or "mixed" (module docstring)
    check: bool = True,
    sampled: Tensor | None = None,  # [B, N] bool, rule "mixed" only: node n was sampled from its parent slot's q
) -> TreeVerifyOutput:
    """Verify a batch of draft trees against the target, exactly (see the module docstring for the rules and
    the proof). A chain is the tree with parents [-1, 0, 1, ...]: with rule "iid" this is verify_chain's rule.

    Returns token_ids [B, D + 1] (the accepted path's tokens, then the recovered or bonus token, -1 padded),
    num_accepted [B] and path [B, D] (accepted node indices). With `check=True`, bad input — probabilities that
    are not distributions, a parent that is not an earlier node, token ids outside [0, V), a sampled node with
    q = 0, repeated siblings outside rule "iid" — raises ValueError.
    """
    if rule not in VERIFY_RULES:
        raise ValueError(f"rule must be one of {', '.join(VERIFY_RULES)}, got {rule!r}")
    if not isinstance(target_probs, Tensor) or target_probs.dim() != 3 or not target_probs.is_floating_point():
        raise ValueError("target_probs must be a floating-point tensor of shape [B, N + 1, V]")
    B, N1, V = target_probs.shape
    N = N1 - 1
    dev = target_probs.device
    for name, t in (("draft_token_ids", draft_token_ids), ("parents", parents)):
        if not isinstance(t, Tensor) or tuple(t.shape) != (B, N) or t.is_floating_point():
            got = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(f"{name} must be an integer tensor of shape [B, N] = [{B}, {N}], got {got}")
        if t.device != dev:
            raise ValueError(f"{name} is on {t.device}, target_probs on {dev}")
    draft_token_ids, parents = draft_token_ids.long(), parents.long()
    if rule == "mixed":
        sampled = _check_sampled(sampled, B, N, dev)
        if not bool(sampled.any()):
            rule = "deterministic"  # every child chosen (or no nodes)
    elif sampled is not None:
        raise ValueError(f"sampled is for rule 'mixed' only (rule {rule!r} says how every child was drawn)")
    if N == 0:  # no nodes: every row draws its token from p at the root
        rule, draft_probs = "deterministic", None
    if rule == "deterministic":
        draft_probs = None  # not needed: the children were chosen, q_i is one-hot
    elif draft_probs is None:
        raise ValueError(f"rule {rule!r} needs draft_probs (the distribution the children were drawn from)")
    elif (
        not isinstance(draft_probs, Tensor)
        or draft_probs.dim() != 3
        or (draft_probs.shape[0], draft_probs.shape[2]) != (B, V)
        or not (draft_probs.shape[1] == N1 or (rule == "mixed" and 1 <= draft_probs.shape[1] <= N1))
        or not draft_probs.is_floating_point()
        or draft_probs.device != dev
    ):
        got = tuple(draft_probs.shape) if isinstance(draft_probs, Tensor) else type(draft_probs).__name__
        slots = "S <= N + 1" if rule == "mixed" else "N + 1"
        raise ValueError(
            f"draft_probs must be a float tensor of shape [B, {slots}, V] on {dev} (N + 1 = {N1}), got {got}"
        )
    if num_nodes is None:
        num_nodes = torch.full((B,), N, dtype=torch.int64, device=dev)
    else:
        num_nodes = torch.as_tensor(num_nodes, device=dev)
        if tuple(num_nodes.shape) != (B,) or num_nodes.is_floating_point():
            raise ValueError(f"num_nodes must be an integer tensor of shape [B] = [{B}]")
        num_nodes = num_nodes.long()
        if bool(((num_nodes < 0) | (num_nodes > N)).any()):
            raise ValueError(f"num_nodes must lie in [0, N] = [0, {N}], got {num_nodes.tolist()}")
    if rule == "mixed":
        reach = torch.arange(N, device=dev) < num_nodes.unsqueeze(1)
        if bool((reach & sampled & (parents + 1 >= draft_probs.shape[1])).any()):
            raise ValueError("a sampled node's parent slot lies beyond draft_probs (its q is missing)")
    if check:
        _check_tree(target_probs, draft_token_ids, parents, draft_probs, num_nodes, rule, sampled)
    accept_u, final_u = draw_uniforms(num_nodes, N, generators, dev)
    return verify_tree_with_uniforms(
        target_probs,
        draft_token_ids,
        parents,
        draft_probs,
        num_nodes,
        rule,
        accept_u,
        final_u,
        sampled=sampled if rule == "mixed" else None,
    )


def _check_sampled(sampled, B: int, N: int, dev) -> Tensor:
    if not isinstance(sampled, Tensor) or tuple(sampled.shape) != (B, N) or sampled.dtype != torch.bool:
        got = tuple(sampled.shape) if isinstance(sampled, Tensor) else type(sampled).__name__
        raise ValueError(f"rule 'mixed' needs sampled, a bool tensor of shape [B, N] = [{B}, {N}], got {got}")
    return sampled.to(dev)
