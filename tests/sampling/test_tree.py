"""Tree verification (verispec.sampling.tree): exact cases, equivalence with the chain rule, greedy, bad input.
Distributional tests per rule are in tests/certify/test_tree_kernel.py (the tree certificate)."""

from __future__ import annotations

import pytest
import torch

from verispec.sampling import verify_chain, verify_chain_with_uniforms
from verispec.sampling.tree import TREE_RULES, tree_children, verify_tree, verify_tree_with_uniforms

from ..helpers.mixed_root import MIX_P, mixed_root_law


def _gens(B, seed=0):
    return [torch.Generator().manual_seed(seed + b) for b in range(B)]


def test_children_and_depth():
    parents = torch.tensor([[-1, 0, 0, -1, 1, 4], [-1, -1, 0, 2, 0, 0]])
    children, depth = tree_children(parents, torch.tensor([6, 4]))
    assert children[0, 0].tolist()[:2] == [0, 3] and children[0, 1].tolist()[:2] == [1, 2]
    assert children[0, 5].tolist()[0] == 5 and depth[0].tolist() == [1, 2, 2, 1, 3, 4]
    assert children[1, 1].tolist()[0] == 2 and depth[1].tolist() == [1, 1, 2, 3, 0, 0]  # nodes 4, 5: padding


def test_padding_entries_are_ignored():
    parents = torch.tensor([[-1, 0, 7, 9]])  # entries beyond num_nodes hold garbage
    children, depth = tree_children(parents, torch.tensor([2]))
    assert depth[0].tolist() == [1, 2, 0, 0] and children[0, 0].tolist()[0] == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_chain_as_tree_equals_verify_chain(dtype):
    """A chain is a tree with parents -1, 0, 1, ...: rule 'iid' is verify_chain's rule, so with the same uniforms
    the outputs agree token for token, on every row. The uniforms are shared explicitly (verify_*_with_uniforms).
    (The two compute the final residual with different float operations — the tree divides its running residual
    by Z — so their inverse-CDF breakpoints may differ by a rounding, ~1e-7 relative in float32; a final uniform
    falling between two such breakpoints has probability ~1e-7 per row, and none does on these fixed inputs.)"""
    g = torch.Generator().manual_seed(1)
    B, k, V = 400, 4, 12
    p = torch.randn(B, k + 1, V, generator=g, dtype=dtype).mul(2).softmax(-1)
    q = torch.randn(B, k, V, generator=g, dtype=dtype).mul(2).softmax(-1)
    ids = torch.multinomial(q.reshape(-1, V), 1, generator=g).view(B, k)
    nd = torch.randint(0, k + 1, (B,), generator=g)
    accept_u = torch.rand(B, k, generator=g, dtype=torch.float64)
    final_u = torch.rand(B, generator=g, dtype=torch.float64)
    chain = verify_chain_with_uniforms(p, ids, q, nd, accept_u, final_u)
    parents = torch.arange(-1, k - 1).expand(B, k)
    q_slots = torch.cat([q, q[:, :1]], 1)  # slot j holds the q node j's child was drawn from; last slot unused
    tree = verify_tree_with_uniforms(p, ids, parents, q_slots, nd, "iid", accept_u, final_u)
    assert torch.equal(tree.num_accepted, chain.num_accepted)
    assert torch.equal(tree.token_ids, chain.token_ids)
    assert 0 < int((chain.num_accepted < nd).sum()) < B  # both recovered and bonus draws are compared
    # the public entry points draw those uniforms the same way from per-row generators: same outputs again
    via_chain = verify_chain(p, ids, q, nd, _gens(B))
    via_tree = verify_tree(p, ids, parents, q_slots, nd, _gens(B), rule="iid")
    assert torch.equal(via_tree.token_ids, via_chain.token_ids)


def _tiny_tree():
    # root -> a (0), b (1); a -> c (2)
    parents = torch.tensor([[-1, -1, 0]])
    ids = torch.tensor([[0, 1, 2]])
    return parents, ids


