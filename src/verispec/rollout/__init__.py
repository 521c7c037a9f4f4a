"""Exact speculative rollouts for RL post-training (see `verispec.rollout.engine`), on several replicas as Ray
actors (`verispec.rollout.cluster`: Ray is optional and imported only when a cluster is made)."""

from ..drafting.history import HistoryProposer, RolloutHistory
from ..model.weights import WeightUpdateError
from .cluster import EngineSpec, ReplicaLostError, RolloutCluster
from .engine import Rollout, RolloutEngine, WeightUpdate, check_on_policy, sample_seed

__all__ = [
    "EngineSpec",
    "HistoryProposer",
    "ReplicaLostError",
    "Rollout",
    "RolloutCluster",
    "RolloutEngine",
    "RolloutHistory",
    "WeightUpdate",
    "WeightUpdateError",
    "check_on_policy",
    "sample_seed",
]
