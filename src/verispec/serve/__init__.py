"""OpenAI-compatible HTTP serving: `create_app(generator, model_name)`, and `served_model_id(name)` (the model id such a
server reports and accepts). Imported lazily: the CLI reads `serve.limits` without loading the server."""

from importlib import import_module

__all__ = ["create_app", "served_model_id"]


def __getattr__(name: str):
    if name in __all__:
        return getattr(import_module(".app", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
