"""Drafting from rollouts already sampled for the same prompt: suffix decoding over a per-prompt corpus.

RL rollouts repeat: the G samples of a group share their prompt, and the same prompts come back every epoch.
`RolloutHistory` keeps the completions sampled for each prompt (keyed by its token ids; bounded by a total
token budget, least recently used prompts evicted first). `HistoryProposer` drafts, for every row, a trie of
the continuations that followed the row's current suffix anywhere in its corpus: the row's own sequence
(prompt lookup), the running samples of its group (siblings) and the stored completions of its prompt —
longest matching suffix first (`ngram_sizes`), continuations merged into a trie whose nodes are chosen
best-first by how many continuations pass through them (the frequency ranking of SuffixDecoding, Oliaro et
al. 2024), at most `topk` children per node, `depth` deep, `budget` nodes.

Exact whatever the corpus holds: the trie's children are chosen, not sampled, so q is one-hot and the tree is
verified with the deterministic rule. History sampled under older weights, or by another model, can only make
speculation slower, never biased. The samples of a group stay independent: row b's next token follows the
target given b's own prefix whatever its siblings drafted it (the siblings' tokens choose only which one-hot
drafts b's verification tests), so the joint law of the group is that of G independent target samples.
"""

from __future__ import annotations

import bisect
import heapq
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from .base import BatchView, Draft, Proposer
from .tree import TreeSpec

__all__ = ["HistoryProposer", "RolloutHistory", "continuations", "frequency_trie"]

_SEP = -1  # separates the sequences of a corpus
_EMPTY = np.empty(0, dtype=np.int64)
_SEP_ARRAY = np.array([_SEP], dtype=np.int64)


class RolloutHistory:
    """Completions sampled per prompt, for drafting: bounded by `max_tokens` in all (LRU over prompts) and by
    `per_prompt` completions per prompt (the most recent kept)."""

    def __init__(self, max_tokens: int = 4_000_000, per_prompt: int = 64):
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {max_tokens!r}")
        if isinstance(per_prompt, bool) or not isinstance(per_prompt, int) or per_prompt < 1:
            raise ValueError(f"per_prompt must be an integer >= 1, got {per_prompt!r}")
        self.max_tokens = max_tokens
        self.per_prompt = per_prompt
        self._store: OrderedDict[tuple[int, ...], list[list[int]]] = OrderedDict()
        self._corpus: dict[tuple[int, ...], np.ndarray] = {}  # cached concatenation, rebuilt after an add
        self.num_tokens = 0

    def __len__(self) -> int:  # prompts held
        return len(self._store)

    def add(self, prompt: Sequence[int], completion: Sequence[int]) -> None:
        if not completion:
            return
        key = tuple(int(t) for t in prompt)
        done = self._store.pop(key, [])
        done.append([int(t) for t in completion])
        self.num_tokens += len(completion)
        while len(done) > self.per_prompt:
            self.num_tokens -= len(done.pop(0))
        self._store[key] = done  # most recently used last
        self._corpus.pop(key, None)
        while self.num_tokens > self.max_tokens and len(self._store) > 1:
            old, seqs = self._store.popitem(last=False)
            self._corpus.pop(old, None)
            self.num_tokens -= sum(map(len, seqs))

    def completions(self, prompt: Sequence[int]) -> list[list[int]]:
        return list(self._store.get(tuple(prompt), []))

    def corpus(self, key: tuple[int, ...]) -> np.ndarray:
        """[L] int64: the prompt's completions, each followed by a separator (empty when none)."""
        if key not in self._store:
            return _EMPTY
        self._store.move_to_end(key)
        if key not in self._corpus:
            self._corpus[key] = np.array([t for c in self._store[key] for t in (*c, _SEP)], dtype=np.int64)
        return self._corpus[key]

    def clear(self) -> None:
        self._store.clear()
        self._corpus.clear()
        self.num_tokens = 0


def continuations(corpus: np.ndarray, query: np.ndarray, depth: int, max_hits: int = 32) -> list[list[int]]:
    """corpus [L] int64 (sequences separated by -1), query [n] -> the up to `depth` tokens after each of the
    last `max_hits` occurrences of query that have a successor (a continuation stops at a separator; empty ones
    are dropped). numpy, not torch: these arrays are short and per-op overhead dominates."""
    corpus, query = np.asarray(corpus), np.asarray(query)
    n, L = query.shape[0], corpus.shape[0]
    if n == 0 or n >= L:
        return []
    match = corpus[: L - n] == query[0]  # [L - n]: windows starting at i that have a successor
    for i in range(1, n):
        match &= corpus[i : L - n + i] == query[i]
    hits = np.flatnonzero(match)[-max_hits:]
    if hits.size == 0:
        return []
    idx = hits[:, None] + n + np.arange(depth)  # [H, depth]
    conts = np.where(idx < L, corpus[np.minimum(idx, L - 1)], _SEP)
    length = np.where((conts == _SEP).any(1), (conts == _SEP).argmax(1), depth)
    return [row[:k] for row, k in zip(conts.tolist(), length.tolist()) if k]


