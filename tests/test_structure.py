"""The package's shape, checked from its source: every import runs down the layers (none up, so no cycle between
packages), and no function is longer than a reader can hold (60 lines, its docstring included).

Layers, lowest first; a package may import its own layer and the ones below. Function-level and TYPE_CHECKING
imports count like the others."""

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "verispec"
LAYERS = [
    {"strict_json", "explain", "data"},
    {"sampling"},
    {"structured"},
    {"model"},
    {"drafting"},
    {"crossvocab"},
    {"heads"},
    {"engine"},
    {"training", "certify", "rollout"},
    {"__init__", "serve", "bench"},
    {"cli"},
]
LEVEL = {name: i for i, names in enumerate(LAYERS) for name in names}
MAX_FUNCTION_LINES = 60


def _unit(parts: tuple[str, ...]) -> str:
    """The package (or top-level module) a module of verispec belongs to: `engine`, `explain`, `__init__`."""
    return parts[0].removesuffix(".py") if parts else "__init__"


def _imports(path: Path):
    """(line, the verispec package imported) for every import in the file, relative ones resolved."""
    rel = path.relative_to(SRC).with_suffix("").parts
    package = rel[:-1]  # a module's package; an __init__'s is its own folder, also rel[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name.split(".")[1:] for a in node.names if a.name.startswith("verispec")]
        elif isinstance(node, ast.ImportFrom) and node.level:
            base = list(package[: len(package) - (node.level - 1)])
            names = [base + (node.module.split(".") if node.module else [a.name for a in node.names][:1])]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("verispec"):
            names = [node.module.split(".")[1:] or [a.name for a in node.names][:1]]
        else:
            continue
        for parts in names:
            yield node.lineno, _unit(tuple(parts))


def _sources():
    return sorted(SRC.rglob("*.py"))


def test_every_package_has_a_layer():
    units = {_unit(p.relative_to(SRC).parts) for p in _sources()}
    assert units <= set(LEVEL), f"packages without a layer: {sorted(units - set(LEVEL))}"


def test_no_import_runs_up_a_layer():
    upward = []
    for path in _sources():
        me = _unit(path.relative_to(SRC).parts)
        for line, unit in _imports(path):
            if unit in LEVEL and me in LEVEL and LEVEL[unit] > LEVEL[me]:
                upward.append(f"{path.relative_to(SRC)}:{line} ({me}) imports {unit}")
    assert not upward, "imports from a higher layer:\n" + "\n".join(upward)


def test_no_function_is_longer_than_60_lines():
    long = []
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(SRC)}:{node.lineno} {node.name}: {n} lines")
    assert not long, "\n".join(long)


@pytest.mark.parametrize(
    "source, unit",
    [("from ..engine import x", "engine"), ("from . import y", "drafting"), ("import verispec.serve.app", "serve")],
)
def test_the_scan_sees_relative_absolute_and_function_level_imports(tmp_path, monkeypatch, source, unit):
    pkg = tmp_path / "drafting"
    pkg.mkdir()
    (pkg / "m.py").write_text(f"def f():\n    {source}\n")
    monkeypatch.setattr(f"{__name__}.SRC", tmp_path)
    assert [u for _, u in _imports(pkg / "m.py")] == [unit]
