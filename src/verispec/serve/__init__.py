"""OpenAI-compatible HTTP serving: `create_app(generator, model_name)` and the engine thread behind it;
`served_model_id(name)` is the plain model id a server built from `name` reports and accepts."""

from .app import create_app, served_model_id

__all__ = ["create_app", "served_model_id"]
