"""Closed-form theory of chain speculative decoding (Leviathan et al. 2023, section 3).

alpha = sum_x min(p(x), q(x)) = 1 - TV(p, q) is the probability that one draft token is accepted.
With gamma drafts per step and i.i.d. acceptance alpha, a target pass emits on average
    tau(alpha, gamma) = (1 - alpha^(gamma + 1)) / (1 - alpha)      (gamma + 1 when alpha = 1)
tokens (accepted drafts plus the recovered / bonus token).

Cost models for the speedup over plain decoding (one target pass per token):
  * constant cost ratio (Leviathan): a draft step costs c target steps, verifying gamma + 1 tokens costs
    one target step:   speedup = tau / (gamma * c + 1);
  * measured cost curve: a draft step costs `draft_cost`, a target forward over n tokens costs T(n)
    (on CPUs T grows with n):   speedup = tau * T(1) / (gamma * draft_cost + T(gamma + 1)).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

__all__ = [
    "acceptance_rate",
    "expected_tokens_per_pass",
    "optimal_gamma_constant_cost",
    "optimal_gamma_cost_curve",
    "speedup_constant_cost",
    "speedup_cost_curve",
]


def acceptance_rate(p: Tensor, q: Tensor) -> Tensor:  # p, q [..., V] -> alpha [...]
    """alpha(p, q) = sum_x min(p(x), q(x)) = 1 - TV(p, q): the probability that one draft token is accepted.

    Args:
        p: [..., V] target distributions.
        q: [..., V] draft distributions, the shape of p.

    Returns:
        [...] the acceptance probability of each position (ValueError where p and q differ in shape).
    """
    if p.shape != q.shape:
        raise ValueError(f"p and q must have the same shape, got {tuple(p.shape)} and {tuple(q.shape)}")
    return torch.minimum(p, q).sum(dim=-1)


def _check_alpha_gamma(alpha: float, gamma: int) -> None:
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    if isinstance(gamma, bool) or int(gamma) != gamma or gamma < 0:
        raise ValueError(f"gamma must be an integer >= 0, got {gamma}")


def expected_tokens_per_pass(alpha: float, gamma: int) -> float:
    """tau = (1 - alpha^(gamma+1)) / (1 - alpha): expected tokens emitted per target pass.

    Args:
        alpha: The per-draft acceptance probability, in [0, 1] (i.i.d. over positions).
        gamma: Drafts per step, an integer >= 0.

    Returns:
        The expected accepted drafts plus the recovered or bonus token (gamma + 1 when alpha = 1); ValueError for
        alpha outside [0, 1] or gamma not an integer >= 0.
    """
    _check_alpha_gamma(alpha, gamma)
    if alpha == 1.0:
        return float(gamma + 1)
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def speedup_constant_cost(alpha: float, gamma: int, c: float) -> float:
    """Expected wall-clock speedup over plain decoding, Leviathan's constant cost model: tau / (gamma * c + 1).

    Args:
        alpha: The per-draft acceptance probability, in [0, 1].
        gamma: Drafts per step, an integer >= 0.
        c: The cost of one draft step in target steps (verifying gamma + 1 tokens costs one target step).

    Returns:
        The expected speedup (1 = plain decoding's speed); ValueError for c < 0, a bad alpha or gamma.
    """
    if c < 0:
        raise ValueError(f"cost ratio c must be >= 0, got {c}")
    return expected_tokens_per_pass(alpha, gamma) / (gamma * c + 1.0)


def _curve(verify_cost: Sequence[float] | Callable[[int], float]) -> Callable[[int], float]:
    if callable(verify_cost):
        return verify_cost
    costs = list(verify_cost)

    def at(n: int) -> float:  # costs[0] is T(1)
        if not 1 <= n <= len(costs):
            raise ValueError(f"the verify-cost curve covers 1..{len(costs)} tokens, asked for {n}")
        return float(costs[n - 1])

    return at


def speedup_cost_curve(
    alpha: float, gamma: int, draft_cost: float, verify_cost: Sequence[float] | Callable[[int], float]
) -> float:
    """Expected speedup with a measured target cost curve: tau * T(1) / (gamma * draft_cost + T(gamma + 1)).

    On CPUs a forward over n tokens costs more as n grows; this model prices that.

    Args:
        alpha: The per-draft acceptance probability, in [0, 1].
        gamma: Drafts per step, an integer >= 0.
        draft_cost: One draft step, in the unit of the curve.
        verify_cost: The target's cost curve T(n) for n tokens per forward (T(1) = a decode step): a sequence
            [T(1), T(2), ...] or a callable n -> T(n).

    Returns:
        The expected speedup over plain decoding; ValueError for draft_cost < 0, a curve too short for gamma + 1
        tokens, or a bad alpha or gamma.
    """
    if draft_cost < 0:
        raise ValueError(f"draft_cost must be >= 0, got {draft_cost}")
    t = _curve(verify_cost)
    return expected_tokens_per_pass(alpha, gamma) * t(1) / (gamma * draft_cost + t(gamma + 1))


def optimal_gamma_constant_cost(alpha: float, c: float, max_gamma: int = 32) -> tuple[int, float]:
    """The draft length that maximises `speedup_constant_cost`.

    Args:
        alpha: The per-draft acceptance probability, in [0, 1].
        c: The cost of one draft step in target steps.
        max_gamma: The largest gamma considered (from 0).

    Returns:
        (gamma, speedup) at the best gamma.
    """
    return max(((g, speedup_constant_cost(alpha, g, c)) for g in range(max_gamma + 1)), key=lambda gs: gs[1])


def optimal_gamma_cost_curve(
    alpha: float, draft_cost: float, verify_cost: Sequence[float] | Callable[[int], float], max_gamma: int | None = None
) -> tuple[int, float]:
    """The draft length that maximises `speedup_cost_curve`.

    Args:
        alpha: The per-draft acceptance probability, in [0, 1].
        draft_cost: One draft step, in the unit of the curve.
        verify_cost: The target's cost curve: a sequence [T(1), T(2), ...] or a callable n -> T(n).
        max_gamma: The largest gamma considered (from 0). Default for a sequence: its length - 1.

    Returns:
        (gamma, speedup) at the best gamma (ValueError where max_gamma is missing with a callable curve).
    """
    if max_gamma is None:
        if callable(verify_cost):
            raise ValueError("max_gamma is required when verify_cost is a callable")
        max_gamma = len(verify_cost) - 1
    return max(
        ((g, speedup_cost_curve(alpha, g, draft_cost, verify_cost)) for g in range(max_gamma + 1)), key=lambda gs: gs[1]
    )
