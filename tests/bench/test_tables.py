"""The benchmarks' markdown: every table has as many cells in each row and in its separator as in its header
(a literal pipe inside a cell is escaped), and their JSON results are strict JSON."""

from __future__ import annotations

import json
import re

import pytest

from verispec.bench import kernel, runner
from verispec.bench.harness import markdown_table
from verispec.strict_json import dumps

from ..helpers.tiny import make_model


def table_cell_counts(md: str) -> list[list[int]]:
    """Cells per line of each markdown table in `md` (a table: consecutive lines starting with '|')."""
    tables, current = [], []
    for line in [*md.splitlines(), ""]:
        if line.startswith("|"):
            current.append(len(re.split(r"(?<!\\)\|", line.strip())) - 2)
        elif current:
            tables.append(current)
            current = []
    return tables


def assert_consistent(md: str, n_tables: int) -> None:
    tables = table_cell_counts(md)
    assert len(tables) == n_tables, md
    for counts in tables:
        assert len(counts) >= 3 and len(set(counts)) == 1, (counts, md)


def test_cell_counter_sees_a_short_separator():
    assert table_cell_counts("| a | b |\n|---|\n| 1 | 2 |") == [[2, 1, 2]]
    assert table_cell_counts(r"| a \| b | c |") == [[2]]


def test_markdown_table_checks_and_escapes():
    lines = markdown_table(["case", "test"], [["c", "pos0 | context"]])
    assert_consistent("\n".join(lines), 1)
    assert r"pos0 \| context" in lines[2]
    with pytest.raises(ValueError, match="2 cells for 3 header cells"):
        markdown_table(["a", "b", "c"], [["1", "2"]])


@pytest.mark.parametrize("paths", [("hf", "fast", "int8-self"), ("fast",), ("hf",)])
def test_bench_runner_tables_are_consistent(paths):
    model = make_model(0)
    res = runner.run(model, 32, max_k=5, context=8, repeats=1, paths=paths, bandwidth_bytes=1 << 20)
    md = runner.to_markdown(res)
    assert_consistent(md, 2)
    header = next(line for line in md.splitlines() if line.startswith("| k |"))  # after the provenance line
    assert header.count("ms") == len(paths) and ("hf / fast" in header) == ({"hf", "fast"} <= set(paths))
    json.loads(dumps(res), parse_constant=_no_constants)


def test_bench_kernel_table_is_consistent():
    result = kernel.run([(2, 3, 40)], repeats=1)
    no_reference = result | {"rows": [{**result["rows"][0], "reference_s": None}]}
    md = kernel.to_markdown(result) + "\n\n" + kernel.to_markdown(no_reference)
    assert_consistent(md, 2)
    assert "| - | - |" in md  # the reference's cells, where it was not timed
    json.loads(dumps(result), parse_constant=_no_constants)


def _no_constants(name):
    raise AssertionError(f"invalid JSON constant {name}")
