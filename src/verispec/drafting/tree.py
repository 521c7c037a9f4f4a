"""Tree drafting: a draft model proposes a token tree per row, verified in one target pass (verify_tree).

`TreeSpec`: static widths per depth (4-2-2-1), or EAGLE-2's dynamic tree (depth D, top-K children per expanded
node, the K best newest nodes expanded per depth, the M best of all kept: rule "deterministic", since re-ranking
sampled nodes by their own probability would bias them). Children: i.i.d. from q, without replacement, or the top-w
of q; rows the randomness couples get the top-w of q / E (`coupled_children`), whatever the rule. The draft's cache
holds the tree as it grows, one forward per level; verification keeps the accepted path (`keep_paths`).
"""

from __future__ import annotations

import itertools
import operator
from collections import defaultdict
from dataclasses import dataclass

import torch
from torch import Tensor

from ..sampling import sample_from_weights
from ..sampling.coupling import coupled_children
from ..sampling.tree import TREE_RULES
from .base import BatchView, Draft

__all__ = ["TreeSpec", "draw_children", "grow_tree"]

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
                raise ValueError(
                    "a dynamic (EAGLE-2) tree re-ranks nodes by their own draft probability, which biases sampled "
                    "children: it needs rule 'deterministic' (top-k children)"
                )
            if self.depth < 1 or self.topk < 1 or self.budget < 1:
                raise ValueError(
                    f"a dynamic tree needs depth, topk and budget >= 1, got {self.depth}, {self.topk}, {self.budget}"
                )
        elif not self.widths or any(int(w) < 1 for w in self.widths):
            raise ValueError(f"a static tree needs widths >= 1 per depth, got {self.widths}")
        if self.max_nodes > MAX_TREE_NODES:
            raise ValueError(f"the tree has up to {self.max_nodes} nodes; at most {MAX_TREE_NODES} are supported")

    @staticmethod
    def parse(spec: str, rule: str | None = None) -> TreeSpec:
        """'4-2-2-1' (static widths) or 'dynamic-D-K-M' (EAGLE-2: depth D, top-K, budget of M nodes)."""
        parts, rule = str(spec).strip().lower().split("-"), rule or "deterministic"
        dynamic = parts[0] == "dynamic"
        try:
            numbers = tuple(int(x) for x in (parts[1:] if dynamic else parts))
        except ValueError:
            numbers = ()
        if not numbers or (dynamic and len(numbers) != 3):
            raise ValueError(f"tree spec must look like 4-2-2-1 (widths per depth) or dynamic-D-K-M, got {spec!r}")
        if dynamic:
            d, k, m = numbers
            return TreeSpec(rule=rule, dynamic=True, depth=d, topk=k, budget=m)
        return TreeSpec(widths=numbers, rule=rule)

    @property
    def max_depth(self) -> int:
        return self.depth if self.dynamic else len(self.widths)

    @property
    def branches(self) -> int:
        """Children of the root: the first width, or a dynamic tree's top-k."""
        return self.topk if self.dynamic else self.widths[0]

    @property
    def drafted_nodes(self) -> int:
        """Nodes drafted before any pruning: a static tree's every node; a dynamic tree's topk children of the
        root plus topk children for each of the topk nodes expanded at every later depth."""
        if self.dynamic:
            return self.topk + (self.depth - 1) * self.topk * self.topk
        return sum(itertools.accumulate((int(w) for w in self.widths), operator.mul))  # per level: running products

    @property
    def max_nodes(self) -> int:
        """Nodes the target verifies: every drafted node, or a dynamic tree's budget."""
        return min(self.budget, self.drafted_nodes) if self.dynamic else self.drafted_nodes

    @property
    def cache_slots(self) -> int:
        """KV slots a step can occupy beyond the committed prefix: the target verifies max_nodes nodes; a
        dynamic tree's draft computes every expanded node, up to topk per depth, before the budget is applied."""
        return max(self.max_nodes, self.topk * self.depth) if self.dynamic else self.max_nodes

    def __str__(self) -> str:
        shape = f"dynamic-{self.depth}-{self.topk}-{self.budget}" if self.dynamic else "-".join(map(str, self.widths))
        return f"{shape} ({self.rule})"


