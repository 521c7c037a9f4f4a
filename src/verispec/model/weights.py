"""In-place weight updates (RL: the policy changes after every optimizer step): every (name, tensor) pair checked
before anything is written (a bad update changes nothing), then copied in place (`Tensor.copy_`, not re-binding
`.data`: the fast runner's fused matrices and norms are views of the model's parameters, so a dense runner sees the
new weights with no rebuild; quantized copies must be rebuilt by their owner).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from torch import Tensor

__all__ = ["WeightUpdateError", "is_named_pair", "load_safetensors_dir", "update_items", "update_weights"]

_MAX_LISTED = 8


class WeightUpdateError(ValueError):
    """A weight update was refused before anything was written (a ValueError); the message lists every problem
    found: unknown names, wrong shapes or dtypes, NaN / inf values."""


def update_items(named_tensors: Iterable, error: type[Exception] = WeightUpdateError) -> list:
    """An update's items, as a list; `error` when it is not iterable or is empty."""
    try:
        items = list(named_tensors)
    except TypeError:
        raise error("an update is an iterable of (name, tensor) pairs") from None
    if not items:
        raise error("the update is empty")
    return items


def is_named_pair(item) -> bool:
    """Whether an update's item is a (name, value) tuple with a string name (the value is checked apart)."""
    return isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)


def check_update(model: torch.nn.Module, named_tensors: Iterable[tuple[str, Tensor]]) -> list[tuple[Tensor, Tensor]]:
    """Validate an update against the model: (destination, source) pairs, or WeightUpdateError listing every
    unknown name, duplicate, non-tensor, shape or dtype mismatch and non-finite value."""
    targets = dict(model.state_dict(keep_vars=True))  # parameters and persistent buffers, tied weights under each name
    problems: list[str] = []
    pairs: list[tuple[Tensor, Tensor]] = []
    seen: set[str] = set()
    for item in update_items(named_tensors):
        if not is_named_pair(item):
            problems.append(f"not a (name, tensor) pair: {type(item).__name__}")
            continue
        name, src = item
        dst = targets.get(name)
        if name in seen:
            problems.append(f"{name}: given twice")
        elif dst is None:
            problems.append(f"{name}: no such parameter or buffer in the model")
        elif not isinstance(src, Tensor):
            problems.append(f"{name}: expected a torch.Tensor, got {type(src).__name__}")
        elif tuple(src.shape) != tuple(dst.shape):
            problems.append(f"{name}: shape {tuple(src.shape)}, the model's is {tuple(dst.shape)}")
        elif src.dtype != dst.dtype:
            problems.append(f"{name}: dtype {src.dtype}, the model's is {dst.dtype} (cast it before sending)")
        elif src.is_floating_point() and not bool(torch.isfinite(src).all()):
            problems.append(f"{name}: contains NaN or infinite values")
        else:
            pairs.append((dst, src))
        seen.add(name)
    if problems:
        listed = "; ".join(problems[:_MAX_LISTED])
        more = f" (and {len(problems) - _MAX_LISTED} more)" if len(problems) > _MAX_LISTED else ""
        raise WeightUpdateError(f"weight update refused, nothing was changed: {listed}{more}")
    return pairs


@torch.no_grad()
def update_weights(model: torch.nn.Module, named_tensors: Iterable[tuple[str, Tensor]]) -> int:
    """Validate, then copy every tensor into the model's parameter in place; returns how many were written."""
    if not isinstance(model, torch.nn.Module):
        raise WeightUpdateError(
            f"{model!r} runs on llama.cpp from its GGUF file, whose weights cannot be replaced in place: "
            "serve RL rollouts with a torch runner (--runner fast) or reload a new GGUF file"
        )
    pairs = check_update(model, named_tensors)
    for dst, src in pairs:
        dst.copy_(src.to(dst.device))
    return len(pairs)


def load_safetensors_dir(path: str | os.PathLike) -> Iterator[tuple[str, Tensor]]:
    """The (name, tensor) pairs of every *.safetensors file in a directory (or of one file)."""
    p = Path(path)
    if p.is_file():
        files = [p]
    elif p.is_dir():
        files = sorted(p.glob("*.safetensors"))
        if not files:
            raise WeightUpdateError(f"{p} has no *.safetensors files")
    else:
        raise WeightUpdateError(f"{p} does not exist")
    yield from load_safetensors_files(files)


def load_safetensors_files(files, what: str | None = None) -> Iterator[tuple[str, Tensor]]:
    """The (name, tensor) pairs of these safetensors files, read one file at a time; WeightUpdateError for a
    truncated or foreign file (`what` names it in the message; default: the file's path)."""
    from safetensors.torch import load_file  # a transformers dependency

    for f in files:
        try:
            tensors = load_file(str(f))
        except Exception as e:  # a truncated or foreign file: say which
            raise WeightUpdateError(f"{what or f} is not a readable safetensors file: {e}") from None
        yield from tensors.items()
