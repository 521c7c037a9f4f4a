"""verispec.strict_json: what every JSON writer uses, so no file holds NaN / Infinity (invalid JSON)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from verispec.strict_json import dumps, finite_or_none, write


def strict_loads(text: str):
    def reject(name):
        raise ValueError(f"invalid JSON constant {name}")

    return json.loads(text, parse_constant=reject)


@dataclass
class Row:
    x: float
    xs: list


def test_non_finite_floats_become_null_everywhere():
    obj = {
        "a": math.nan,
        "b": [1.0, math.inf, (-math.inf, 2)],
        "c": Row(math.nan, [np.float64("nan"), 3]),
        "d": np.array([1.0, np.nan]),
        "e": torch.tensor([np.inf, 0.5]),
        "f": "NaN",
        "g": None,
        "h": 7,
    }
    assert finite_or_none(obj) == {
        "a": None,
        "b": [1.0, None, [None, 2]],
        "c": {"x": None, "xs": [None, 3]},
        "d": [1.0, None],
        "e": [None, 0.5],
        "f": "NaN",
        "g": None,
        "h": 7,
    }
    text = dumps(obj)
    assert "NaN" not in text.replace('"NaN"', "") and "Infinity" not in text
    assert strict_loads(text)["c"] == {"x": None, "xs": [None, 3]}


def test_write_is_strict(tmp_path):
    p = write(tmp_path / "r.json", {"v": [math.nan, 1.5]})
    assert strict_loads(p.read_text()) == {"v": [None, 1.5]}


def test_plain_json_would_write_invalid_tokens():
    """What the helper prevents: the standard library writes NaN, and a strict parser rejects it."""
    with pytest.raises(ValueError, match="NaN"):
        strict_loads(json.dumps({"v": math.nan}))
