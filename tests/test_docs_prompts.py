"""The benchmark prompt sets ship with the package (`verispec.data`), so every `--prompts code math chat` in the docs
works from a fresh clone or a wheel: the names resolve, a file that exists wins over a name, an unknown name is an
error that lists the built-in ones, and no page points at files outside the repository."""

from __future__ import annotations

import argparse
import fnmatch
import json
import re
import sys
from pathlib import Path

import pytest

from verispec.cli.options import UsageError, read_bench_prompts, read_prompts
from verispec.data import PROMPT_SETS, UnknownPromptSet, prompt_file

ROOT = Path(__file__).resolve().parent.parent
ROWS = {"chat": 80, "code": 80, "math": 77}


@pytest.mark.parametrize("name", PROMPT_SETS)
def test_a_built_in_name_is_the_shipped_file(name):
    path = prompt_file(name)
    assert path == ROOT / "src" / "verispec" / "data" / "prompts" / f"{name}.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == ROWS[name] and all(r["category"] == name and r["prompt"] for r in rows)
    assert prompt_file(f"{name}.jsonl") == path  # the README's `code.jsonl` spelling, where no such file exists


def test_a_file_that_exists_wins_over_a_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("code").write_text('{"prompt": "mine"}\n')
    assert prompt_file("code") == Path("code")
    assert read_prompts(argparse.Namespace(prompt=None, prompts=["code"], num_prompts=5)) == ["mine"]


def test_an_unknown_name_lists_the_built_in_ones():
    with pytest.raises(UnknownPromptSet) as e:
        prompt_file("cod")
    assert isinstance(e.value, FileNotFoundError) and e.value.filename == "cod"
    assert "chat, code, math" in str(e.value) and "did you mean 'code'?" in str(e.value)
    with pytest.raises(UsageError, match=r"cannot read prompts from cod: .*\(chat, code, math\)"):
        read_prompts(argparse.Namespace(prompt=None, prompts=["cod"], num_prompts=1))
    with pytest.raises(UsageError, match=r"cannot read prompts from nope/x\.jsonl: .*\(chat, code, math\)"):
        read_bench_prompts(["code", "nope/x.jsonl"])


def test_the_cli_readers_take_names():
    texts = read_prompts(argparse.Namespace(prompt=["hi"], prompts=["math", "code"], num_prompts=2))
    assert len(texts) == 5 and texts[0] == "hi"
    by_category = read_bench_prompts(["code", "chat", "math"])
    assert {k: len(v) for k, v in by_category.items()} == ROWS


def test_a_wheel_carries_the_prompt_sets():
    """pyproject.toml's package-data matches every file of verispec/data/prompts (the sets and their NOTICE)."""
    tomllib = pytest.importorskip("tomllib") if sys.version_info >= (3, 11) else pytest.importorskip("tomli")
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["verispec"]
    package = ROOT / "src" / "verispec"
    files = [p.relative_to(package).as_posix() for p in (package / "data" / "prompts").iterdir()]
    assert {"chat.jsonl", "code.jsonl", "math.jsonl", "NOTICE.md"} <= {Path(f).name for f in files}
    assert all(any(fnmatch.fnmatch(f, pat) for pat in patterns) for f in files), (files, patterns)


def test_no_page_points_at_prompt_files_outside_the_repository():
    """The docs' commands use the built-in names; only recorded results (the command a past run was made with)
    may still name the workspace's old ../shared/data/prompts files."""
    sources = [ROOT / "README.md", *(ROOT / "docs").rglob("*.md"), *(ROOT / "docs").rglob("*.sh")]
    sources += [*(ROOT / "docs").rglob("*.py")]
    recorded = re.compile(r"^commit [0-9a-f]+.*: `verispec ")  # a result's provenance line
    found = [
        f"{p.relative_to(ROOT)}:{i}"
        for p in sources
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if "shared/data/prompts" in line and not recorded.match(line)
    ]
    assert not found, f"pages pointing at ../shared/data/prompts: {found}"
