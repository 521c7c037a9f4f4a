"""Strict JSON for every file verispec writes: no `NaN` / `Infinity` tokens (invalid JSON that strict parsers
reject). Non-finite floats are written as `null`; `allow_nan=False` makes any one that slips through an error
instead of a bad file."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

__all__ = ["dump", "dumps", "finite_or_none", "write"]


def finite_or_none(obj):
    """A copy of `obj` (dicts, lists, tuples, dataclasses, numpy scalars and arrays, nested) in which every
    non-finite float (NaN, +-inf) is None."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite_or_none(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_or_none(v) for v in obj]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return finite_or_none(dataclasses.asdict(obj))
    if hasattr(obj, "tolist") and callable(obj.tolist):  # numpy / torch scalars and arrays
        return finite_or_none(obj.tolist())
    return obj


def dumps(obj, **kwargs) -> str:
    return json.dumps(finite_or_none(obj), allow_nan=False, **kwargs)


def dump(obj, fh, **kwargs) -> None:
    json.dump(finite_or_none(obj), fh, allow_nan=False, **kwargs)


def write(path: str | Path, obj, indent: int | None = 1) -> Path:
    path = Path(path)
    path.write_text(dumps(obj, indent=indent) + "\n")
    return path
