"""The JSON files committed under docs/ (benchmark results, certificates) are strict JSON: no NaN / Infinity."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parent.parent / "docs"
FILES = sorted(DOCS.rglob("*.json"))


def _reject(name):
    raise ValueError(f"invalid JSON constant {name}")


def test_there_are_committed_json_files():
    assert len(FILES) >= 9


@pytest.mark.parametrize("path", FILES, ids=[str(p.relative_to(DOCS)) for p in FILES])
def test_committed_json_is_strict(path):
    json.loads(path.read_text(), parse_constant=_reject)
