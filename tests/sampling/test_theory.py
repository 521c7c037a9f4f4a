from __future__ import annotations

import pytest
import torch

from verispec.sampling import (
    acceptance_rate,
    expected_tokens_per_pass,
    optimal_gamma_constant_cost,
    optimal_gamma_cost_curve,
    speedup_constant_cost,
    speedup_cost_curve,
)


def test_alpha_seed_example():
    assert float(acceptance_rate(torch.tensor([0.6, 0.3, 0.1]), torch.tensor([0.4, 0.5, 0.1]))) == pytest.approx(0.8)


def test_tau_matches_geometric_sum():
    for a in (0.0, 0.3, 0.8, 0.99):
        for g in range(0, 9):
            assert expected_tokens_per_pass(a, g) == pytest.approx(sum(a**i for i in range(g + 1)))
    assert expected_tokens_per_pass(1.0, 4) == 5.0


def test_speedups():
    a, g, c = 0.8, 4, 0.1
    assert speedup_constant_cost(a, g, c) == pytest.approx(expected_tokens_per_pass(a, g) / 1.4)
    curve = [1.0, 1.2, 1.3, 1.5, 1.9, 2.4]  # T(1..6)
    assert speedup_cost_curve(a, g, 0.1, curve) == pytest.approx(expected_tokens_per_pass(a, g) / (0.4 + 1.9))
    flat = [1.0] * 9
    for gam in range(8):  # a flat curve reproduces the constant-cost model
        assert speedup_cost_curve(a, gam, c, flat) == pytest.approx(speedup_constant_cost(a, gam, c))


def test_optimal_gamma_is_argmax():
    for a, c in ((0.6, 0.05), (0.9, 0.05), (0.9, 0.5), (0.2, 0.9)):
        _g, s = optimal_gamma_constant_cost(a, c, 20)
        assert s == max(speedup_constant_cost(a, x, c) for x in range(21))
    assert optimal_gamma_constant_cost(0.2, 0.9)[0] == 0  # a bad draft: do not speculate
    steep = [1.0 + 0.5 * n for n in range(17)]
    g_steep, _ = optimal_gamma_cost_curve(0.8, 0.1, steep)
    g_flat, _ = optimal_gamma_cost_curve(0.8, 0.1, [1.0] * 17)
    assert g_steep < g_flat  # a verify cost that grows with k favours shorter drafts


def test_theory_bad_input():
    with pytest.raises(ValueError, match="alpha"):
        expected_tokens_per_pass(1.5, 2)
    with pytest.raises(ValueError, match="gamma"):
        expected_tokens_per_pass(0.5, -1)
    with pytest.raises(ValueError, match=r"covers 1\.\.3"):
        speedup_cost_curve(0.5, 3, 0.1, [1, 2, 3])
    with pytest.raises(ValueError, match="same shape"):
        acceptance_rate(torch.ones(3), torch.ones(4))
