"""TreeSpec: parsing, node counts (one formula, with the dynamic budget), and the Draft shape built from trees."""

import pytest
import torch

from verispec.drafting import Draft, TreeSpec


def test_static_node_counts():
    spec = TreeSpec.parse("4-2-2-1")
    assert spec.max_depth == 4 and spec.branches == 4
    assert spec.drafted_nodes == spec.max_nodes == 4 + 8 + 16 + 16
    assert spec.cache_slots == spec.max_nodes


def test_dynamic_node_counts_apply_the_budget_once():
    spec = TreeSpec.parse("dynamic-5-4-24")
    assert spec.dynamic and spec.max_depth == 5 and spec.branches == 4
    assert spec.drafted_nodes == 4 + 4 * 4 * 4  # topk children of the root, then topk x topk per later depth
    assert spec.max_nodes == 24  # the budget
    assert spec.cache_slots == 24  # the target's nodes dominate the draft's topk per depth here
    small = TreeSpec.parse("dynamic-2-3-100")
    assert small.max_nodes == small.drafted_nodes == 3 + 9  # a budget above what is drafted changes nothing


@pytest.mark.parametrize("bad", ["0-1", "2-x", "dynamic-x", "dynamic-2-2", "", "dynamic-0-2-4"])
def test_bad_specs_are_refused(bad):
    with pytest.raises(ValueError):
        TreeSpec.parse(bad)


def test_sampled_dynamic_trees_and_huge_trees_are_refused():
    with pytest.raises(ValueError, match="deterministic"):
        TreeSpec.parse("dynamic-3-2-8", "iid")
    with pytest.raises(ValueError, match="at most"):
        TreeSpec.parse("8-8-8")


def test_draft_of_a_tree_has_depths_and_padding():
    d = Draft.tree_of([[5, 6, 7], [9]], [[-1, -1, 1], [-1]], None, "deterministic", torch.device("cpu"))
    assert not d.chain and d.num_nodes == [3, 1] and d.depth == [2, 1]
    assert d.token_ids.tolist() == [[5, 6, 7], [9, -1, -1]]
    assert d.parents.tolist() == [[-1, -1, 1], [-1, -1, -1]]


def test_draft_of_a_chain_has_chain_parents():
    q = torch.full((2, 3, 4), 0.25)
    d = Draft.chain_of(torch.tensor([[1, 2], [3, -1]]), q, [2, 1])
    assert d.chain and d.rule == "iid" and d.depth == [2, 1]
    assert d.parents.tolist() == [[-1, 0], [-1, 0]]


def test_draft_probs_must_match_the_rule():
    with pytest.raises(ValueError, match="one-hot"):
        Draft.tree_of([[1]], [[-1]], None, "iid", torch.device("cpu"))
