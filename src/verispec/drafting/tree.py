"""Tree drafting: a draft model proposes a token tree per row, verified in one target pass (verify_tree).

Shapes of tree (`TreeSpec`):
  * static:  widths per depth, e.g. 4-2-2-1 — every node at depth d gets widths[d] children (4 + 8 + 16 + 16 nodes);
  * dynamic: EAGLE-2 — depth D, K children per expanded node, budget M: at each depth the K nodes of the newest
    level with the highest path probability (product of the draft's probabilities) are expanded, and the M best
    nodes of everything drafted are kept. Its children are the top-K of q: deterministic (rule "deterministic");
    re-ranking sampled nodes by their own probability would bias them (see verispec.sampling.tree).
and how children are drawn (the verification rule): "iid" (i.i.d. from q), "without_replacement" (from q, without
replacement; a node stops getting children when q has no mass left) or "deterministic" (top-w of q).

The draft's KV cache holds the tree as it grows (RowKVCache + tree attention): each level is one forward over the
newly expanded nodes, which see the prefix and their own ancestors, so shared prefixes are computed once. After
verification the accepted path's nodes are moved behind the prefix (`keep_paths`); everything else is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..sampling import counts_at_tree_nodes, probs_from_logits, sample_from_weights
from ..sampling.tree import TREE_RULES
from .base import BatchView
from .draft_model import DraftModelProposer

__all__ = ["TreeDraftProposer", "TreeProposal", "TreeSpec"]

MAX_TREE_NODES = 256


@dataclass(frozen=True)
class TreeSpec:
    """A tree shape and its drafting / verification rule (see the module docstring)."""

    widths: tuple[int, ...] = ()  # static tree: children per node at depth 1, 2, ...
    rule: str = "deterministic"  # "iid", "without_replacement" or "deterministic"
    dynamic: bool = False  # EAGLE-2 dynamic tree (then depth / topk / budget below)
    depth: int = 0
    topk: int = 0
    budget: int = 0

    def __post_init__(self):
        if self.rule not in TREE_RULES:
            raise ValueError(f"tree rule must be one of {', '.join(TREE_RULES)}, got {self.rule!r}")
        if self.dynamic:
            if self.rule != "deterministic":
                raise ValueError("a dynamic (EAGLE-2) tree re-ranks nodes by their own draft probability, which "
                                 "biases sampled children: it needs rule 'deterministic' (top-k children)")
            if self.depth < 1 or self.topk < 1 or self.budget < 1:
                raise ValueError(f"a dynamic tree needs depth, topk and budget >= 1, got {self.depth}, {self.topk}, "
                                 f"{self.budget}")
        elif not self.widths or any(int(w) < 1 for w in self.widths):
            raise ValueError(f"a static tree needs widths >= 1 per depth, got {self.widths}")
        if self.max_nodes > MAX_TREE_NODES:
            raise ValueError(f"the tree has up to {self.max_nodes} nodes; at most {MAX_TREE_NODES} are supported")

    @staticmethod
    def parse(spec: str, rule: str | None = None) -> TreeSpec:
        """'4-2-2-1' (static widths) or 'dynamic-D-K-M' (EAGLE-2: depth D, top-K, budget of M nodes)."""
        parts = str(spec).strip().lower().split("-")
        try:
            if parts[0] == "dynamic":
                if len(parts) != 4:
                    raise ValueError
                d, k, m = (int(x) for x in parts[1:])
                return TreeSpec(rule=rule or "deterministic", dynamic=True, depth=d, topk=k, budget=m)
            return TreeSpec(widths=tuple(int(x) for x in parts), rule=rule or "deterministic")
        except ValueError as e:
            if str(e) and not str(e).startswith("invalid literal"):
                raise
            raise ValueError(f"tree spec must look like 4-2-2-1 (widths per depth) or dynamic-D-K-M, got {spec!r}") \
                from None

    @property
    def max_depth(self) -> int:
        return self.depth if self.dynamic else len(self.widths)

    @property
    def max_nodes(self) -> int:
        if self.dynamic:
            return min(self.budget, self.topk + (self.depth - 1) * self.topk * self.topk)
        total, level = 0, 1
        for w in self.widths:
            level *= int(w)
            total += level
        return total

    @property
    def cache_slots(self) -> int:
        """KV slots a step can occupy beyond the committed prefix: the target verifies max_nodes nodes; a
        dynamic tree's draft computes every expanded node, up to topk per depth, before the budget is applied."""
        return max(self.max_nodes, self.topk * self.depth) if self.dynamic else self.max_nodes

    def __str__(self) -> str:
        shape = f"dynamic-{self.depth}-{self.topk}-{self.budget}" if self.dynamic else "-".join(map(str, self.widths))
        return f"{shape} ({self.rule})"


