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

from .chain import check_probability_rows, draw_uniforms, emitted, row_counts, sample_from_weights, workspace

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
    """What `verify_tree` returns. D is the deepest node of the batch, at least 1 (an empty tree still gives
    [B, 2] and [B, 1]).

    Attributes:
        token_ids: [B, D + 1] int64: the accepted path's tokens, then the recovered or bonus token, then -1.
        num_accepted: [B] int64: accepted nodes per row (the path's length); each row emits `num_accepted + 1`.
        path: [B, D] int64: the node indices of the accepted path, the root's child first, -1 padded.
    """

    token_ids: Tensor
    num_accepted: Tensor
    path: Tensor

    @property
    def num_emitted(self) -> Tensor:  # [B] int64
        """[B] int64: tokens emitted per row (`num_accepted + 1`)."""
        return self.num_accepted + 1


def chain_parents(batch: int, k: int, device: torch.device | str = "cpu") -> Tensor:  # [batch, k] int64
    """The parents of a chain written as a tree: -1, 0, 1, ..., k - 2 (node j hangs below node j - 1)."""
    return (torch.arange(k, device=device) - 1).expand(batch, k).contiguous()


def tree_ancestors(parents: Tensor) -> tuple[Tensor, Tensor]:
    """Ancestor-or-self relation and depth of every node; one pass in node order (parents precede children).
    parents [B, N] int64 (-1: a child of the root, else an earlier node; padding: set it to -1) -> anc [B, N, N]
    bool (anc[b, n, m]: m is n or an ancestor of n), depth [B, N] (the root's children: 1)."""
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
) -> TreeVerifyOutput:
    """The tree walk with explicit randomness; inputs are assumed valid (see verify_tree)."""
    walk = _TreeWalk(target_probs, draft_token_ids, parents, draft_probs, num_nodes, rule, accept_u, sampled)
    return walk.run(final_u)


