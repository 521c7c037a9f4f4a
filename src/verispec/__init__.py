"""verispec: lossless speculative decoding, with a statistical certificate of losslessness."""

__version__ = "0.1.0"
__all__ = ["SpecConfig"]


def __getattr__(name: str):
    """`verispec.SpecConfig` (imported on first use: `import verispec` itself loads no torch)."""
    if name == "SpecConfig":
        from .engine.config import SpecConfig

        return SpecConfig
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
