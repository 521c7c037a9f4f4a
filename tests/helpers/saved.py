"""Tiny saved models (a target and its noisy draft on disk) and strict JSON reading."""

from __future__ import annotations

import json
from pathlib import Path

from .tiny import make_model, make_tokenizer, noisy_copy


def save_tiny_pair(folder: Path) -> tuple[Path, Path]:
    """A tiny random target and its noisy copy as draft, saved with their tokenizer: (target dir, draft dir)."""
    tok = make_tokenizer()
    target = make_model(0)
    for name, model in (("target", target), ("draft", noisy_copy(target, 0.3))):
        model.save_pretrained(folder / name)
        tok.save_pretrained(folder / name)
    return folder / "target", folder / "draft"


def _reject(name):
    raise ValueError(f"non-standard JSON constant {name}")


def read_strict_json(path: Path):
    """Parse a report, refusing NaN / Infinity (strict JSON)."""
    return json.loads(Path(path).read_text(), parse_constant=_reject)