class _TreeWalk:
    """One batched walk down the trees (the module docstring): per depth level, each active row tests the children
    of its current slot in drafting order against a running residual r [B, V], then moves to the accepted child
    or stops and keeps r for the final draw. Loops over levels and sibling ranks only; the host syncs are one per
    sibling round (any row left to test?) and two per level (any row moved? any still active?).

    `reject` is the one step a subclass may replace (certify.bugs' stale-residual walk does)."""

    def __init__(self, target_probs, draft_token_ids, parents, draft_probs, num_nodes, rule, accept_u, sampled):
        B, N1, V = target_probs.shape
        dev = target_probs.device
        self.p, self.q, self.rule, self.accept_u, self.sampled = target_probs, draft_probs, rule, accept_u, sampled
        self.B, self.N, self.V = B, N1 - 1, V
        self.rows = torch.arange(B, device=dev)
        self.children, depth = tree_children(parents, num_nodes)  # [B, N + 1, W], [B, N]
        self.depth = int(depth.max()) if self.N else 0  # D, the deepest node of the batch
        self.ids = draft_token_ids.clamp(0, V - 1)  # [B, N]
        self.path = torch.full((B, max(self.depth, 1)), -1, dtype=torch.int64, device=dev)  # [B, D]
        self.num_accepted = torch.zeros(B, dtype=torch.int64, device=dev)  # [B]
        self.final_w = torch.empty((B, V), dtype=target_probs.dtype, device=dev)  # [B, V]: each row's final r
        self.cur = torch.zeros(B, dtype=torch.int64, device=dev)  # [B]: current slot (0 = root)
        self.active = torch.ones(B, dtype=torch.bool, device=dev)  # [B]: still walking

    def run(self, final_u: Tensor) -> TreeVerifyOutput:
        for _ in range(self.depth + 1):
            self._level()
            if not bool(self.active.any()):
                break
        if bool(self.active.any()):  # unreachable: a row can descend at most D levels, and leaves stop it
            raise RuntimeError("tree walk did not terminate")
        return self._emit(final_u)

    def _level(self) -> None:
        """Test the current slot's children one after another; descend to the accepted one (or stop)."""
        r = self.p[self.rows, self.cur].clone()  # [B, V]: running residual, normalised
        q_cur = self._slot_q(r.dtype)  # [B, V] or None
        took = torch.full((self.B,), -1, dtype=torch.int64, device=r.device)  # [B]: accepted child per row
        searching = self.active.clone()  # [B]
        for i in range(self.children.shape[-1]):
            child = self.children[self.rows, self.cur, i]  # [B]
            test = searching & (child >= 0)
            if not bool(test.any()):
                break
            c = child.clamp(min=0)
            acc = self._test_child(r, q_cur, c, test)
            took = torch.where(acc, c, took)
            searching &= ~acc
        self._descend(r, took)

    def _slot_q(self, dtype: torch.dtype) -> Tensor | None:  # [B, V]: q at the current slots (None: one-hot)
        if self.rule == "mixed":  # slots beyond draft_probs have only chosen children: their q is never read
            return self.q[self.rows, self.cur.clamp(max=self.q.shape[1] - 1)].to(dtype)
        if self.rule == "deterministic":
            return None
        q_cur = self.q[self.rows, self.cur].to(dtype)
        return q_cur.clone() if self.rule == "without_replacement" else q_cur  # its siblings get removed in place

    def _test_child(self, r: Tensor, q_cur: Tensor | None, c: Tensor, test: Tensor) -> Tensor:  # acc [B] bool
        """One sibling round on the rows in `test` (child node c [B]): accept iff u_c * q_i(x) < r(x); the
        rejected rows' r moves to the residual, and without replacement x leaves q_cur."""
        x = self.ids[self.rows, c]  # [B]
        r_x = r.gather(1, x.unsqueeze(1)).squeeze(1).double()  # [B]
        q_i, q_scale, s, q_x = self._proposal(q_cur, c, x, test, r_x)
        acc = test & (self.accept_u[self.rows, c] * q_x < r_x)
        self.reject(r, q_i, q_scale, s, x, test & ~acc)
        if self.rule == "without_replacement":  # the next sibling was drawn with x removed
            q_cur.scatter_(1, x.unsqueeze(1), torch.where(test.unsqueeze(1), 0.0, q_cur.gather(1, x.unsqueeze(1))))
        return acc

    def _proposal(self, q_cur: Tensor | None, c: Tensor, x: Tensor, test: Tensor, r_x: Tensor) -> tuple:
        """Child c's proposal q_i: (q_i [B, V] or None for one-hot, q_scale [B, 1] (without_replacement's
        normalisation) or None, s [B] bool (rule "mixed": sampled, else chosen) or None, q_i(x) [B] float64)."""
        if self.rule == "deterministic":
            return None, None, None, torch.ones_like(r_x)
        q_x = q_cur.gather(1, x.unsqueeze(1)).squeeze(1).double()  # [B]
        if self.rule == "mixed":
            s = self.sampled[self.rows, c] & test  # [B]: this child was sampled from q_cur
            return q_cur, None, s, torch.where(s, q_x, 1.0)
        if self.rule == "without_replacement":  # q_cur renormalised: the siblings drawn before x are gone
            q_scale = 1.0 / q_cur.sum(-1, keepdim=True).clamp_min(torch.finfo(q_cur.dtype).tiny)  # [B, 1]
            return q_cur, q_scale, None, q_x * q_scale.squeeze(1).double()
        return q_cur, None, None, q_x

    def reject(self, r: Tensor, q, q_scale, sampled, x: Tensor, rej: Tensor) -> None:
        """r <- normalise((r - q_i)+) on the rejected rows `rej` [B], in place (_reject)."""
        _reject(r, workspace("tree_residual", (self.B, self.V), r.dtype, r.device), q, q_scale, sampled, x, rej)

    def _descend(self, r: Tensor, took: Tensor) -> None:
        """Rows that accepted a child (took [B] >= 0) move to it; the others stop, keeping r for the final draw."""
        moved = took >= 0
        stop = self.active & ~moved
        self.final_w[stop] = r[stop]
        if bool(moved.any()):
            self.path[self.rows[moved], self.num_accepted[moved]] = took[moved]
        self.num_accepted += moved.long()
        self.cur = torch.where(moved, took + 1, self.cur)
        self.active = moved

    def _emit(self, final_u: Tensor) -> TreeVerifyOutput:
        """The accepted path's tokens, then one token drawn from each row's final residual with final_u [B]."""
        final = sample_from_weights(self.final_w, final_u)  # [B]
        path_ids = self.ids.gather(1, self.path.clamp(min=0)) if self.N else self.path  # [B, D]
        tok = emitted(path_ids, self.num_accepted, final)  # [B, D + 1]
        return TreeVerifyOutput(token_ids=tok, num_accepted=self.num_accepted, path=self.path)


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
    target_probs: Tensor,  # [B, N + 1, V]
    draft_token_ids: Tensor,  # [B, N] int64
    parents: Tensor,  # [B, N] int64
    draft_probs: Tensor | None,  # [B, S, V] (S = N + 1, or S <= N + 1 for rule "mixed"); None: deterministic
    num_nodes: Tensor,  # [B] int64
    rule: str,
    sampled: Tensor | None = None,  # [B, N] bool, rule "mixed"
) -> None:
    """Raise ValueError on input the walk cannot honour (the first problem found, in the order of the checks)."""
    B, N1, V = target_probs.shape
    N = N1 - 1
    dev = target_probs.device
    valid = torch.arange(N, device=dev) < num_nodes.unsqueeze(1)  # [B, N]
    _check_links(draft_token_ids, parents, valid, V)
    slots = torch.cat([torch.ones((B, 1), dtype=torch.bool, device=dev), valid], 1)  # [B, N + 1]
    check_probability_rows("target_probs", target_probs, slots)
    ids = draft_token_ids.clamp(0, V - 1)
    same_parent = (parents.unsqueeze(2) == parents.unsqueeze(1)) & valid.unsqueeze(1) & valid.unsqueeze(2)  # [B, N, N]
    earlier = torch.ones((N, N), dtype=torch.bool, device=dev).tril(-1)  # [n, n']: n' < n
    _check_distinct_siblings(ids, same_parent & earlier, rule, sampled)
    if rule == "deterministic":
        return
    _check_draft_q(draft_probs, ids, parents, valid & sampled if rule == "mixed" else valid)
    if rule == "without_replacement":
        _check_mass_left(draft_probs, ids, parents, valid, same_parent & earlier)