def draw_children(
    q: Tensor, owners: list[int], width: int, rule: str, generators: list[torch.Generator]
) -> tuple[Tensor, Tensor]:
    """q [M, V] of M expanded nodes (owners: their rows) -> children [M, width] and validity [M, width].
    Sampled rules draw `width` uniforms per node from its row's generator, in node order."""
    M, V = q.shape
    if rule == "deterministic":
        val, kids = q.topk(min(width, V), dim=-1)
        ok = val > 0  # a zero-probability token is never accepted: not worth a node
        if width > V:  # more children than tokens: the extra ones do not exist
            pad = torch.zeros((M, width - V), dtype=kids.dtype, device=kids.device)
            kids, ok = torch.cat([kids, pad], 1), torch.cat([ok, pad.bool()], 1)
        return kids, ok
    u = torch.empty((M, width), dtype=torch.float64)
    for m, b in enumerate(owners):
        u[m] = torch.rand(width, dtype=torch.float64, generator=generators[b])
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
    return kids, ok.cumprod(1).bool()


class TreeGrowth:
    """The trees of one step while they grow, per row: node tokens, parents, log path probabilities and depths,
    and which nodes have been fed to the draft model (their index in the draft cache's tree)."""

    def __init__(self, spec: TreeSpec, batch: int):
        self.spec = spec
        rows = [[[] for _ in range(batch)] for _ in range(5)]  # (fed_parents: the draft cache's tree, by fed index)
        self.tokens, self.parents, self.scores, self.depths, self.fed_parents = rows
        self.fed: list[dict[int, int]] = [{} for _ in range(batch)]  # node -> index in the draft cache's tree

    def add_children(
        self, expand: list[tuple[int, int]], kids: Tensor, ok: Tensor, logq: Tensor, depth: int
    ) -> list[tuple[int, int]]:
        """Attach kids[m] (where ok) below expand[m] = (row, node); returns the new (row, node)s."""
        kids, ok, logq = kids.tolist(), ok.tolist(), logq.tolist()
        new = []
        for m, (b, node) in enumerate(expand):
            base = self.scores[b][node] if node >= 0 else 0.0
            for i, x in enumerate(kids[m]):
                if ok[m][i]:
                    self.tokens[b].append(x)
                    self.parents[b].append(node)
                    self.scores[b].append(base + logq[m][i])
                    self.depths[b].append(depth)
                    new.append((b, len(self.tokens[b]) - 1))
        return new

    def to_expand(self, new: list[tuple[int, int]], depth: int, caps: list[int]) -> list[tuple[int, int]]:
        """The new nodes that get children: all of them, or a dynamic tree's topk best per row (EAGLE-2), for
        rows whose cap allows another level."""
        if self.spec.dynamic:
            by_row: dict[int, list[int]] = {}
            for b, n in new:
                by_row.setdefault(b, []).append(n)
            new = [
                (b, n)
                for b, ns in by_row.items()
                for n in sorted(ns, key=lambda n: -self.scores[b][n])[: self.spec.topk]
            ]
        return [(b, n) for b, n in new if caps[b] > depth]

    def feed(self, nodes: list[tuple[int, int]]) -> list[list[int]]:
        """Register nodes as fed to the draft model; returns the chunk of tokens to feed per row."""
        chunk: list[list[int]] = [[] for _ in self.tokens]
        for b, n in nodes:
            p = self.parents[b][n]
            self.fed[b][n] = len(self.fed_parents[b])
            self.fed_parents[b].append(self.fed[b][p] if p >= 0 else -1)
            chunk[b].append(self.tokens[b][n])
        return chunk

    def path_context(self, view: BatchView, nodes: list[tuple[int, int]], T: int) -> tuple[Tensor | None, ...]:
        """The context after each node of a fed chunk (the node's path included, `BatchView.node_context`):
        penalty counts [B, T, V], bad-word context [B, T, M] and grammar masks [B, T, V], None where unused."""
        if view.output_counts is None and view.recent is None and view.grammars is None:
            return None, None, None
        built = Draft.tree_of(self.tokens, self.parents, None, "deterministic", view.device)
        slot = torch.zeros((len(self.tokens), T), dtype=torch.int64)  # [B, T]: each fed node's slot (n + 1)
        slot[[b for b, _ in nodes], _chunk_positions(nodes)] = torch.tensor([n + 1 for _, n in nodes])
        slot = slot.to(view.device).unsqueeze(-1)
        return tuple(
            None if every is None else every.gather(1, slot.expand(-1, -1, every.shape[-1]))  # [B, N + 1, *]
            for every in view.node_context(built.token_ids, built.parents)
        )

    def prune(self) -> None:
        """EAGLE-2's re-ranking: keep the `budget` nodes of highest path probability per row (a node's ancestors
        score at least as high; ties go to the shallower node), in drafting order."""
        for b, tokens in enumerate(self.tokens):
            order = sorted(range(len(tokens)), key=lambda n: (-self.scores[b][n], self.depths[b][n], n))
            kept = sorted(order[: self.spec.budget])
            index = {n: i for i, n in enumerate(kept)}
            self.tokens[b] = [tokens[n] for n in kept]
            self.parents[b] = [index[self.parents[b][n]] if self.parents[b][n] >= 0 else -1 for n in kept]
            self.fed[b] = {index[n]: f for n, f in self.fed[b].items() if n in index}


