"""The history drafter: continuation matching, the frequency trie, the LRU store, and proposals for a batch."""

from __future__ import annotations

import numpy as np
import pytest

from verispec.drafting import BatchView, TreeSpec
from verispec.drafting.history import HistoryProposer, RolloutHistory, continuations, frequency_trie

SEP = -1


def test_continuations_stop_at_separators_and_keep_the_latest_hits():
    corpus = np.array([5, 6, 7, 8, SEP, 5, 6, 9, SEP, 5, 6])
    assert continuations(corpus, np.array([5, 6]), 3) == [[7, 8], [9]]  # the last hit has nothing after it
    assert continuations(corpus, np.array([5, 6]), 1, max_hits=1) == [[9]]  # the latest hit with a successor
    assert continuations(corpus, np.array([4]), 3) == []
    assert continuations(np.array([5]), np.array([5, 6]), 3) == []


def test_frequency_trie_takes_the_most_travelled_nodes_first():
    conts = [[1, 2, 3], [1, 2, 4], [1, 5], [6]]
    toks, pars = frequency_trie(conts, max_nodes=4, max_children=2)
    # counts: (1): 3, (1, 2): 2, then (6) / (1, 5) / (1, 2, 3) / (1, 2, 4): 1 — shallower first, then earlier
    assert toks == [1, 2, 6, 5] and pars == [-1, 0, -1, 0]
    toks, pars = frequency_trie(conts, max_nodes=10, max_children=1)
    assert toks == [1, 2, 3] and pars == [-1, 0, 1]  # one child per node: the chain of the most common path
    assert frequency_trie([], 4, 2) == ([], [])
    toks, pars = frequency_trie(conts, max_nodes=10, max_children=3, min_share=0.5)
    assert toks == [1, 2] and pars == [-1, 0]  # (1): 3 of 4, (1, 2): 2 of 4; every other node 1 of 4
    toks, pars = frequency_trie(conts, max_nodes=10, max_children=3)
    assert sorted(toks) == [1, 2, 3, 4, 5, 6] and all(p < i for i, p in enumerate(pars))


def test_history_is_bounded_per_prompt_and_in_total():
    h = RolloutHistory(max_tokens=10, per_prompt=2)
    h.add([1, 2], [3, 4, 5])
    h.add([1, 2], [6])
    h.add([1, 2], [7, 8])  # the oldest completion of this prompt goes
    assert h.completions([1, 2]) == [[6], [7, 8]] and h.num_tokens == 3
    h.add([9], [1, 1, 1, 1, 1])
    h.corpus((1, 2))  # reading a prompt makes it the most recently used
    h.add([8], [2, 2, 2, 2, 2])  # 13 tokens > 10: the least recently used prompt, [9], is evicted
    assert h.completions([9]) == [] and h.completions([1, 2]) == [[6], [7, 8]] and h.num_tokens == 8
    assert h.corpus((1, 2)).tolist() == [6, SEP, 7, 8, SEP]
    with pytest.raises(ValueError, match="max_tokens"):
        RolloutHistory(max_tokens=0)


def _view(seqs):
    return BatchView(seqs=seqs, params=[None] * len(seqs), generators=[None] * len(seqs), vocab_size=32)


def test_proposals_come_from_history_siblings_and_the_row_itself():
    h = RolloutHistory()
    h.add([1, 2, 3], [4, 5, 6, 7])  # an earlier rollout of prompt [1, 2, 3]
    prop = HistoryProposer(h, ngram_sizes=(2, 1), tree=TreeSpec(dynamic=True, depth=3, topk=2, budget=8))
    prompts = [[1, 2, 3], [1, 2, 3], [9, 9, 8]]
    prop.start(_view([list(p) for p in prompts]), 64)
    seqs = [[1, 2, 3, 4, 5], [1, 2, 3, 20, 21, 22, 4], [9, 9, 8, 9]]
    draft = prop.propose(_view(seqs), [3, 3, 3])
    rows = [
        [(t, p) for t, p in zip(draft.token_ids[b].tolist(), draft.parents[b].tolist()) if t >= 0] for b in range(3)
    ]
    assert rows[0][:2] == [(6, -1), (7, 0)]  # history: ... 4 5 -> 6 7
    assert (5, -1) in rows[1]  # history: 4 -> 5 6 7; and its sibling row 0 has 4 -> 5
    assert rows[2][0] == (9, -1)  # its own prompt: 9 -> 9 8
    assert draft.probs is None and draft.rule == "deterministic" and not draft.chain
    empty = prop.propose(_view(seqs), [0, 0, 0])
    assert empty.num_nodes == [0, 0, 0]
    prop.select([2])
    assert prop.propose(_view([seqs[2]]), [2]).num_nodes[0] > 0


def test_history_tries_must_be_deterministic():
    with pytest.raises(ValueError, match="deterministic"):
        HistoryProposer(tree=TreeSpec(widths=(2,), rule="iid"))