def _check_links(draft_token_ids: Tensor, parents: Tensor, valid: Tensor, V: int) -> None:
    """Every used node's parent is -1 or an earlier node, and its token lies in [0, V) (all [B, N])."""
    B, N = parents.shape
    node = torch.arange(N, device=parents.device).expand(B, N)
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


def _check_distinct_siblings(ids: Tensor, older_sibling: Tensor, rule: str, sampled: Tensor | None) -> None:
    """Outside rule "iid", siblings carry distinct tokens (rule "mixed": the chosen ones). ids [B, N];
    older_sibling [B, n, n']: n' is an earlier sibling of n (both used nodes)."""
    dup = older_sibling & (ids.unsqueeze(2) == ids.unsqueeze(1))  # [B, N, N]
    if rule == "mixed":  # only chosen siblings must be distinct (a sampled child may repeat any sibling)
        dup &= ~sampled.unsqueeze(1) & ~sampled.unsqueeze(2)
    if rule != "iid" and bool(dup.any()):
        b, n, m = (int(i) for i in dup.nonzero()[0])
        raise ValueError(
            f"row {b}: nodes {m} and {n} are siblings with the same token {int(ids[b, n])}; rule "
            f"{rule!r} needs distinct siblings (only 'iid' children can repeat)"
        )


def _check_draft_q(draft_probs: Tensor, ids: Tensor, parents: Tensor, drawn: Tensor) -> None:
    """The q of every slot with a drawn child (drawn [B, N]: sampled, used nodes) is a distribution, and gives
    each drawn child q > 0. draft_probs [B, S, V]; ids, parents [B, N]."""
    B, N = ids.shape
    S = draft_probs.shape[1]
    has_children = torch.zeros((B, N + 1), dtype=torch.bool, device=ids.device)  # [B, N + 1]
    has_children[torch.arange(B, device=ids.device).unsqueeze(1).expand(B, N)[drawn], (parents + 1)[drawn]] = True
    check_probability_rows("draft_probs", draft_probs, has_children[:, :S])
    zero = drawn & (_q_at_nodes(draft_probs, ids, parents) <= 0)
    if bool(zero.any()):
        b, n = (int(i) for i in zero.nonzero()[0])
        raise ValueError(
            f"node {n} of row {b} (token {int(ids[b, n])}) has q = 0 under its parent's draft_probs: "
            "draft_probs must be the distribution the children were drawn from"
        )