@dataclass
class TreeProposal:
    token_ids: Tensor  # [B, N] int64 node tokens, -1 padded
    parents: Tensor  # [B, N] int64: -1 = child of the root (the pending token), else an earlier node
    probs: Tensor | None  # [B, N + 1, V]: q each slot's children were drawn from (slot 0 = root); None: deterministic
    num_nodes: list[int]  # [B]
    rule: str

    @property
    def depth(self) -> list[int]:  # deepest node per row
        from ..sampling.tree import tree_children

        return tree_children(self.parents.cpu(), torch.tensor(self.num_nodes))[1].amax(1).tolist() \
            if self.parents.shape[1] else [0] * len(self.num_nodes)


def build_proposal(tokens: list[list[int]], parents: list[list[int]], probs: Tensor | None, rule: str,
                   device) -> TreeProposal:
    B = len(tokens)
    N = max((len(t) for t in tokens), default=0)
    ids = torch.full((B, N), -1, dtype=torch.int64)
    par = torch.full((B, N), -1, dtype=torch.int64)
    for b, (t, p) in enumerate(zip(tokens, parents)):
        ids[b, : len(t)] = torch.as_tensor(t, dtype=torch.int64)
        par[b, : len(p)] = torch.as_tensor(p, dtype=torch.int64)
    if probs is not None:
        probs = probs[:, : N + 1]
    return TreeProposal(ids.to(device), par.to(device), probs, [len(t) for t in tokens], rule)


