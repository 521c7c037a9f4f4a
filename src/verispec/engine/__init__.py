"""Speculative generation: the generator facade, the engine core and its session (the one scheduler), the step, the
drafter factory, step observers, the request, the configuration, the gamma controller, stats. (`load_model` and
`LoadedModel` are re-exported from `verispec.model`.)
"""

from ..model.loading import LoadedModel, ModelLoadError, load_model
from .config import SpecConfig, SpecError
from .core import EngineCore
from .drafters import build_proposer, load_draft
from .generator import SpeculativeGenerator
from .observe import StepObserver
from .request import Job, Request
from .rows import Completion, StreamEvent
from .session import GenerationSession
from .stats import SpecStats
from .verify import Verification

__all__ = [
    "Completion",
    "EngineCore",
    "GenerationSession",
    "Job",
    "LoadedModel",
    "ModelLoadError",
    "Request",
    "SpecConfig",
    "SpecError",
    "SpecStats",
    "SpeculativeGenerator",
    "StepObserver",
    "StreamEvent",
    "Verification",
    "build_proposer",
    "load_draft",
    "load_model",
]
