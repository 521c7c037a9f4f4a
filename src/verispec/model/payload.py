"""Weight updates as object-store payloads: what `RolloutCluster.update_weights` puts into Ray once for all replicas.
Numpy arrays, because Ray stores them out of band and a replica on the same node reads them zero-copy.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable

import numpy as np
import torch

from .weights import is_named_pair, update_items

__all__ = ["from_payload", "tensors_payload"]

_INTS = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}  # same-width carriers for dtypes numpy lacks


def tensors_payload(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> tuple[dict, tuple[str, ...]]:
    """(name, tensor) pairs -> ({"arrays": {name: contiguous CPU numpy array}, "dtypes": {name: dtype name}}, names);
    arrays share memory with CPU tensors (`ray.put` makes the one copy). A dtype numpy lacks (bfloat16, float8)
    travels as the integer type of its width, listed in "dtypes". ValueError for a bad, duplicate or empty update."""
    arrays: dict[str, np.ndarray] = {}
    dtypes: dict[str, str] = {}
    for item in update_items(named_tensors, ValueError):
        if not is_named_pair(item):
            raise ValueError(f"an update is an iterable of (name, tensor) pairs, got a {type(item).__name__}")
        name, t = item
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if name in arrays:
            raise ValueError(f"{name}: given twice")
        t = t.detach().to("cpu").resolve_conj().resolve_neg().contiguous()
        try:
            arrays[name] = t.numpy()
        except TypeError:  # no numpy dtype: carry the bits
            carrier = _INTS.get(t.element_size())
            if carrier is None or t.is_complex():
                raise ValueError(f"{name}: dtype {t.dtype} cannot be sent (no numpy equivalent)") from None
            arrays[name] = t.view(getattr(torch, np.dtype(carrier).name)).numpy()
            dtypes[name] = str(t.dtype).removeprefix("torch.")
    return {"arrays": arrays, "dtypes": dtypes}, tuple(arrays)


def from_payload(payload: dict) -> list[tuple[str, torch.Tensor]]:
    """`tensors_payload`'s dict -> (name, tensor) pairs; the tensors view the arrays (read-only object-store
    memory on a replica: they are only read, by the in-place copy of `update_weights`)."""
    out = []
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        for name, arr in payload["arrays"].items():
            t = torch.from_numpy(arr)
            dtype = payload["dtypes"].get(name)
            if dtype is not None:
                t = t.view(getattr(torch, dtype))
            out.append((name, t))
    return out
