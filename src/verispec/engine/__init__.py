"""Speculative generation on real models: loading, KV cache with rollback, runner, generate loop."""

from .generator import Completion, SpeculativeGenerator, StreamEvent
from ..model.loading import LoadedModel, ModelLoadError, load_model
from .stats import SpecStats

__all__ = ["Completion", "LoadedModel", "ModelLoadError", "SpecStats", "SpeculativeGenerator", "StreamEvent",
           "load_model"]
