"""Drafting from rollouts already sampled for the same prompt: suffix decoding over a per-prompt corpus (RL groups
share their prompt, and prompts come back every epoch). `RolloutHistory` keeps the completions per prompt;
`HistoryProposer` drafts per row a trie of the continuations of its longest matching suffix in its own sequence, its
group's running samples and its prompt's stored completions, nodes chosen by how many continuations pass through
them (SuffixDecoding, Oliaro et al. 2024). Exact whatever the corpus holds: the trie is chosen (one-hot q), so stale
history only slows speculation, and a sibling's tokens choose only which drafts row b's verification tests.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from collections import Counter, OrderedDict
from collections.abc import Sequence

import numpy as np

from .base import BatchView, Draft, Proposer
from .prompt_lookup import SEP, checked_ngram_sizes, continuations
from .tree import TreeSpec

__all__ = ["HistoryProposer", "RolloutHistory", "continuations", "frequency_trie"]

_EMPTY = np.empty(0, dtype=np.int64)
_SEP_ARRAY = np.array([SEP], dtype=np.int64)


class RolloutHistory:
    """Completions sampled per prompt, for drafting: bounded by `max_tokens` in all (LRU over prompts) and by
    `per_prompt` completions per prompt (the most recent kept)."""

    def __init__(self, max_tokens: int = 4_000_000, per_prompt: int = 64):
        for name, value in (("max_tokens", max_tokens), ("per_prompt", per_prompt)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        self.max_tokens, self.per_prompt = max_tokens, per_prompt
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
            self._corpus[key] = np.array([t for c in self._store[key] for t in (*c, SEP)], dtype=np.int64)
        return self._corpus[key]

    def clear(self) -> None:
        self._store.clear()
        self._corpus.clear()
        self.num_tokens = 0


def frequency_trie(
    conts: list[list[int]], max_nodes: int, max_children: int, min_share: float = 0.0
) -> tuple[list[int], list[int]]:
    """Continuations -> a trie of at most max_nodes nodes (tokens, parents; -1 = the root), chosen best-first by
    the number of continuations through each node (ties: shallower, then earlier), at most max_children each,
    and only nodes that at least min_share of the continuations pass through (the empirical probability of the
    path: a node the history barely supports costs a verification slot for little). Parents precede children."""
    count = Counter(tuple(c[:d]) for c in conts for d in range(1, len(c) + 1))  # path -> continuations through it
    kids: dict[tuple[int, ...], list[tuple[int, ...]]] = {}
    for path in count:
        kids.setdefault(path[:-1], []).append(path)
    order = itertools.count()  # (ties after count and depth: the earlier pushed)
    heap: list[tuple[int, int, int, tuple[int, ...], int]] = []

    def push(parent_path: tuple[int, ...], parent_node: int) -> None:
        for p in sorted(kids.get(parent_path, []), key=lambda p: -count[p])[:max_children]:
            heapq.heappush(heap, (-count[p], len(p), next(order), p, parent_node))

    push((), -1)
    toks, pars = [], []
    need = min_share * len(conts)
    while heap and len(toks) < max_nodes and -heap[0][0] >= need:
        _, _, _, path, parent = heapq.heappop(heap)
        toks.append(path[-1])
        pars.append(parent)
        push(path, len(toks) - 1)
    return toks, pars


class HistoryProposer(Proposer):
    """Suffix decoding over `history` (see the module docstring). tree: the trie's shape as a dynamic TreeSpec.
    siblings: running samples of the same prompt a row reads (the nearest rows: a group's samples sit together).
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
        sizes = checked_ngram_sizes(ngram_sizes)
        tree = tree if tree is not None else TreeSpec(dynamic=True, depth=8, topk=3, budget=16)
        if not isinstance(tree, TreeSpec) or tree.rule != "deterministic":
            raise ValueError("history tries are deterministic (one-hot q): give a TreeSpec with rule 'deterministic'")
        if not 0.0 <= min_share <= 1.0:
            raise ValueError(f"min_share must be in [0, 1], got {min_share!r}")
        if isinstance(siblings, bool) or not isinstance(siblings, int) or siblings < 0:
            raise ValueError(
                f"siblings must be an integer >= 0 (running samples of the same prompt to read), got {siblings!r}"
            )
        self.history = history if history is not None else RolloutHistory()
        self.ngram_sizes, self.tree, self.min_share, self.siblings = sizes, tree, min_share, siblings
        self._keys: list[tuple[int, ...]] = []  # per row: its prompt

    def start(self, view: BatchView, capacity: int) -> None:
        self._keys = []
        self.add(view, capacity)

    def add(self, view: BatchView, capacity: int) -> None:  # a joining row's sequence is its prompt
        self._keys += [tuple(s) for s in view.seqs]

    def select(self, rows: list[int]) -> None:
        self._keys = [self._keys[r] for r in rows]

    def propose(self, view: BatchView, caps: list[int]) -> Draft:
        spec = self.tree
        groups: dict[tuple[int, ...], list[int]] = {}
        for b, key in enumerate(self._keys):
            groups.setdefault(key, []).append(b)
        seqs = [np.asarray(s, dtype=np.int64) for s in view.seqs]
        tokens, parents = [], []
        for b, cap in enumerate(caps):
            conts = []
            if cap > 0:
                conts = self._match(self._corpus(seqs, b, groups[self._keys[b]]), seqs[b], min(cap, spec.max_depth))
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
            if len(seqs[c]) > len(self._keys[c]):  # its completion so far
                parts += [seqs[c][len(self._keys[c]) :], _SEP_ARRAY]
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
