"""The exact law of the first emitted token on a mixed tree root (one chosen and one sampled child), for
verify_tree's rule "mixed" and the broken mixed verifiers (tests/sampling/test_tree.py,
tests/certify/test_tree_kernel.py)."""

from __future__ import annotations

from fractions import Fraction

import torch

# p, q over 3 tokens for which, on the mixed root below (both orders, and the broken mixed verifiers of
# tests/certify/test_tree_kernel.py), every acceptance threshold of node 0, of node 1 and every CDF value of the
# final draw is a multiple of 1/6, 1/60 and 1/4 respectively (worked out in exact arithmetic)
MIX_P = (Fraction(1, 3), Fraction(1, 2), Fraction(1, 6))
MIX_Q = (Fraction(3, 10), Fraction(1, 5), Fraction(1, 2))
MIX_GRID = (6, 60, 4)


def mixed_root_law(verify, p=MIX_P, q=MIX_Q, chosen_first: bool = True, grid=MIX_GRID) -> list[Fraction]:
    """Exact law of the first emitted token when the root has two leaf children, token 0 chosen and a token x
    sampled from q (so both are token 0 with probability q(0)), in either order: every x (weight q(x)) against
    the midpoints of a product grid of (node 0's, node 1's, final) uniforms — an exact integral when the emitted
    token is constant on every grid cell, i.e. when each uniform's breakpoints lie on its grid's cell edges.
    verify(target_probs, ids, parents, draft_probs, num_nodes, sampled, accept_u, final_u) -> output."""
    V = len(p)
    u = torch.cartesian_prod(*[(torch.arange(m, dtype=torch.float64) + 0.5) / m for m in grid])  # [R, 3]
    R = u.shape[0]
    target = torch.tensor([[float(v) for v in p]] + [[1 / V] * V] * 2, dtype=torch.float64).expand(R, 3, V)
    draft = torch.tensor([[float(v) for v in q]], dtype=torch.float64).expand(R, 1, V)  # q for slot 0 only
    sampled = torch.tensor([not chosen_first, chosen_first]).expand(R, 2)
    law = [Fraction(0)] * V
    for x in range(V):
        ids = torch.tensor([0, x] if chosen_first else [x, 0]).expand(R, 2)
        out = verify(target, ids, torch.full((R, 2), -1), draft, torch.full((R,), 2), sampled, u[:, :2], u[:, 2])
        counts = torch.bincount(out.token_ids[:, 0], minlength=V).tolist()
        law = [a + q[x] * Fraction(c, R) for a, c in zip(law, counts)]
    return law