def test_deterministic_rule_exact_cases():
    parents, ids = _tiny_tree()
    p = torch.tensor([[[0.5, 0.3, 0.2], [0.0, 0.0, 1.0], [0.3, 0.3, 0.4], [1.0, 0.0, 0.0]]])
    nn = torch.tensor([3])
    # u(a) = 0.4 < p(a) = 0.5: accept a; at a, c has p = 1: accept; bonus from p after c -> token 0
    out = verify_tree_with_uniforms(
        p,
        ids,
        parents,
        None,
        nn,
        "deterministic",
        torch.tensor([[0.4, 0.9, 0.9]], dtype=torch.float64),
        torch.tensor([0.5], dtype=torch.float64),
    )
    assert out.token_ids.tolist() == [[0, 2, 0]] and out.num_accepted.tolist() == [2] and out.path[0].tolist() == [0, 2]
    # reject a (u = 0.6 >= 0.5); residual (0, 0.6, 0.4); b: 0.9 >= 0.6 rejected; residual -> token 2 for sure
    out = verify_tree_with_uniforms(
        p,
        ids,
        parents,
        None,
        nn,
        "deterministic",
        torch.tensor([[0.6, 0.9, 0.0]], dtype=torch.float64),
        torch.tensor([0.01], dtype=torch.float64),
    )
    assert out.token_ids.tolist() == [[2, -1, -1]] and out.num_accepted.tolist() == [0]
    # reject a, accept b (u = 0.5 < 0.6); b is a leaf: bonus from p after b
    out = verify_tree_with_uniforms(
        p,
        ids,
        parents,
        None,
        nn,
        "deterministic",
        torch.tensor([[0.6, 0.5, 0.0]], dtype=torch.float64),
        torch.tensor([0.99], dtype=torch.float64),
    )
    assert out.token_ids.tolist() == [[1, 2, -1]] and out.num_accepted.tolist() == [1]


def test_p_zero_node_never_accepted_even_with_u_zero():
    parents, ids = _tiny_tree()
    p = torch.tensor([[[0.0, 0.5, 0.5], [0.3, 0.3, 0.4], [0.3, 0.3, 0.4], [0.3, 0.3, 0.4]]])
    q = torch.tensor([[[0.9, 0.05, 0.05]] * 4])
    zero = torch.zeros((1, 3), dtype=torch.float64)
    for rule in ("iid", "deterministic"):
        out = verify_tree_with_uniforms(
            p, ids, parents, q, torch.tensor([3]), rule, zero, torch.tensor([0.0], dtype=torch.float64)
        )
        assert out.token_ids[0, 0] != 0


@pytest.mark.parametrize("rule", TREE_RULES)
def test_greedy_target_follows_argmax_path(rule):
    """With one-hot p every rule accepts exactly the argmax child, for any uniforms."""
    g = torch.Generator().manual_seed(3)
    B, V = 64, 10
    parents = torch.tensor([-1, -1, -1, 0, 0, 1, 3]).expand(B, 7)
    logits = torch.randn(B, 8, V, generator=g)
    q = torch.randn(B, 8, V, generator=g).softmax(-1)
    rows = []
    for b in range(B):  # distinct siblings; the argmax child exists at the root and below node 0 for most rows
        perm = torch.randperm(V, generator=g).tolist()
        for node, slot in ((0, 0), (3, 1)):
            if b % 4:  # a quarter of the rows keep a random tree
                want = int(logits[b, slot].argmax())
                j = perm.index(want)
                perm[node], perm[j] = perm[j], perm[node]
        rows.append(perm[:7])
    ids = torch.tensor(rows)
    p = torch.nn.functional.one_hot(logits.argmax(-1), V).float()
    if rule == "without_replacement":
        q = q.clamp_min(1e-3)
        q = q / q.sum(-1, keepdim=True)
    out = verify_tree(p, ids, parents, q, None, _gens(B), rule=rule)
    for b in range(B):  # reference: walk the argmax
        cur, emitted = -1, []
        while True:
            want = int(logits[b, cur + 1].argmax())
            emitted.append(want)
            kids = [n for n in range(7) if int(parents[b, n]) == cur and int(ids[b, n]) == want]
            if not kids:
                break
            cur = kids[0]
        assert out.token_ids[b, : len(emitted)].tolist() == emitted


def test_rows_independent_of_batch():
    g = torch.Generator().manual_seed(5)
    B, V = 6, 9
    parents = torch.tensor([-1, -1, 0, 0, 2]).expand(B, 5)
    p = torch.randn(B, 6, V, generator=g).softmax(-1)
    q = torch.randn(B, 6, V, generator=g).softmax(-1)
    ids = torch.multinomial(q[:, 0], 5, replacement=True, generator=g)
    nn = torch.tensor([5, 3, 0, 5, 2, 5])
    full = verify_tree(p, ids, parents, q, nn, _gens(B), rule="iid")
    for b in range(B):
        alone = verify_tree(
            p[b : b + 1], ids[b : b + 1], parents[b : b + 1], q[b : b + 1], nn[b : b + 1], _gens(1, b), rule="iid"
        )
        width = alone.token_ids.shape[1]
        assert full.token_ids[b, :width].tolist() == alone.token_ids[0].tolist()


