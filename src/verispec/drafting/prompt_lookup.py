"""Prompt lookup (n-gram) drafting: propose the continuation of the most recent earlier occurrence of the
sequence's last n tokens, for n from the largest configured size down. Deterministic, so q is one-hot.

As a tree (`propose_tree`, with a TreeSpec): the continuations of several matches (most recent first, longer
n-grams first, up to the tree's first width) become sibling branches of one trie, verified with the
deterministic rule."""

from __future__ import annotations

import torch

from .base import BatchView, Proposal, Proposer

__all__ = ["PromptLookupProposer"]


def lookup(seq: torch.Tensor, n_sizes: tuple[int, ...], gamma: int) -> list[int]:
    """seq [L] int64 -> up to gamma tokens following the latest earlier match of the last n tokens."""
    L = seq.shape[0]
    for n in n_sizes:
        if L <= n:
            continue
        windows = seq[: L - 1].unfold(0, n, 1)  # [L - n, n]: every n-gram that has a successor
        hits = (windows == seq[L - n:]).all(dim=1).nonzero()
        if hits.numel():
            start = int(hits[-1]) + n
            return seq[start: start + gamma].tolist()
    return []


def lookup_all(seq: torch.Tensor, n_sizes: tuple[int, ...], depth: int, branches: int) -> list[list[int]]:
    """Up to `branches` distinct continuations (each up to `depth` tokens) of earlier matches of the last n
    tokens: most recent match first, larger n first."""
    L = seq.shape[0]
    found: list[list[int]] = []
    for n in n_sizes:
        if L <= n:
            continue
        windows = seq[: L - 1].unfold(0, n, 1)
        hits = (windows == seq[L - n:]).all(dim=1).nonzero().flatten().tolist()
        for h in reversed(hits):
            cont = seq[h + n: h + n + depth].tolist()
            if cont and not any(f[: len(cont)] == cont for f in found):
                found.append(cont)
                if len(found) == branches:
                    return found
    return found


class PromptLookupProposer(Proposer):
    name = "ngram"

    def __init__(self, ngram_sizes: tuple[int, ...] = (3, 2, 1), tree=None):
        sizes = tuple(sorted({int(n) for n in ngram_sizes}, reverse=True))
        if not sizes or sizes[-1] < 1:
            raise ValueError(f"n-gram sizes must be integers >= 1, got {ngram_sizes}")
        self.ngram_sizes = sizes
        if tree is not None and tree.rule != "deterministic":
            raise ValueError("prompt-lookup trees are deterministic (one-hot q): use tree rule 'deterministic'")
        self.spec = tree  # TreeSpec or None: branches = its first width, depth = its depth

    def propose_tree(self, view: BatchView, caps: list[int]):
        """A trie of up to spec.widths[0] matches' continuations per row, at most caps[b] deep."""
        from .tree import build_proposal

        branches = self.spec.topk if self.spec.dynamic else self.spec.widths[0]
        tokens, parents = [], []
        for seq, cap in zip(view.seqs, caps):
            toks: list[int] = []
            pars: list[int] = []
            child: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
            conts = lookup_all(torch.as_tensor(seq), self.ngram_sizes, min(cap, self.spec.max_depth), branches) \
                if cap > 0 else []
            for cont in conts:
                node = -1
                for t in cont:
                    if (node, t) not in child and len(toks) == self.spec.max_nodes:
                        break  # the node budget (parents precede children, so the trie stays a tree)
                    if (node, t) not in child:
                        child[(node, t)] = len(toks)
                        toks.append(int(t))
                        pars.append(node)
                    node = child[(node, t)]
            tokens.append(toks)
            parents.append(pars)
        return build_proposal(tokens, parents, None, "deterministic", view.device)

    def propose(self, view: BatchView, gammas: list[int]) -> Proposal:
        B = len(view.seqs)
        k = max(gammas, default=0)
        if k == 0:
            return Proposal.empty(B, view.device)
        ids = torch.full((B, k), -1, dtype=torch.int64)
        counts = []
        for b, (seq, g) in enumerate(zip(view.seqs, gammas)):
            found = lookup(torch.as_tensor(seq), self.ngram_sizes, g) if g > 0 else []
            ids[b, : len(found)] = torch.as_tensor(found, dtype=torch.int64)
            counts.append(len(found))
        return Proposal(ids.to(view.device), None, counts)
