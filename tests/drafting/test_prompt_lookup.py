"""Prompt lookup: the latest match's continuation as a chain, and several matches merged into one trie."""

import pytest
import torch

from verispec.drafting import BatchView, Draft, PromptLookupProposer, TreeSpec
from verispec.drafting.prompt_lookup import lookup, lookup_all, trie
from verispec.sampling import SamplingParams


def test_lookup_takes_the_latest_match_of_the_longest_ngram():
    seq = torch.tensor([5, 6, 7, 1, 5, 6, 8, 2, 5, 6])
    assert lookup(seq, (2, 1), 3) == [8, 2, 5]  # "5 6" last seen at 4: continues 8 2 5
    assert lookup(seq, (3,), 3) == []  # "8 5 6"... the 3-gram "2 5 6" never occurred before
    assert lookup(torch.tensor([1, 2, 3]), (1,), 2) == []  # no earlier occurrence of 3
    assert lookup(torch.tensor([4, 9, 4]), (1,), 5) == [9, 4]  # cut at the end of the sequence


def test_lookup_all_gives_distinct_continuations_most_recent_first():
    seq = torch.tensor([1, 2, 3, 1, 2, 4, 1, 2, 4, 1])
    conts = lookup_all(seq, (1,), depth=2, branches=3)
    assert conts == [[2, 4], [2, 3]]  # 1 at 6 -> 2 4, at 3 -> 2 4 (a duplicate, dropped), at 0 -> 2 3
    assert lookup_all(seq, (1,), depth=2, branches=1) == [[2, 4]]


def test_trie_merges_shared_prefixes_and_keeps_the_node_budget():
    toks, pars = trie([[2, 4, 6], [2, 3], [7]], max_nodes=10)
    assert toks == [2, 4, 6, 3, 7] and pars == [-1, 0, 1, 0, -1]
    toks, pars = trie([[2, 4, 6], [2, 3], [7]], max_nodes=3)
    assert toks == [2, 4, 6] and pars == [-1, 0, 1]  # the budget ends inside the second continuation


def _view(seqs):
    return BatchView(
        seqs=seqs, params=[SamplingParams()] * len(seqs), generators=[torch.Generator() for _ in seqs], vocab_size=16
    )


def test_chain_proposals_are_one_hot_chains_within_each_cap():
    prop = PromptLookupProposer((2, 1))
    d = prop.propose(_view([[3, 4, 5, 6, 3, 4], [1, 2, 3]]), [2, 4])
    assert isinstance(d, Draft) and d.chain and d.probs is None and d.rule == "deterministic"
    assert d.num_nodes == [2, 0] and d.depth == [2, 0]
    assert d.token_ids[0].tolist() == [5, 6] and d.token_ids[1].tolist() == [-1, -1]
    assert d.parents[0].tolist() == [-1, 0]


def test_trie_proposals_respect_caps_and_budget():
    spec = TreeSpec(widths=(3, 1, 1))
    prop = PromptLookupProposer((1,), tree=spec)
    seq = [1, 2, 4, 1, 3, 5, 1, 2, 6, 1]
    d = prop.propose(_view([seq, seq]), [3, 1])
    assert not d.chain and d.rule == "deterministic"
    tokens = [d.token_ids[b, : d.num_nodes[b]].tolist() for b in range(2)]
    parents = [d.parents[b, : d.num_nodes[b]].tolist() for b in range(2)]
    # matches of the last token 1 at 6, 3, 0 continue 2 6 1 | 3 5 1 | 2 4 1; the first and last share "2"
    assert tokens[0] == [2, 6, 1, 3, 5, 1, 4, 1] and parents[0] == [-1, 0, 1, -1, 3, 4, 0, 6]
    assert tokens[1] == [2, 3] and parents[1] == [-1, -1]  # cap 1: depth-1 branches only
    assert d.depth == [3, 1]


def test_prompt_lookup_trees_must_be_deterministic():
    with pytest.raises(ValueError, match="deterministic"):
        PromptLookupProposer(tree=TreeSpec(widths=(2, 1), rule="iid"))
    with pytest.raises(ValueError, match="n-gram sizes"):
        PromptLookupProposer((0,))