def test_bad_input_is_a_clear_error():
    parents, ids = _tiny_tree()
    p = torch.full((1, 4, 3), 1 / 3)
    with pytest.raises(ValueError, match="rule must be one of"):
        verify_tree(p, ids, parents, rule="greedy")
    with pytest.raises(ValueError, match="needs draft_probs"):
        verify_tree(p, ids, parents, rule="iid")
    with pytest.raises(ValueError, match="parent must be -1"):
        verify_tree(p, ids, torch.tensor([[-1, 1, 0]]))
    with pytest.raises(ValueError, match="outside"):
        verify_tree(p, torch.tensor([[0, 3, 1]]), parents)
    with pytest.raises(ValueError, match="not a probability"):
        verify_tree(p * 2, ids, parents)
    with pytest.raises(ValueError, match="same token"):
        verify_tree(p, torch.tensor([[1, 1, 0]]), parents, p, rule="without_replacement")
    q = torch.tensor([[[1.0, 0.0, 0.0]] * 4])
    with pytest.raises(ValueError, match="q = 0"):
        verify_tree(p, ids, parents, q, rule="iid")
    with pytest.raises(ValueError, match="shape"):
        verify_tree(p, ids[:, :2], parents)
    nan = p.clone()
    nan[0, 2, 0] = float("nan")
    with pytest.raises(ValueError, match="not a probability"):
        verify_tree(nan, ids, parents)


# --- rule "mixed": per node, sampled from its parent slot's q or chosen (one-hot) ---------------------------------


def _random_trees(seed: int, B: int = 300, V: int = 8, distinct: bool = False):
    """A fixed 7-node shape, random p and q, children i.i.d. from q (or distinct per row, for chosen children),
    ragged rows, and explicit uniforms."""
    g = torch.Generator().manual_seed(seed)
    parents = torch.tensor([-1, -1, 0, 0, 1, 2, -1]).expand(B, 7).contiguous()
    p = torch.randn(B, 8, V, generator=g, dtype=torch.float64).mul(2).softmax(-1)
    q = torch.randn(B, 8, V, generator=g, dtype=torch.float64).mul(2).softmax(-1)
    if distinct:  # every node a different token, so siblings are distinct
        ids = torch.rand(B, V, generator=g).argsort(-1)[:, :7]
    else:
        ids = torch.multinomial(q.gather(1, (parents + 1).unsqueeze(-1).expand(B, 7, V)).reshape(-1, V), 1, generator=g)
        ids = ids.view(B, 7)
    nn = torch.randint(0, 8, (B,), generator=g)
    accept_u = torch.rand(B, 7, generator=g, dtype=torch.float64)
    final_u = torch.rand(B, generator=g, dtype=torch.float64)
    return p, ids, parents, q, nn, accept_u, final_u


def _same(a, b):
    return (
        torch.equal(a.token_ids, b.token_ids)
        and torch.equal(a.num_accepted, b.num_accepted)
        and torch.equal(a.path, b.path)
    )


def test_mixed_with_every_node_sampled_is_iid():
    p, ids, parents, q, nn, au, fu = _random_trees(0)
    every = torch.ones_like(ids, dtype=torch.bool)
    mixed = verify_tree_with_uniforms(p, ids, parents, q, nn, "mixed", au, fu, sampled=every)
    assert _same(mixed, verify_tree_with_uniforms(p, ids, parents, q, nn, "iid", au, fu))
    assert int(mixed.num_accepted.sum()) > 0 and int((mixed.num_accepted == 0).sum()) > 0
    via = verify_tree(p, ids, parents, q, nn, _gens(len(ids)), rule="mixed", sampled=every)
    assert _same(via, verify_tree(p, ids, parents, q, nn, _gens(len(ids)), rule="iid"))


def test_mixed_with_no_node_sampled_is_deterministic():
    p, ids, parents, q, nn, au, fu = _random_trees(1, distinct=True)
    none = torch.zeros_like(ids, dtype=torch.bool)
    mixed = verify_tree_with_uniforms(p, ids, parents, q, nn, "mixed", au, fu, sampled=none)
    assert _same(mixed, verify_tree_with_uniforms(p, ids, parents, None, nn, "deterministic", au, fu))
    assert int(mixed.num_accepted.sum()) > 0
    det = verify_tree(p, ids, parents, None, nn, _gens(len(ids)))
    assert _same(
        verify_tree(p, ids, parents, None, nn, _gens(len(ids)), rule="mixed", sampled=none), det
    )  # no q needed
    assert _same(verify_tree(p, ids, parents, q, nn, _gens(len(ids)), rule="mixed", sampled=none), det)


