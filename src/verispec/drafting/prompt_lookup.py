"""Prompt lookup (n-gram) drafting: the continuation of the latest earlier occurrence of the sequence's last n
tokens, n from the largest configured size down. Deterministic, so q is one-hot. A continuation stops before a token
the request can never sample (allowed_token_ids, one-token bad words). With a TreeSpec: the continuations of several
matches (latest first, longer n-grams first, up to the tree's first width) as the branches of one trie.

Its signal (`Signal`) for the draft-length controller: the bucket (n, votes) — the matched n-gram size and how many
of the earlier matches continue with the same next token (capped at MAX_VOTES), as SuffixDecoding scores a
continuation by how often it was seen — and the continuation's length as the depth. No match: no signal (the row
decodes plainly)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from torch import Tensor

from ..sampling import SamplingParams
from .base import BatchView, Draft, Proposer, Signal, padded
from .tree import TreeSpec

__all__ = ["PromptLookupProposer", "continuations", "lookup", "lookup_all", "match", "trie", "unblocked_prefix"]

SEP = -1  # separates the sequences of a corpus (`continuations`)
MAX_VOTES = 3  # agreeing earlier matches counted in a signal's bucket
SIGNAL_DEPTH = 64  # tokens of a continuation a signal reads (engine.adaptive.MAX_GAMMA)


def checked_ngram_sizes(ngram_sizes) -> tuple[int, ...]:
    """The distinct n-gram sizes, largest first (each an integer >= 1)."""
    sizes = tuple(sorted({int(n) for n in ngram_sizes}, reverse=True))
    if not sizes or sizes[-1] < 1:
        raise ValueError(f"n-gram sizes must be integers >= 1, got {ngram_sizes}")
    return sizes


def lookup(seq: Sequence[int] | Tensor, n_sizes: tuple[int, ...], gamma: int) -> list[int]:
    """seq [L] -> up to gamma tokens following the latest earlier match of the last n tokens."""
    found = lookup_all(seq, n_sizes, gamma, 1)
    return found[0] if found else []


def match(seq: Sequence[int] | Tensor, n_sizes: tuple[int, ...], depth: int) -> tuple[list[int], int, int]:
    """(continuation, n, votes): up to `depth` tokens after the latest earlier match of the last n tokens (n the
    largest size that matches), and how many matches of that size continue with the continuation's first token;
    ([], 0, 0) without a match. One slice, whatever the number of matches (a signal is read every step)."""
    seq = np.asarray(seq, dtype=np.int64)
    L = seq.shape[0]
    for n in n_sizes:
        if n >= L:
            continue
        hits = np.flatnonzero(_windows_equal(seq, seq[-n:]))  # starts of earlier matches with a successor
        if hits.size:
            nxt = seq[hits + n]  # [H]: the token after each match
            start = int(hits[-1]) + n
            return seq[start : start + depth].tolist(), n, int((nxt == nxt[-1]).sum())
    return [], 0, 0


def _windows_equal(corpus: np.ndarray, query: np.ndarray) -> np.ndarray:
    """[L - n] bool: whether corpus[i : i + n] == query, for the windows that have a successor."""
    n, L = query.shape[0], corpus.shape[0]
    match = corpus[: L - n] == query[0]
    for i in range(1, n):
        match &= corpus[i : L - n + i] == query[i]
    return match


def lookup_all(seq: Sequence[int] | Tensor, n_sizes: tuple[int, ...], depth: int, branches: int) -> list[list[int]]:
    """Up to `branches` distinct continuations (each up to `depth` tokens) of earlier matches of the last n
    tokens: most recent match first, larger n first."""
    seq, found = np.asarray(seq, dtype=np.int64), []
    for n in n_sizes:
        for cont in reversed(continuations(seq, seq[-n:], depth, max_hits=len(seq))):
            if not any(f[: len(cont)] == cont for f in found):
                found.append(cont)
                if len(found) == branches:
                    return found
    return found


def continuations(corpus: np.ndarray, query: np.ndarray, depth: int, max_hits: int = 32) -> list[list[int]]:
    """corpus [L] int64 (sequences separated by -1), query [n] -> the up to `depth` tokens after each of the
    last `max_hits` occurrences of query that have a successor (a continuation stops at a separator; empty ones
    are dropped). numpy, not torch: these arrays are short and per-op overhead dominates."""
    corpus, query = np.asarray(corpus), np.asarray(query)
    n, L = query.shape[0], corpus.shape[0]
    if n == 0 or n >= L or depth < 1:
        return []
    hits = np.flatnonzero(_windows_equal(corpus, query))[-max_hits:]
    if hits.size == 0:
        return []
    idx = hits[:, None] + n + np.arange(depth)  # [H, depth]
    conts = np.where(idx < L, corpus[np.minimum(idx, L - 1)], SEP)
    length = np.where((conts == SEP).any(1), (conts == SEP).argmax(1), depth)
    return [row[:k] for row, k in zip(conts.tolist(), length.tolist()) if k]


class PromptLookupProposer(Proposer):
    """Prompt lookup: a chain (the latest match's continuation) or, with `tree`, a trie of several matches."""

    name = "ngram"

    def __init__(self, ngram_sizes: tuple[int, ...] = (3, 2, 1), tree: TreeSpec | None = None):
        self.ngram_sizes = checked_ngram_sizes(ngram_sizes)
        if tree is not None and tree.rule != "deterministic":
            raise ValueError("prompt-lookup trees are deterministic (one-hot q): use tree rule 'deterministic'")
        self.tree = tree  # branches = its first width (a dynamic tree's top-k), depth = its depth
        self._matches: list[tuple[list[int], int, int]] | None = None  # per row, from `signals`: (cont, n, votes)
        self._lengths: list[int] = []

    def signals(self, view: BatchView) -> list[tuple[Signal | None]]:
        self._matches = [self._match(seq, params) for seq, params in zip(view.seqs, view.params)]
        self._lengths = [len(seq) for seq in view.seqs]  # the sequences the matches are of
        return [(Signal((n, min(votes, MAX_VOTES)), len(cont)) if cont else None,) for cont, n, votes in self._matches]

    def _match(self, seq: list[int], params) -> tuple[list[int], int, int]:
        cont, n, votes = match(seq, self.ngram_sizes, SIGNAL_DEPTH)
        return unblocked_prefix(cont, params), n, votes

    def propose(self, view: BatchView, caps: list[int]) -> Draft:
        if self.tree is not None:
            return self._trie(view, caps)
        matches = self._matches  # this step's signals read them (the same sequences)
        if matches is None or self._lengths != [len(seq) for seq in view.seqs]:
            matches = [([], 0, 0) if g <= 0 else self._match(s, p) for s, p, g in zip(view.seqs, view.params, caps)]
        self._matches = None
        found = [cont[: max(g, 0)] for (cont, _, _), g in zip(matches, caps)]
        return Draft.chain_of(padded(found).to(view.device), None, [len(f) for f in found])

    def _trie(self, view: BatchView, caps: list[int]) -> Draft:
        """A trie of up to `branches` matches' continuations per row, at most caps[b] deep, within the node budget."""
        spec = self.tree
        tokens, parents = [], []
        for seq, cap, params in zip(view.seqs, caps, view.params):
            depth = min(cap, spec.max_depth)
            conts = lookup_all(seq, self.ngram_sizes, depth, spec.branches) if cap > 0 else []
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
