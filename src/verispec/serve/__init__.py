"""OpenAI-compatible HTTP serving: `create_app(generator, model_name)` and the engine thread behind it."""

from .app import create_app

__all__ = ["create_app"]
