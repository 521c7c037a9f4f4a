"""The JSON files committed under docs/ (benchmark results, certificates) are strict JSON: no NaN / Infinity; and
every benchmark result under docs/bench says where it came from: the commit and the date (`verispec.bench.provenance`
at run time, or looked up in git history for the results written before it, marked "provenance": "from git
history")."""

from __future__ import annotations

import datetime
import json
import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parent.parent / "docs"
FILES = sorted(DOCS.rglob("*.json"))
BENCH = sorted((DOCS / "bench").rglob("*.json"))


def _reject(name):
    raise ValueError(f"invalid JSON constant {name}")


def test_there_are_committed_json_files():
    assert len(FILES) >= 9 and len(BENCH) >= 9


@pytest.mark.parametrize("path", FILES, ids=[str(p.relative_to(DOCS)) for p in FILES])
def test_committed_json_is_strict(path):
    json.loads(path.read_text(), parse_constant=_reject)


@pytest.mark.parametrize("path", BENCH, ids=[str(p.relative_to(DOCS)) for p in BENCH])
def test_bench_results_carry_commit_and_date(path):
    result = json.loads(path.read_text(), parse_constant=_reject)
    assert isinstance(result, dict) and "commit" in result and "date" in result
    assert result["commit"] is None or re.fullmatch(r"[0-9a-f]{40}", result["commit"])
    assert datetime.datetime.fromisoformat(result["date"]).utcoffset() is not None  # a timezone: UTC
