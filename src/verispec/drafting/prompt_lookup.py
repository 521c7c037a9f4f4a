"""Prompt lookup (n-gram) drafting: propose the continuation of the most recent earlier occurrence of the
sequence's last n tokens, for n from the largest configured size down. Deterministic, so q is one-hot. A
continuation stops before a token the request can never sample (allowed_token_ids, one-token bad words).

As a tree (with a TreeSpec): the continuations of several matches (most recent first, longer
n-grams first, up to the tree's first width) become sibling branches of one trie, verified with the
deterministic rule."""

from __future__ import annotations

import torch

from ..sampling import SamplingParams
from .base import BatchView, Draft, Proposer
from .tree import TreeSpec

__all__ = ["PromptLookupProposer", "lookup", "lookup_all", "trie", "unblocked_prefix"]


def lookup(seq: torch.Tensor, n_sizes: tuple[int, ...], gamma: int) -> list[int]:
    """seq [L] int64 -> up to gamma tokens following the latest earlier match of the last n tokens."""
    L = seq.shape[0]
    for n in n_sizes:
        if n >= L:
            continue
        windows = seq[: L - 1].unfold(0, n, 1)  # [L - n, n]: every n-gram that has a successor
        hits = (windows == seq[L - n :]).all(dim=1).nonzero()
        if hits.numel():
            start = int(hits[-1]) + n
            return seq[start : start + gamma].tolist()
    return []


def lookup_all(seq: torch.Tensor, n_sizes: tuple[int, ...], depth: int, branches: int) -> list[list[int]]:
    """Up to `branches` distinct continuations (each up to `depth` tokens) of earlier matches of the last n
    tokens: most recent match first, larger n first."""
    L = seq.shape[0]
    found: list[list[int]] = []
    for n in n_sizes:
        if n >= L:
            continue
        windows = seq[: L - 1].unfold(0, n, 1)
        hits = (windows == seq[L - n :]).all(dim=1).nonzero().flatten().tolist()
        for h in reversed(hits):
            cont = seq[h + n : h + n + depth].tolist()
            if cont and not any(f[: len(cont)] == cont for f in found):
                found.append(cont)
                if len(found) == branches:
                    return found
    return found


class PromptLookupProposer(Proposer):
    """Prompt lookup: a chain (the latest match's continuation) or, with `tree`, a trie of several matches."""

    name = "ngram"

    def __init__(self, ngram_sizes: tuple[int, ...] = (3, 2, 1), tree: TreeSpec | None = None):
        sizes = tuple(sorted({int(n) for n in ngram_sizes}, reverse=True))
        if not sizes or sizes[-1] < 1:
            raise ValueError(f"n-gram sizes must be integers >= 1, got {ngram_sizes}")
        self.ngram_sizes = sizes
        if tree is not None and tree.rule != "deterministic":
            raise ValueError("prompt-lookup trees are deterministic (one-hot q): use tree rule 'deterministic'")
        self.tree = tree  # branches = its first width (a dynamic tree's top-k), depth = its depth

    def propose(self, view: BatchView, caps: list[int]) -> Draft:
        if self.tree is not None:
            return self._trie(view, caps)
        B = len(view.seqs)
        k = max(caps, default=0)
        ids = torch.full((B, k), -1, dtype=torch.int64)
        counts = []
        for b, (seq, g) in enumerate(zip(view.seqs, caps)):
            found = lookup(torch.as_tensor(seq), self.ngram_sizes, g) if g > 0 else []
            found = unblocked_prefix(found, view.params[b])
            ids[b, : len(found)] = torch.as_tensor(found, dtype=torch.int64)
            counts.append(len(found))
        return Draft.chain_of(ids[:, : max(counts, default=0)].to(view.device), None, counts)

    def _trie(self, view: BatchView, caps: list[int]) -> Draft:
        """A trie of up to `branches` matches' continuations per row, at most caps[b] deep, within the node budget."""
        spec = self.tree
        tokens, parents = [], []
        for seq, cap, params in zip(view.seqs, caps, view.params):
            conts = (
                lookup_all(torch.as_tensor(seq), self.ngram_sizes, min(cap, spec.max_depth), spec.branches)
                if cap > 0
                else []
            )
            toks, pars = trie([unblocked_prefix(c, params) for c in conts], spec.max_nodes)
            tokens.append(toks)
            parents.append(pars)
        return Draft.tree_of(tokens, parents, None, "deterministic", view.device)


def unblocked_prefix(tokens: list[int], params: SamplingParams | None) -> list[int]:
    """A chosen continuation up to its first token the request never samples (allowed_token_ids, one-token bad
    words): p = 0 there, so it and everything after it would be rejected. A deterministic cut keeps q one-hot."""
    if not isinstance(params, SamplingParams) or (params.allowed_token_ids is None and not params.bad_words):
        return tokens
    for i, t in enumerate(tokens):
        if params.blocks(t):
            return tokens[:i]
    return tokens


def trie(continuations: list[list[int]], max_nodes: int) -> tuple[list[int], list[int]]:
    """Token sequences -> one trie as node tokens and parents (-1: the root), shared prefixes merged, at most
    max_nodes nodes (a continuation stops where the budget ends; parents precede children, so it stays a tree)."""
    toks: list[int] = []
    pars: list[int] = []
    child: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
    for cont in continuations:
        node = -1
        for t in cont:
            if (node, t) not in child:
                if len(toks) == max_nodes:
                    break
                child[(node, t)] = len(toks)
                toks.append(int(t))
                pars.append(node)
            node = child[(node, t)]
    return toks, pars