def test_mixed_draft_probs_may_stop_after_the_sampled_slots():
    """CombinedProposer's layout: a sampled chain (nodes 0-2) first, then chosen branches; q only for slots 0-2."""
    p, ids, _, q, nn, *_ = _random_trees(2, distinct=True)
    B = len(ids)
    parents = torch.tensor([-1, 0, 1, -1, -1, 3, 4]).expand(B, 7).contiguous()
    sampled = torch.tensor([True, True, True, False, False, False, False]).expand(B, 7)
    full = verify_tree(p, ids, parents, q, nn, _gens(B), rule="mixed", sampled=sampled)
    assert _same(verify_tree(p, ids, parents, q[:, :3], nn, _gens(B), rule="mixed", sampled=sampled), full)
    junk = q.clone()
    junk[:, 3:] = float("nan")  # slots with chosen children only: never read, not checked
    assert _same(verify_tree(p, ids, parents, junk, nn, _gens(B), rule="mixed", sampled=sampled), full)
    empty = verify_tree(p[:, :1], ids[:, :0], parents[:, :0], q[:, :1], rule="mixed", sampled=sampled[:, :0])
    assert empty.num_accepted.tolist() == [0] * B  # an empty tree: one token from p at the root
    with pytest.raises(ValueError, match="beyond draft_probs"):  # node 2's parent slot is 2
        verify_tree(p, ids, parents, q[:, :2], nn.clamp(min=3), rule="mixed", sampled=sampled)
    verify_tree(p, ids, parents, q[:, :2], torch.full((B,), 2), rule="mixed", sampled=sampled)  # node 2 is padding


def test_mixed_bad_input_is_a_clear_error():
    parents, ids = _tiny_tree()  # root -> 0, 1; node 0 -> 2
    p = torch.full((1, 4, 3), 1 / 3)
    some = torch.tensor([[False, True, False]])
    for bad in (None, some[:, :2], some.long(), some.float(), [[False, True, False]]):
        with pytest.raises(ValueError, match="needs sampled, a bool tensor of shape"):
            verify_tree(p, ids, parents, p, rule="mixed", sampled=bad)
    for rule in ("iid", "without_replacement", "deterministic"):
        with pytest.raises(ValueError, match="for rule 'mixed' only"):
            verify_tree(p, ids, parents, p, rule=rule, sampled=some)
    with pytest.raises(ValueError, match="needs draft_probs"):
        verify_tree(p, ids, parents, rule="mixed", sampled=some)
    for S in (0, 5):
        with pytest.raises(ValueError, match=r"S <= N \+ 1"):
            verify_tree(p, ids, parents, p[:, :1].expand(1, S, 3), rule="mixed", sampled=some)
    q = torch.tensor([[[0.5, 0.0, 0.5]] * 4])  # q = 0 at node 1's token
    with pytest.raises(ValueError, match="q = 0"):
        verify_tree(p, ids, parents, q, rule="mixed", sampled=some)
    verify_tree(p, ids, parents, q, rule="mixed", sampled=~some)  # a chosen child may have q = 0
    with pytest.raises(ValueError, match="not a probability"):  # slot 0 has a sampled child: its q is checked
        verify_tree(p, ids, parents, q * 2, rule="mixed", sampled=some)
    verify_tree(p, ids, parents, torch.cat([p[:, :1], p[:, 1:] * 2], 1), rule="mixed", sampled=some)  # not read
    twins = torch.tensor([[1, 1, 0]])  # nodes 0 and 1: siblings with the same token
    verify_tree(p, twins, parents, p, rule="mixed", sampled=some)  # a sampled child may repeat a chosen one
    with pytest.raises(ValueError, match="same token"):  # two chosen ones may not
        verify_tree(p, twins, parents, p, rule="mixed", sampled=torch.tensor([[False, False, True]]))


def _verispec_mixed(target, ids, parents, draft, nn, sampled, au, fu):
    return verify_tree_with_uniforms(target, ids, parents, draft, nn, "mixed", au, fu, sampled=sampled)


@pytest.mark.parametrize("chosen_first", [True, False], ids=["chosen-first", "sampled-first"])
def test_mixed_root_with_a_shared_token_emits_p_exactly(chosen_first):
    assert mixed_root_law(_verispec_mixed, chosen_first=chosen_first) == list(MIX_P)
    off_grid = mixed_root_law(_verispec_mixed, chosen_first=chosen_first, grid=(5, 7, 3))  # the harness can fail
    assert off_grid != list(MIX_P) and sum(off_grid) == 1
