"""Models: loading, the row-wise KV cache, runners (transformers' forward and the fast one), quantized linears.

This layer knows nothing of drafting or of the generate loop: tokens in, logits out.
"""

from .cache import RowKVCache
from .fast import FastRunner, make_runner
from .loading import LoadedModel, ModelLoadError, load_model, shared_vocab_size
from .protocol import Runner
from .runner import HFRunner

__all__ = [
    "FastRunner",
    "HFRunner",
    "LoadedModel",
    "ModelLoadError",
    "RowKVCache",
    "Runner",
    "load_model",
    "make_runner",
    "shared_vocab_size",
]