def _check_mass_left(draft_probs: Tensor, ids: Tensor, parents: Tensor, valid: Tensor, older_sibling: Tensor) -> None:
    """Without replacement, the q mass left for each sibling (1 - its earlier siblings' q) is positive."""
    q_x = _q_at_nodes(draft_probs, ids, parents)  # [B, N]
    earlier_mass = torch.einsum("bnm,bm->bn", older_sibling.to(q_x.dtype), q_x)  # q mass of earlier siblings
    bad = valid & (1.0 - earlier_mass <= 1e-12)
    if bool(bad.any()):
        b, n = (int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"node {n} of row {b}: its earlier siblings exhaust q, so it cannot have been drawn without replacement"
        )


def _q_at_nodes(draft_probs: Tensor, ids: Tensor, parents: Tensor) -> Tensor:  # [B, N]: q_parent(x_n)
    """Each node's token under its parent slot's q (slots beyond draft_probs read its last slot)."""
    B, N = ids.shape
    S, V = draft_probs.shape[1], draft_probs.shape[2]
    q_par = draft_probs.gather(1, (parents + 1).clamp(0, S - 1).unsqueeze(-1).expand(B, N, V))  # [B, N, V]
    return q_par.gather(2, ids.unsqueeze(-1)).squeeze(-1)


def verify_tree(
    target_probs: Tensor,
    draft_token_ids: Tensor,
    parents: Tensor,
    draft_probs: Tensor | None = None,
    num_nodes: Tensor | Sequence[int] | None = None,
    generators: Sequence[torch.Generator | None] | None = None,
    *,
    rule: str = "deterministic",
    check: bool = True,
    sampled: Tensor | None = None,
) -> TreeVerifyOutput:
    """Verify a batch of draft trees against the target, exactly.

    At each node a running distribution r starts as p; the children are tried in drafting order, each against
    r with the q it was drawn from (on a rejection r becomes (r - q_i)+ / Z); the first child accepted becomes the
    current node, and when every child is rejected (or at a leaf) one token is drawn from r. The rules differ in
    q_i (the module docstring gives them and the proof); a chain (parents -1, 0, 1, ...) with rule "iid" is
    verify_chain's rule. Row b consumes exactly `num_nodes[b] + 1` uniforms.

    Args:
        target_probs: [B, N + 1, V] float: processed p at the root (slot 0) and after each node (slot n + 1).
        draft_token_ids: [B, N] int64: the node tokens (anything beyond num_nodes[b] is padding).
        parents: [B, N] int64: -1 for a child of the root, else the index of an earlier node; siblings in
            drafting order.
        draft_probs: [B, N + 1, V] float: the q each slot's children were drawn from (unused by "deterministic";
            rule "mixed": the first S <= N + 1 slots suffice).
        num_nodes: [B] int64: row b uses its first num_nodes[b] nodes (default: all N).
        generators: One torch.Generator (or None) per row: per-request seeds.
        rule: How the children were drawn: "deterministic" (chosen: top-k of q, prompt matches), "iid" and
            "without_replacement" (samples of q, with / without replacement) or "mixed" (as `sampled` says).
        check: Validate the inputs.
        sampled: [B, N] bool, rule "mixed" only: node n was sampled from its parent slot's q (else chosen).

    Returns:
        `token_ids` [B, D + 1] (the accepted path's tokens, then the recovered or bonus token, -1 padded),
        `num_accepted` [B] and `path` [B, D] (the accepted node indices).

    Raises:
        ValueError: An unknown rule; with `check`, bad input: probabilities that are not distributions, a parent
            that is not an earlier node, ids outside [0, V), a sampled node with q = 0, repeated siblings (not "iid").
    """
    if rule not in VERIFY_RULES:
        raise ValueError(f"rule must be one of {', '.join(VERIFY_RULES)}, got {rule!r}")
    B, N1, V = _check_node_tensors(target_probs, draft_token_ids, parents)
    N, dev = N1 - 1, target_probs.device
    draft_token_ids, parents = draft_token_ids.long(), parents.long()
    rule, sampled = _mixed_rule(rule, sampled, B, N, dev)
    rule = "deterministic" if N == 0 else rule  # no nodes: every row draws its token from p at the root
    draft_probs = None if rule == "deterministic" else _check_draft_probs(draft_probs, rule, B, N1, V, dev)
    host = num_nodes if isinstance(num_nodes, (list, tuple)) else None
    num_nodes = row_counts("num_nodes", num_nodes, B, N, "N", dev)
    if rule == "mixed":
        _check_mixed_slots(draft_probs, sampled, parents, num_nodes)
    if check:
        _check_tree(target_probs, draft_token_ids, parents, draft_probs, num_nodes, rule, sampled)
    accept_u, final_u = draw_uniforms(num_nodes, N, generators, dev, host)
    sampled = sampled if rule == "mixed" else None
    walk = _TreeWalk(target_probs, draft_token_ids, parents, draft_probs, num_nodes, rule, accept_u, sampled)
    return walk.run(final_u)