def frequency_trie(
    conts: list[list[int]], max_nodes: int, max_children: int, min_share: float = 0.0
) -> tuple[list[int], list[int]]:
    """Continuations -> a trie of at most max_nodes nodes (tokens, parents; -1 = the root), chosen best-first by
    the number of continuations through each node (ties: shallower, then earlier), at most max_children each,
    and only nodes that at least min_share of the continuations pass through (the empirical probability of the
    path: a node the history barely supports costs a verification slot for little). Parents precede children."""
    count: dict[tuple[int, ...], int] = {}
    for c in conts:
        for d in range(1, len(c) + 1):
            count[tuple(c[:d])] = count.get(tuple(c[:d]), 0) + 1
    kids: dict[tuple[int, ...], list[tuple[int, ...]]] = {}
    for path in count:
        kids.setdefault(path[:-1], []).append(path)
    order = 0
    heap: list[tuple[int, int, int, tuple[int, ...], int]] = []

    def push(parent_path: tuple[int, ...], parent_node: int) -> None:
        nonlocal order
        best = sorted(kids.get(parent_path, []), key=lambda p: -count[p])[:max_children]
        for p in best:
            heapq.heappush(heap, (-count[p], len(p), order, p, parent_node))
            order += 1

    push((), -1)
    toks: list[int] = []
    pars: list[int] = []
    need = min_share * len(conts)
    while heap and len(toks) < max_nodes and -heap[0][0] >= need:
        _, _, _, path, parent = heapq.heappop(heap)
        toks.append(path[-1])
        pars.append(parent)
        push(path, len(toks) - 1)
    return toks, pars


class HistoryProposer(Proposer):
    """Suffix decoding over each row's own sequence, its group's running samples and `history` (see the module
    docstring). tree: the trie's shape as a dynamic TreeSpec (depth, children per node, node budget). siblings: how
    many running samples of the same prompt a row reads (the nearest rows: a group's samples sit together).
    min_share: keep only trie nodes that at least this share of the matched continuations pass through."""

    name = "history"

    def __init__(
        self,
        history: RolloutHistory | None = None,
        ngram_sizes: Sequence[int] = (8, 4, 2, 1),
        min_share: float = 0.0,
        tree: TreeSpec | None = None,
        siblings: int = 16,
    ):
        sizes = tuple(sorted({int(n) for n in ngram_sizes}, reverse=True))
        if not sizes or sizes[-1] < 1:
            raise ValueError(f"n-gram sizes must be integers >= 1, got {ngram_sizes}")
        tree = tree if tree is not None else TreeSpec(dynamic=True, depth=8, topk=3, budget=16)
        if not isinstance(tree, TreeSpec) or tree.rule != "deterministic":
            raise ValueError("history tries are deterministic (one-hot q): give a TreeSpec with rule 'deterministic'")
        if not 0.0 <= min_share <= 1.0:
            raise ValueError(f"min_share must be in [0, 1], got {min_share!r}")
        self.min_share = min_share
        self.history = history if history is not None else RolloutHistory()
        self.ngram_sizes = sizes
        self.tree = tree
        if isinstance(siblings, bool) or not isinstance(siblings, int) or siblings < 0:
            raise ValueError(
                f"siblings must be an integer >= 0 (running samples of the same prompt to read), got {siblings!r}"
            )
        self.siblings = siblings
        self._prompt_lens: list[int] = []  # per row
        self._keys: list[tuple[int, ...]] = []  # per row: its prompt

    def start(self, view: BatchView, capacity: int) -> None:
        self._prompt_lens, self._keys = [], []
        self.add(view, capacity)

    def add(self, view: BatchView, capacity: int) -> None:  # a joining row's sequence is its prompt
        self._prompt_lens += [len(s) for s in view.seqs]
        self._keys += [tuple(s) for s in view.seqs]

    def select(self, rows: list[int]) -> None:
        self._prompt_lens = [self._prompt_lens[r] for r in rows]
        self._keys = [self._keys[r] for r in rows]

    def propose(self, view: BatchView, caps: list[int]) -> Draft:
        spec = self.tree
        groups: dict[tuple[int, ...], list[int]] = {}
        for b, key in enumerate(self._keys):
            groups.setdefault(key, []).append(b)
        seqs = [np.asarray(s, dtype=np.int64) for s in view.seqs]
        tokens, parents = [], []
        for b, cap in enumerate(caps):
            toks, pars = ([], [])
            if cap > 0:
                corpus = self._corpus(seqs, b, groups[self._keys[b]])
                conts = self._match(corpus, seqs[b], min(cap, spec.max_depth))
                toks, pars = frequency_trie(conts, spec.max_nodes, spec.topk, self.min_share)
            tokens.append(toks)
            parents.append(pars)
        return Draft.tree_of(tokens, parents, None, "deterministic", view.device)

    def _corpus(self, seqs: list[np.ndarray], b: int, group: list[int]) -> np.ndarray:
        """Row b's own sequence, its running siblings' completions and its prompt's stored completions."""
        parts = [seqs[b], _SEP_ARRAY]
        pos = bisect.bisect_left(group, b)  # group: the rows with this prompt, ascending; its own group sits around b
        lo = max(0, min(pos - self.siblings // 2, len(group) - self.siblings - 1))
        near = [c for c in group[lo : lo + self.siblings + 1] if c != b][: self.siblings]
        for c in near:
            if len(seqs[c]) > self._prompt_lens[c]:
                parts += [seqs[c][self._prompt_lens[c] :], _SEP_ARRAY]
        parts.append(self.history.corpus(self._keys[b]))
        return np.concatenate(parts)

    def _match(self, corpus: np.ndarray, seq: np.ndarray, depth: int) -> list[list[int]]:
        """The continuations of the longest suffix of seq (among ngram_sizes) found in the corpus."""
        for n in self.ngram_sizes:
            if n < seq.shape[0]:
                found = continuations(corpus, seq[-n:], depth)
                if found:
                    return found
        return []
