"""Exact speculative rollouts for RL post-training (see `verispec.rollout.engine`)."""

from ..drafting.history import HistoryProposer, RolloutHistory
from ..model.weights import WeightUpdateError
from .engine import Rollout, RolloutEngine, WeightUpdate, check_on_policy, sample_seed

__all__ = [
    "HistoryProposer",
    "Rollout",
    "RolloutEngine",
    "RolloutHistory",
    "WeightUpdate",
    "WeightUpdateError",
    "check_on_policy",
    "sample_seed",
]
