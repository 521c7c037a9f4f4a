"""Speculative generation: the generator facade, the session that owns the step, the gamma controller, stats.

(Models — loading, KV cache, runners — live in `verispec.model`; `load_model` and `LoadedModel` are re-exported
here for convenience.)
"""

from ..model.loading import LoadedModel, ModelLoadError, load_model
from .generator import Completion, GenerationSession, SpeculativeGenerator, StreamEvent
from .stats import SpecStats

__all__ = [
    "Completion",
    "GenerationSession",
    "LoadedModel",
    "ModelLoadError",
    "SpecStats",
    "SpeculativeGenerator",
    "StreamEvent",
    "load_model",
]
