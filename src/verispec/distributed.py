"""Deprecated: use `verispec.rollout.cluster` (`RolloutCluster`, `EngineSpec`, `ReplicaLostError`; also exported
by `verispec.rollout`) and `verispec.model.payload` (`tensors_payload`, `from_payload`). This module only
re-exports them; importing it warns (DeprecationWarning)."""

from __future__ import annotations

import warnings

from .model.payload import from_payload, tensors_payload
from .rollout.cluster import EngineSpec, ReplicaLostError, RolloutCluster

__all__ = ["EngineSpec", "ReplicaLostError", "RolloutCluster", "from_payload", "tensors_payload"]

warnings.warn(
    "verispec.distributed is deprecated: import RolloutCluster, EngineSpec and ReplicaLostError from "
    "verispec.rollout (or verispec.rollout.cluster), tensors_payload and from_payload from verispec.model.payload",
    DeprecationWarning,
    stacklevel=2,
)
