"""Speculative generation: the generator facade, the engine core and its session (the one scheduler that owns the
step), the typed request, the speculation configuration (`SpecConfig`), the gamma controller, stats.

(Models — loading, KV cache, runners — live in `verispec.model`; `load_model` and `LoadedModel` are re-exported
here for convenience.) The names that need the drafters are imported on first use (drafters import
`verispec.drafting.batch`, so this package must not import them while it initialises).
"""

from importlib import import_module

from ..model.loading import LoadedModel, ModelLoadError, load_model
from .stats import SpecStats

_LAZY = {
    "Completion": ".rows",
    "StreamEvent": ".rows",
    "GenerationSession": ".session",
    "EngineCore": ".core",
    "Request": ".request",
    "Job": ".request",
    "SpeculativeGenerator": ".generator",
    "SpecConfig": ".config",
}

__all__ = ["LoadedModel", "ModelLoadError", "SpecStats", "load_model", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
