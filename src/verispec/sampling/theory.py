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
    """alpha(p, q) = sum_x min(p(x), q(x)), the per-position acceptance probability."""
    if p.shape != q.shape:
        raise ValueError(f"p and q must have the same shape, got {tuple(p.shape)} and {tuple(q.shape)}")
    return torch.minimum(p, q).sum(dim=-1)


def _check_alpha_gamma(alpha: float, gamma: int) -> None:
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    if isinstance(gamma, bool) or int(gamma) != gamma or gamma < 0:
        raise ValueError(f"gamma must be an integer >= 0, got {gamma}")


def expected_tokens_per_pass(alpha: float, gamma: int) -> float:
    """tau = (1 - alpha^(gamma+1)) / (1 - alpha): expected tokens emitted per target pass."""
    _check_alpha_gamma(alpha, gamma)
    if alpha == 1.0:
        return float(gamma + 1)
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def speedup_constant_cost(alpha: float, gamma: int, c: float) -> float:
    """Expected wall-clock speedup when a draft step costs c target steps and verify costs one."""
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
    """Expected speedup with a measured target cost curve T(n) (n tokens per forward; T(1) = decode).

    `verify_cost` is a sequence [T(1), T(2), ...] or a callable n -> T(n); `draft_cost` is one draft step,
    in the same unit.
    """
    if draft_cost < 0:
        raise ValueError(f"draft_cost must be >= 0, got {draft_cost}")
    t = _curve(verify_cost)
    return expected_tokens_per_pass(alpha, gamma) * t(1) / (gamma * draft_cost + t(gamma + 1))


def optimal_gamma_constant_cost(alpha: float, c: float, max_gamma: int = 32) -> tuple[int, float]:
    """(gamma, speedup) maximising `speedup_constant_cost` over gamma in 0..max_gamma."""
    return max(((g, speedup_constant_cost(alpha, g, c)) for g in range(max_gamma + 1)), key=lambda gs: gs[1])


def optimal_gamma_cost_curve(
    alpha: float, draft_cost: float, verify_cost: Sequence[float] | Callable[[int], float], max_gamma: int | None = None
) -> tuple[int, float]:
    """(gamma, speedup) maximising `speedup_cost_curve`; a sequence curve bounds gamma by its length - 1."""
    if max_gamma is None:
        if callable(verify_cost):
            raise ValueError("max_gamma is required when verify_cost is a callable")
        max_gamma = len(verify_cost) - 1
    return max(
        ((g, speedup_cost_curve(alpha, g, draft_cost, verify_cost)) for g in range(max_gamma + 1)), key=lambda gs: gs[1]
    )