def _check_node_tensors(target_probs, draft_token_ids, parents) -> tuple[int, int, int]:  # (B, N + 1, V)
    """target_probs is a float [B, N + 1, V] tensor; draft_token_ids and parents integer [B, N] ones beside it."""
    if not isinstance(target_probs, Tensor) or target_probs.dim() != 3 or not target_probs.is_floating_point():
        raise ValueError("target_probs must be a floating-point tensor of shape [B, N + 1, V]")
    B, N1, V = target_probs.shape
    for name, t in (("draft_token_ids", draft_token_ids), ("parents", parents)):
        if not isinstance(t, Tensor) or tuple(t.shape) != (B, N1 - 1) or t.is_floating_point():
            got = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(f"{name} must be an integer tensor of shape [B, N] = [{B}, {N1 - 1}], got {got}")
        if t.device != target_probs.device:
            raise ValueError(f"{name} is on {t.device}, target_probs on {target_probs.device}")
    return B, N1, V


def _mixed_rule(rule: str, sampled, B: int, N: int, dev) -> tuple[str, Tensor | None]:
    """(rule, sampled): rule "mixed" needs sampled [B, N] bool, and is "deterministic" when no node was sampled;
    the other rules take no sampled."""
    if rule == "mixed":
        sampled = _check_sampled(sampled, B, N, dev)
        return ("mixed" if bool(sampled.any()) else "deterministic"), sampled  # deterministic: every child chosen
    if sampled is not None:
        raise ValueError(f"sampled is for rule 'mixed' only (rule {rule!r} says how every child was drawn)")
    return rule, sampled


def _check_draft_probs(draft_probs, rule: str, B: int, N1: int, V: int, dev) -> Tensor:
    """A sampling rule's draft_probs: float [B, N + 1, V] on dev (rule "mixed": [B, S, V], 1 <= S <= N + 1)."""
    if draft_probs is None:
        raise ValueError(f"rule {rule!r} needs draft_probs (the distribution the children were drawn from)")
    if (
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
    return draft_probs


def _check_mixed_slots(draft_probs: Tensor, sampled: Tensor, parents: Tensor, num_nodes: Tensor) -> None:
    """Rule "mixed": every sampled node's parent slot lies among draft_probs' S slots."""
    reach = torch.arange(parents.shape[1], device=parents.device) < num_nodes.unsqueeze(1)  # [B, N]
    if bool((reach & sampled & (parents + 1 >= draft_probs.shape[1])).any()):
        raise ValueError("a sampled node's parent slot lies beyond draft_probs (its q is missing)")


def _check_sampled(sampled, B: int, N: int, dev) -> Tensor:
    if not isinstance(sampled, Tensor) or tuple(sampled.shape) != (B, N) or sampled.dtype != torch.bool:
        got = tuple(sampled.shape) if isinstance(sampled, Tensor) else type(sampled).__name__
        raise ValueError(f"rule 'mixed' needs sampled, a bool tensor of shape [B, N] = [{B}, {N}], got {got}")
    return sampled.to(dev)