class TreeDraftProposer(DraftModelProposer):
    """A draft model that proposes trees (`propose_tree`); chains are not its job (use DraftModelProposer)."""

    name = "draft-tree"

    def __init__(self, model, vocab_size: int, spec: TreeSpec, *, runner: str = "auto", quant: str | None = None):
        super().__init__(model, vocab_size, None, runner=runner, quant=quant)
        self.spec = spec
        self._fed: list[dict[int, int]] = []  # per row: proposal node -> its index in the draft cache's tree
        self._tree_start: list[int] = []

    # --- drawing children --------------------------------------------------------------------------
    def _children(self, q: Tensor, owners: list[int], width: int, view: BatchView) -> tuple[Tensor, Tensor]:
        """q [M, V] of M expanded nodes (owners: their rows) -> children [M, width] and validity [M, width]."""
        M, V = q.shape
        rule = self.spec.rule
        if rule == "deterministic":
            val, kids = q.topk(min(width, V), dim=-1)
            ok = val > 0  # a zero-probability token is never accepted: not worth a node
            if width > V:  # more children than tokens: the extra ones do not exist
                pad = torch.zeros((M, width - V), dtype=kids.dtype, device=kids.device)
                kids, ok = torch.cat([kids, pad], 1), torch.cat([ok, pad.bool()], 1)
            return kids, ok
        u = torch.empty((M, width), dtype=torch.float64)
        for m, b in enumerate(owners):  # each row's randomness from its own generator, in node order
            u[m] = torch.rand(width, dtype=torch.float64, generator=view.generators[b])
        u = u.to(q.device)
        if rule == "iid":
            kids = torch.stack([sample_from_weights(q, u[:, i]) for i in range(width)], 1)
            return kids, torch.ones_like(kids, dtype=torch.bool)
        left = q.clone()  # without replacement: each child from q minus the earlier siblings
        kids = torch.zeros((M, width), dtype=torch.int64, device=q.device)
        ok = torch.zeros((M, width), dtype=torch.bool, device=q.device)
        for i in range(width):
            has_mass = left.sum(-1) > 1e-6  # a sibling exists only if q has mass left (decided before drawing)
            x = sample_from_weights(torch.where(has_mass.unsqueeze(1), left, q), u[:, i])
            kids[:, i], ok[:, i] = x, has_mass
            left.scatter_(1, x.unsqueeze(1), 0.0)
        ok = ok.cumprod(1).bool()
        return kids, ok

    def _q(self, logits: Tensor, view: BatchView, rows: list[int], counts: Tensor | None) -> Tensor:
        params = [view.params[b] for b in rows]
        mask = view.prompt_mask[rows] if view.prompt_mask is not None else None
        return probs_from_logits(logits, params, prompt_mask=mask, output_counts=counts)

    # --- proposing ------------------------------------------------------------------------------------
    def propose_tree(self, view: BatchView, caps: list[int]) -> TreeProposal:
        """A tree per row, at most caps[b] deep (0: no tree for that row)."""
        spec = self.spec
        B, dev = len(view.seqs), view.device
        D = spec.max_depth
        caps = [max(0, min(c, D)) for c in caps]
        tokens: list[list[int]] = [[] for _ in range(B)]
        parents: list[list[int]] = [[] for _ in range(B)]
        scores: list[list[float]] = [[] for _ in range(B)]
        self._fed = [dict() for _ in range(B)]
        self._tree_start = list(self.runner.lengths)
        if max(caps, default=0) == 0:
            return build_proposal(tokens, parents, None, spec.rule, dev)
        penalties = any(p.uses_penalties for p in view.params)
        feed = [s[n:] if c > 0 else [] for s, n, c in zip(view.seqs, self.runner.lengths, caps)]
        logits = self.runner.forward(feed, logits_at="last")  # [B, V]: the root (after the pending token)
        self._tree_start = list(self.runner.lengths)
        q_root = self._q(logits, view, list(range(B)), view.output_counts if penalties else None)  # [B, V]
        V = q_root.shape[-1]
        n_max = spec.max_nodes if not spec.dynamic else spec.topk + (spec.depth - 1) * spec.topk * spec.topk
        keep_q = spec.rule != "deterministic"
        probs = torch.zeros((B, n_max + 1, V), dtype=q_root.dtype, device=dev) if keep_q else None
        if keep_q:
            probs[:, 0] = q_root
        fed_parents: list[list[int]] = [[] for _ in range(B)]  # the draft cache's tree (fed nodes), by fed index
        expand = [(b, -1, q_root[b]) for b in range(B) if caps[b] > 0]  # (row, node, q at the node)
        for d in range(1, D + 1):
            if not expand:
                break
            width = spec.topk if spec.dynamic else spec.widths[d - 1]
            owners = [b for b, _, _ in expand]
            kids, ok = self._children(torch.stack([q for _, _, q in expand]), owners, width, view)
            logq = torch.stack([q for _, _, q in expand]).gather(1, kids).clamp_min(1e-30).log().tolist()
            kids, ok = kids.tolist(), ok.tolist()
            new = []  # (row, node) created at this depth
            for m, (b, node, _) in enumerate(expand):
                base = scores[b][node] if node >= 0 else 0.0
                for i in range(width):
                    if ok[m][i]:
                        tokens[b].append(kids[m][i])
                        parents[b].append(node)
                        scores[b].append(base + logq[m][i])
                        new.append((b, len(tokens[b]) - 1))
            if d == D:
                break
            if spec.dynamic:  # EAGLE-2: expand the topk best new nodes of each row
                by_row: dict[int, list[int]] = {}
                for b, n in new:
                    by_row.setdefault(b, []).append(n)
                new = [(b, n) for b, ns in by_row.items()
                       for n in sorted(ns, key=lambda n: -scores[b][n])[: spec.topk]]
            new = [(b, n) for b, n in new if caps[b] > d]
            if not new:
                break
            # one draft forward over the nodes to expand: they see the prefix and their ancestors
            chunk: list[list[int]] = [[] for _ in range(B)]
            for b, n in new:
                p = parents[b][n]
                self._fed[b][n] = len(fed_parents[b])
                fed_parents[b].append(self._fed[b][p] if p >= 0 else -1)
                chunk[b].append(tokens[b][n])
            logits = self.runner.forward(chunk, parents=fed_parents, tree_start=self._tree_start)  # [B, T, V]
            counts = None
            if penalties:
                counts = self._path_counts(view, tokens, parents, new, logits.shape[1])
            q = self._q(logits, view, list(range(B)), counts)  # [B, T, V]
            pos = [0] * B
            expand = []
            for b, n in new:
                q_n = q[b, pos[b]]
                pos[b] += 1
                expand.append((b, n, q_n))
                if keep_q:
                    probs[b, n + 1] = q_n
        if spec.dynamic:
            for b in range(B):
                tokens[b], parents[b], kept = self._best(tokens[b], parents[b], scores[b], spec.budget)
                self._fed[b] = {kept.index(n): f for n, f in self._fed[b].items() if n in kept}
        return build_proposal(tokens, parents, probs, spec.rule, dev)

    @staticmethod
    def _best(tokens, parents, scores, budget):
        """EAGLE-2's re-ranking: the `budget` nodes of highest path probability (a node's ancestors score at
        least as high; ties go to the shallower node), in drafting order."""
        depth = []
        for p in parents:
            depth.append(1 + (depth[p] if p >= 0 else 0))
        order = sorted(range(len(tokens)), key=lambda n: (-scores[n], depth[n], n))[:budget]
        kept = sorted(order)
        index = {n: i for i, n in enumerate(kept)}
        return [tokens[n] for n in kept], [index[parents[n]] if parents[n] >= 0 else -1 for n in kept], kept

    def _path_counts(self, view: BatchView, tokens, parents, new, T: int) -> Tensor:
        """Output counts at each node of the forward chunk (the node's path included): [B, T, V]."""
        B = len(tokens)
        built = build_proposal(tokens, parents, None, "deterministic", view.device)
        every = counts_at_tree_nodes(view.output_counts, built.token_ids, built.parents)  # [B, N + 1, V]
        slot = torch.zeros((B, T), dtype=torch.int64)
        pos = [0] * B
        for b, n in new:
            slot[b, pos[b]] = n + 1
            pos[b] += 1
        return every.gather(1, slot.to(every.device).unsqueeze(-1).expand(-1, -1, every.shape[-1]))

    def update_tree(self, view: BatchView, paths: list[list[int]]) -> None:
        """After verification: row b accepted the proposal nodes paths[b]; keep those the draft has computed."""
        keep = []
        for b, path in enumerate(paths):
            fed = []
            for n in path:
                if n not in self._fed[b]:
                    break
                fed.append(self._fed[b][n])
            keep.append(fed)
        self.runner.keep_paths(self._tree_start, keep)
