"""Kernel-level certificate for tree verifiers (`verispec certify kernel --tree RULE`). A case is a synthetic model
over a few tokens (p and q tables for every context up to length L); rows draft trees with the case's rule
(`mixed_layout` for rule "mixed"), the sampler (verify_tree's interface) verifies them, and the emitted tokens,
completed to length L by sampling p, are tested exactly: `pos j | context` and `joint` (V^L outcomes)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from scipy import stats as sps
from torch import Tensor

from ..sampling.tree import TREE_RULES, VERIFY_RULES, verify_tree
from .kernel import Battery, CaseError, CaseTests, KernelReport, normalised, run_battery
from .stats import chisquare_gof

__all__ = ["DEFAULT_TREE_SAMPLES", "TreeCase", "certify_tree_kernel", "default_tree_cases", "draft_trees", "mixed_case"]
__all__ += ["mixed_layout"]

DEFAULT_TREE_SAMPLES = 40_000  # rows (independent speculative steps) per case


@dataclass(frozen=True)
class TreeCase:
    name: str
    widths: tuple[int, ...]  # children per node at depth 1, 2, ... (a static tree; "mixed": the most per node)
    draw: str  # how the children were drafted: "iid", "without_replacement", "deterministic" (top-w of q), "mixed"
    p: Tensor  # [C, V] float64: target distribution per context (see _ctx)
    q: Tensor  # [C, V] float64: draft distribution per context
    ragged: bool = False  # rows keep a random prefix of their nodes (batch rows with different trees)
    description: str = ""
    mix: tuple[str, ...] = ()  # draw "mixed": the children's kinds per depth (see mixed_layout)
    ranking: Tensor | None = None  # [C, V] int64, "mixed": chosen children = the first of ranking[ctx] (None: top q)
    sampled_first: bool = False  # "mixed": sampled nodes numbered first (CombinedProposer), q only for their slots

    def __post_init__(self):
        if self.draw not in VERIFY_RULES:
            raise ValueError(f"draw must be one of {', '.join(VERIFY_RULES)}, got {self.draw!r}")
        if (self.draw == "mixed") != bool(self.mix) or (self.mix and len(self.mix) != len(self.widths)):
            raise ValueError("a 'mixed' case gives its children's kinds per depth (mix), one per width")
        if self.mix:
            mixed_layout(self.mix, self.sampled_first)  # raises on a bad pattern

    @property
    def vocab(self) -> int:
        return self.p.shape[1]

    @property
    def length(self) -> int:  # L: emitted tokens at most (the path through the depths, then the final token)
        return len(self.widths) + 1

    @property
    def num_nodes(self) -> int:
        return len(mixed_layout(self.mix)[0]) if self.mix else int(sum(np.cumprod(self.widths)))

    def describe(self) -> dict:  # for the report
        description = f"{self.shape} tree, children drawn {self.draw}; {self.description}"
        return dict(k=self.num_nodes, vocab=self.vocab, ragged=self.ragged, description=description)

    @property
    def shape(self) -> str:  # "3-2-1", or a mixed tree's kinds: "scc-s/c" (s sampled, c chosen; S/C: below s / c)
        return "-".join(self.mix) if self.mix else "-".join(map(str, self.widths))


def mixed_layout(mix: Sequence[str], sampled_first: bool = False) -> tuple[list[int], list[bool], list[int]]:
    """A mixed tree's static shape: mix[d] lists the kinds of a depth-d node's children in drafting order, 's'
    (sampled from q) or 'c' (chosen); 'S/C' gives the children of sampled nodes (S) and of chosen ones (C)
    apart (the root's pattern has no '/'). Nodes breadth-first, or with sampled_first all sampled nodes first
    (then no sampled node may hang below a chosen one). Returns per node: its parent (-1: the root), whether it
    is sampled, and its rank among its chosen siblings (-1 if sampled)."""
    parents: list[int] = []
    kinds: list[bool] = []
    ranks: list[int] = []
    frontier: list[tuple[int, bool]] = [(-1, True)]  # (node, sampled); the root reads its pattern's first part
    for d, pattern in enumerate(mix):
        parts = pattern.split("/")
        if len(parts) > 2 or (d == 0 and len(parts) > 1) or set(pattern) - set("sc/"):
            raise ValueError(f"mix[{d}] = {pattern!r}: kinds are 's' and 'c', optionally 'S/C' below depth 0")
        nxt = []
        for node, sampled in frontier:
            chosen = 0
            for kind in parts[0] if sampled else parts[-1]:
                parents.append(node)
                kinds.append(kind == "s")
                ranks.append(-1 if kind == "s" else chosen)
                chosen += kind == "c"
                nxt.append((len(parents) - 1, kind == "s"))
        frontier = nxt
    if not sampled_first:
        return parents, kinds, ranks
    if any(s and p >= 0 and not kinds[p] for p, s in zip(parents, kinds)):
        raise ValueError("sampled_first: a sampled node hangs below a chosen one (it would precede its parent)")
    order = [n for n, s in enumerate(kinds) if s] + [n for n, s in enumerate(kinds) if not s]
    new = {old: i for i, old in enumerate(order)}
    reordered = [new[parents[o]] if parents[o] >= 0 else -1 for o in order]
    return reordered, [kinds[o] for o in order], [ranks[o] for o in order]


def mixed_case(name: str, mix: tuple[str, ...], p: Tensor, q: Tensor, **kw) -> TreeCase:
    """A 'mixed' TreeCase; its widths (the most children of a node per depth) follow from mix."""
    widths = tuple(max(len(part) for part in pattern.split("/")) for pattern in mix)
    return TreeCase(name, widths, "mixed", p, q, mix=mix, **kw)


def _ctx_child(ctx: Tensor, tok: Tensor, V: int) -> Tensor:
    """Context index of (context, tok): contexts are numbered breadth-first, root = 0, children of c are
    c * V + 1 .. c * V + V."""
    return ctx * V + 1 + tok


def default_tree_cases(vocab: int = 6, seed: int = 0) -> list[TreeCase]:
    """For every drafting rule: a 3-2-1 tree and a wide 4-1 tree (different q quality), plus ragged rows and
    adversarial / sparse q; then five mixed trees (see _mixed_cases); vocabulary 6, so the joint law of 3-4 tokens
    is testable exactly. The mixed cases come last: the other cases' p, q and seeds are those they always had."""
    g = torch.Generator().manual_seed(seed)
    V = vocab

    def model(depth: int, scale: float) -> Tensor:
        C = sum(V**i for i in range(depth + 2))  # contexts of length < depth + 2
        return (scale * torch.randn(C, V, generator=g, dtype=torch.float64)).softmax(-1)

    cases = []
    for draw in TREE_RULES:
        p = model(3, 1.5)
        q = (0.6 * p.log() + 0.8 * torch.randn(p.shape, generator=g, dtype=torch.float64)).softmax(-1)
        cases.append(TreeCase(f"{draw}-3-2-1", (3, 2, 1), draw, p, q, description="q = a noisy copy of p"))
        p, q = model(2, 2.0), model(2, 2.0)
        cases.append(TreeCase(f"{draw}-4-1", (4, 1), draw, p, q, description="p, q independent"))
        p = model(2, 1.5)
        q = normalised(1 / p)
        adversarial = "q proportional to 1 / p; rows keep a random prefix of their nodes"
        cases.append(
            TreeCase(f"{draw}-2-2-ragged-adversarial", (2, 2), draw, p, q, ragged=True, description=adversarial)
        )
    p = model(2, 1.5)
    p[:, :2] = 0
    p = normalised(p)
    q = model(2, 1.5)
    cases.append(TreeCase("iid-3-2-sparse", (3, 2), "iid", p, q, description="p = 0 on two tokens q likes"))
    return cases + _mixed_cases(g, model)


def _mixed_cases(g: torch.Generator, model: Callable[[int, float], Tensor]) -> list[TreeCase]:
    """Rule "mixed": chosen children (top of q, or a fixed ranking unrelated to q, as n-gram / history matches)
    and children sampled i.i.d. from q at the same nodes, in CombinedProposer's order, the reverse, interleaved."""

    def noisy(p: Tensor) -> Tensor:
        return (0.6 * p.log() + 0.8 * torch.randn(p.shape, generator=g, dtype=torch.float64)).softmax(-1)

    def table(p: Tensor) -> Tensor:  # [C, V]: a fixed random ranking of the tokens per context
        return torch.rand(p.shape, generator=g, dtype=torch.float64).argsort(-1)

    p1 = model(3, 1.5)
    combined = (
        "CombinedProposer's tree: a sampled chain of 3 (numbered first; draft_probs only for its slots) beside a "
        "chosen 2-1-1 trie (top of q); q = a noisy copy of p"
    )
    chain = mixed_case(
        "mixed-chain3+branches-2-1-1", ("scc", "s/c", "s/c"), p1, noisy(p1), sampled_first=True, description=combined
    )
    p2 = model(3, 1.5)
    q2, rank2 = noisy(p2), table(p2)
    p3, q3 = model(2, 2.0), model(2, 2.0)
    p4 = model(2, 1.5)
    q4, rank4 = normalised(1 / p4), table(p4)
    p5 = model(2, 1.5)
    p5[:, :2] = 0
    p5 = normalised(p5)
    reverse = "the reverse order: 2 chosen branches (a fixed ranking) before a sampled chain"
    inter = "interleaved; chosen by a fixed ranking; q proportional to 1 / p; ragged rows"
    return [
        chain,
        mixed_case("mixed-branches+chain-ranked", ("ccs", "c/s", "c/s"), p2, q2, ranking=rank2, description=reverse),
        mixed_case("mixed-ccss-cs", ("ccss", "cs"), p3, q3, description="2 chosen (top of q), then 2 i.i.d. from q"),
        mixed_case(
            "mixed-scsc-sc-ragged-adversarial", ("scsc", "sc"), p4, q4, ranking=rank4, ragged=True, description=inter
        ),
        mixed_case("mixed-ccs-sc-sparse", ("ccs", "sc"), p5, model(2, 1.5), description="p = 0 on 2 tokens q likes"),
    ]


def draft_trees(case: TreeCase, rows: int, generator: torch.Generator) -> dict[str, Tensor]:
    """Draft `rows` trees of the case's shape from q; nodes breadth-first, siblings in drafting order."""
    if case.draw == "mixed":
        return _draft_mixed(case, rows, generator)
    V = case.vocab
    tokens, parents, ctxs = [], [], []  # per node: [rows] tensors
    frontier = [(-1, torch.zeros(rows, dtype=torch.int64))]  # (parent node index, its context [rows])
    for w in case.widths:
        nxt = []
        for par, ctx in frontier:
            q = case.q[ctx]  # [rows, V]
            if case.draw == "deterministic":
                kids = q.topk(w, dim=-1, sorted=True).indices  # [rows, w]
            else:
                kids = torch.multinomial(q, w, replacement=case.draw == "iid", generator=generator)  # [rows, w]
            for i in range(w):
                tokens.append(kids[:, i])
                parents.append(torch.full((rows,), par, dtype=torch.int64))
                ctxs.append(_ctx_child(ctx, kids[:, i], V))
                nxt.append((len(tokens) - 1, ctxs[-1]))
        frontier = nxt
    slot_ctx = torch.cat([torch.zeros(rows, 1, dtype=torch.int64), torch.stack(ctxs, 1)], 1)  # [rows, N + 1]
    return _tree_inputs(case, generator, torch.stack(tokens, 1), torch.stack(parents, 1), slot_ctx, slot_ctx)


def _tree_inputs(
    case: TreeCase, generator: torch.Generator, ids: Tensor, parents: Tensor, slot_ctx: Tensor, q_ctx: Tensor, **extra
) -> dict[str, Tensor]:
    """The sampler's arguments for drafted trees (ids, parents [rows, N]): p at every slot's context (slot_ctx
    [rows, N + 1]), q at the contexts q_ctx, and N nodes per row (ragged: a random prefix of them)."""
    rows, N = ids.shape
    num_nodes = torch.full((rows,), N, dtype=torch.int64)
    if case.ragged:
        num_nodes = torch.randint(0, N + 1, (rows,), generator=generator)
    p, q = case.p[slot_ctx], case.q[q_ctx]
    return dict(target_probs=p, draft_token_ids=ids, parents=parents, draft_probs=q, num_nodes=num_nodes, **extra)


def _draft_mixed(case: TreeCase, rows: int, generator: torch.Generator) -> dict[str, Tensor]:
    """A mixed tree per row (mixed_layout's order): sampled nodes i.i.d. from q at their parent, chosen ones the
    top of q or of case.ranking there (distinct among the chosen siblings, whatever the sampled ones drew)."""
    parents, kinds, ranks = mixed_layout(case.mix, case.sampled_first)
    N, V = len(parents), case.vocab
    ids = torch.empty((rows, N), dtype=torch.int64)
    slot_ctx = torch.zeros((rows, N + 1), dtype=torch.int64)
    ranked: dict[int, Tensor] = {}  # parent slot -> [rows, V]: its tokens in the order chosen children take them
    for n, (par, sampled, rank) in enumerate(zip(parents, kinds, ranks)):
        ctx = slot_ctx[:, par + 1]
        if sampled:
            x = torch.multinomial(case.q[ctx], 1, generator=generator).squeeze(1)
        else:
            if par + 1 not in ranked:
                order = case.q[ctx].argsort(dim=-1, descending=True, stable=True)
                ranked[par + 1] = order if case.ranking is None else case.ranking[ctx]
            x = ranked[par + 1][:, rank]
        ids[:, n] = x
        slot_ctx[:, n + 1] = _ctx_child(ctx, x, V)
    # CombinedProposer's layout gives q only for the first S slots, the parents of sampled nodes
    S = max(p + 1 for p, s in zip(parents, kinds) if s) + 1 if case.sampled_first else N + 1
    par = torch.tensor(parents, dtype=torch.int64).expand(rows, N).contiguous()
    sampled = torch.tensor(kinds, dtype=torch.bool).expand(rows, N).contiguous()
    return _tree_inputs(case, generator, ids, par, slot_ctx, slot_ctx[:, :S], sampled=sampled)


def _complete(case: TreeCase, tok: Tensor, emitted: Tensor, generator: torch.Generator) -> Tensor:
    """Emitted tokens (`emitted` [rows] of each row's tok) -> sequences of length L completed by sampling from p."""
    rows, L = tok.shape[0], case.length
    seq = torch.full((rows, L), -1, dtype=torch.int64)
    ctx = torch.zeros(rows, dtype=torch.int64)
    for j in range(L):
        draw = torch.multinomial(case.p[ctx], 1, generator=generator).squeeze(1)
        x = torch.where(j < emitted, tok[:, j] if j < tok.shape[1] else draw, draw)
        seq[:, j] = x
        ctx = _ctx_child(ctx, x, case.vocab)
    return seq


def _tests(case: TreeCase, seq: Tensor, emitted: Tensor) -> CaseTests:
    """`pos j | context` (a chi-square per context, summed) for every position j, and the joint law of `seq`."""
    V, L = case.vocab, case.length
    out = []
    ctx = torch.zeros(seq.shape[0], dtype=torch.int64)
    for j in range(L):
        on = emitted > j  # rows that emitted position j
        c, x = ctx[on].numpy(), seq[on, j].numpy()
        stat, dof, imp, n_max, law_max = 0.0, 0, 0, 0, None
        for cv in np.unique(c):
            sel = x[c == cv]
            law = case.p[int(cv)].numpy()
            res = chisquare_gof(np.bincount(sel, minlength=V), law)
            stat, dof, imp = stat + res.statistic, dof + res.dof, imp + res.impossible
            if len(sel) > n_max:
                n_max, law_max = len(sel), law
        if n_max:
            pv = 0.0 if imp else (float(sps.chi2.sf(stat, dof)) if dof else 1.0)
            stat = stat if not imp else float("inf")
            out.append((f"pos{j} | context", int(on.sum()), stat, dof, pv, imp, law_max, n_max))
        ctx = _ctx_child(ctx, seq[:, j], V)
    # the joint law of the completed sequence
    joint = torch.ones(1, dtype=torch.float64)
    cidx = torch.zeros(1, dtype=torch.int64)
    for _ in range(L):
        joint = (joint.unsqueeze(1) * case.p[cidx]).reshape(-1)  # [V^(j+1)], lexicographic in (x_0, ..., x_j)
        cidx = _ctx_child(cidx.unsqueeze(1), torch.arange(V).unsqueeze(0), V).reshape(-1)
    code = (seq * V ** torch.arange(L - 1, -1, -1)).sum(1)  # [rows]: the sequence's index, lexicographic
    law = joint.numpy()
    res = chisquare_gof(np.bincount(code.numpy(), minlength=V**L), law)
    out.append((f"joint (L = {L})", res.n, res.statistic, res.dof, res.pvalue, res.impossible, law, res.n))
    return out


def certify_tree_kernel(
    sampler: Callable = verify_tree,
    *,
    rules: Sequence[str] = VERIFY_RULES,
    cases: Sequence[TreeCase] | None = None,
    samples: int = DEFAULT_TREE_SAMPLES,
    **options,
) -> KernelReport:
    """Certify a tree verification function (`verispec certify kernel --tree`).

    Args:
        sampler: A function with verify_tree's interface, called with `rule=` the case's drafting rule (and, for
            "mixed", `sampled=`).
        rules: The drafting rules whose cases run (default: every rule verify_tree knows).
        cases: The cases (default: `default_tree_cases()`).
        samples: Rows per case.
        **options (Any): `level`, `power`, `seed`, `name` and `progress`, as `certify_kernel` takes them.

    Returns:
        The report, as `certify_kernel`'s.
    """
    unknown = [r for r in rules if r not in VERIFY_RULES]
    if unknown:
        raise ValueError(f"unknown tree rule(s) {unknown}; known: {', '.join(VERIFY_RULES)}")
    cases = [c for c in (default_tree_cases() if cases is None else cases) if c.draw in rules]
    return run_battery(sampler, cases, Battery(_run_case, 7919, "tree"), samples, **options)


def _run_case(sampler: Callable, case: TreeCase, samples: int, seed: int) -> CaseTests:
    """Draft `samples` trees, verify them with `sampler`, complete the sequences and test them (see _tests)."""
    g = torch.Generator().manual_seed(seed)
    tree = draft_trees(case, samples, g)
    torch.manual_seed(seed + 1)
    try:
        out = sampler(**tree, rule=case.draw)
        tok, na = out if isinstance(out, tuple) else (out.token_ids, out.num_accepted)
        tok, na = tok.cpu().long(), na.cpu().long()
        bad = _structure_error(tree, tok, na)
    except Exception as e:  # a crash on a valid case fails the certificate, with the reason
        raise CaseError.raised(e) from None
    if bad:
        raise CaseError(bad)
    return _tests(case, _complete(case, tok, na + 1, g), na + 1)


def _structure_error(tree: dict[str, Tensor], tok: Tensor, na: Tensor) -> str | None:
    """An accepted token must be the token of a node on one root-to-node path of the row's tree."""
    ids, par, nn = tree["draft_token_ids"], tree["parents"], tree["num_nodes"]
    rows = ids.shape[0]
    if tok.dim() != 2 or tok.shape[0] != rows or na.shape != (rows,):
        return f"output shapes {tuple(tok.shape)}, {tuple(na.shape)} do not match {rows} rows"
    if bool((na < 0).any()) or bool((na + 1 > tok.shape[1]).any()):
        return "num_accepted outside the output"
    # the accepted tokens must follow a root-to-node path (with repeated iid siblings, any of the duplicates)
    N = ids.shape[1]
    valid = torch.arange(N) < nn.unsqueeze(1)
    possible = torch.zeros((rows, N), dtype=torch.bool)  # nodes the path can be at after position j - 1
    for j in range(int(na.max()) if rows else 0):
        live = na > j
        under = (par < 0) if j == 0 else (possible.gather(1, par.clamp(min=0)) & (par >= 0))
        match = valid & under & (ids == tok[:, j].unsqueeze(1))  # [rows, N]
        ok = match.any(1) | ~live
        if not bool(ok.all()):
            b = int((~ok).nonzero()[0])
            return f"row {b}: accepted token {int(tok[b, j])} at position {j} is not a child on the tree path"
        possible = match
    return None