def grow_tree(
    runner, spec: TreeSpec, view: BatchView, caps: list[int], offsets: list[int] | None = None
) -> tuple[Draft, list[int], list[dict]]:
    """Draft a tree per row with a draft model, level by level in its cache (runner: HFRunner / FastRunner; offsets:
    per row, the sequence tokens its cache skips, a draft context window's: slot n >= its head is token n + offset).
    Returns the draft, the draft cache's tree start per row and, per row, node -> fed index (for `keep_paths`)."""
    B, dev = len(view.seqs), view.device
    offsets = [0] * B if offsets is None else offsets
    caps = [max(0, min(c, spec.max_depth)) for c in caps]
    grown = TreeGrowth(spec, B)
    if max(caps, default=0) == 0:
        return Draft.tree_of(grown.tokens, grown.parents, None, spec.rule, dev), list(runner.lengths), grown.fed
    feed = [s[o + n :] if c > 0 else [] for s, o, n, c in zip(view.seqs, offsets, runner.lengths, caps)]
    logits = runner.forward(feed, logits_at="last")  # [B, V]: the root (after the pending token)
    start = list(runner.lengths)
    q = view.probs(logits)  # [B, V]: the root's context
    probs = None
    if spec.rule != "deterministic":  # q at every slot that gets children
        probs = torch.zeros((B, spec.drafted_nodes + 1, q.shape[-1]), dtype=q.dtype, device=dev)
        probs[:, 0] = q
    expand = [(b, -1) for b in range(B) if caps[b] > 0]
    q_expand = q[[b for b, _ in expand]]  # [M, V]
    for d in range(1, spec.max_depth + 1):
        width = spec.topk if spec.dynamic else spec.widths[d - 1]
        kids, ok = _children(q_expand, [b for b, _ in expand], width, spec.rule, view, d)
        logq = q_expand.gather(1, kids).clamp_min(1e-30).log()
        new = grown.add_children(expand, kids, ok, logq, d)
        expand = grown.to_expand(new, d, caps) if d < spec.max_depth else []
        if not expand:
            break
        chunk = grown.feed(expand)  # one draft forward over them: they see the prefix and their ancestors
        logits = runner.forward(chunk, parents=grown.fed_parents, tree_start=start)  # [B, T, V]
        q = view.probs(logits, *grown.path_context(view, expand, logits.shape[1]))  # [B, T, V]: each node's path
        q_expand = q[[b for b, _ in expand], _chunk_positions(expand)]  # [M, V]
        if probs is not None:
            probs[[b for b, _ in expand], [n + 1 for _, n in expand]] = q_expand
    if spec.dynamic:
        grown.prune()
    return Draft.tree_of(grown.tokens, grown.parents, probs, spec.rule, dev), start, grown.fed


def _children(
    q: Tensor, owners: list[int], width: int, rule: str, view: BatchView, depth: int
) -> tuple[Tensor, Tensor]:
    """The children of M nodes at depth - 1 (q [M, V], owners: their rows): `draw_children` for every row but those
    the randomness couples, whose children are the top of q / E under the target's noise at their output position
    (`coupled_children`; verification keeps the one equal to the target's race winner, whatever the rule)."""
    coupled = set(view.randomness.coupled_rows(view))
    if not coupled.intersection(owners):
        return draw_children(q, owners, width, rule, view.generators)
    mine = [m for m, b in enumerate(owners) if b in coupled]
    rest = [m for m, b in enumerate(owners) if b not in coupled]
    kids = torch.zeros((len(owners), width), dtype=torch.int64, device=q.device)
    ok = torch.zeros((len(owners), width), dtype=torch.bool, device=q.device)
    if rest:  # the stream's rows draw what they would draw alone (each row's uniforms in its node order)
        kids[rest], ok[rest] = draw_children(q[rest], [owners[m] for m in rest], width, rule, view.generators)
    seeds = [view.seeds[owners[m]] for m in mine]
    positions = [view.positions[owners[m]] + depth - 1 for m in mine]  # the children's output position
    kids[mine], ok[mine] = coupled_children(q[mine], seeds, positions, width)
    return kids, ok


def _chunk_positions(nodes: list[tuple[int, int]]) -> list[int]:
    """Each (row, node)'s position in its row's fed chunk: row b's nodes sit at 0, 1, ... in order."""
    counters = defaultdict(itertools.count)  # row -> its next position
    return [next(counters[b]) for b, _ in nodes]
