"""The Python snippets of the docs run: every ```python block of README.md and docs/**/*.md is executed, alone, in a
fresh namespace (a snippet defines every name it uses), in a temporary working directory.

The pages stay literal for their readers: they name real models (`load_model(None)`, "path/to/policy", the Qwen
files) and a server at http://127.0.0.1:8000. The test runs each snippet with those names replaced by the tests'
tiny random models saved to disk, and the server URL by a live server over the tiny model (`NAMES` lists every
replacement; a name no page uses any more fails `test_every_replacement_is_used`). A line before a block may say more:

    <!-- snippet: server -->               it calls `verispec serve`: the test starts one (tiny model, weight updates on)
    <!-- snippet: slow (why) -->           the slow tier only (Ray, TRL, or the default model where the tiny one cannot)
    <!-- snippet: skip (why) -->           not run (the reason is required; such marks should stay few)

Keys combine (`<!-- snippet: server, slow (TRL's trainer) -->`). Whatever the tier, `test_snippets_compile_and_
define_their_names` checks every block in the default tier: valid Python and no undefined name (ruff's F821), so a
snippet that uses a name it never defines fails at once. In the slow tier the snippets whose only model is the
default one run once more, unmodified (`test_snippet_runs_literally`); those marked slow run only so.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
BLOCK = re.compile(r"(?:^<!-- snippet: (?P<mark>[^\n]*?) -->\n)?^```python\n(?P<code>.*?)^```[ \t]*$", re.S | re.M)
MARK = re.compile(r"(?P<keys>[a-z]+(?:, [a-z]+)*)(?: \((?P<why>[^)]+)\))?")
KEYS = {"server", "slow", "skip"}
SERVER = "http://127.0.0.1:8000"

# what the pages name -> what the test runs instead ({target}, {draft}: the tiny models' folders; {url}: the server's)
NAMES = {
    "load_model(None)": "load_model({target!r})",
    '"path/to/policy"': "{target!r}",
    '"Qwen/Qwen2.5-1.5B-Instruct"': "{target!r}",
    '"~/models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"': "{target!r}",
    '"~/models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"': "{draft!r}",
    f'"{SERVER}/v1"': "{url!r}",
    f'"{SERVER}"': "{base!r}",
    '"SmolLM2-135M-Instruct"': '"tiny"',  # the served model id (tests.helpers.server.MODEL)
    '"MODEL"': '"tiny"',
}
DEFAULT_ONLY = {"load_model(None)"}  # snippets naming no other model run literally in the slow tier


@dataclass(frozen=True)
class Snippet:
    page: str
    line: int
    code: str
    keys: frozenset[str]
    why: str

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def find_snippets(pages=PAGES) -> list[Snippet]:
    """Every ```python block of the pages, with its marks."""
    found = []
    for path in pages:
        text = path.read_text()
        for m in BLOCK.finditer(text):
            keys, why = frozenset(), ""
            if m.group("mark") is not None:
                mark = MARK.fullmatch(m.group("mark"))
                assert mark, f"{path}: bad snippet mark {m.group('mark')!r}"
                keys, why = frozenset(mark.group("keys").split(", ")), mark.group("why") or ""
            line = text.count("\n", 0, m.start("code")) + 1
            found.append(Snippet(str(path.relative_to(ROOT)), line, m.group("code"), keys, why))
    return found


SNIPPETS = find_snippets()


def substitute(code: str, **where: str) -> str:
    """The snippet with the names of NAMES replaced (`where`: target, draft, url, base)."""
    for name, instead in NAMES.items():
        code = code.replace(name, instead.format(**where))
    return code


def _tier(s: Snippet):
    marks = [pytest.mark.slow] if "slow" in s.keys else []
    if "import ray" in s.code:
        marks.append(pytest.mark.xdist_group("ray"))  # with the other Ray tests: one local cluster at a time
    if "skip" in s.keys:
        marks.append(pytest.mark.skip(reason=f"marked not runnable in {s.page}: {s.why}"))
    return pytest.param(s, id=s.id, marks=marks)


def test_the_pages_have_snippets_and_valid_marks():
    assert len(SNIPPETS) >= 10
    for s in SNIPPETS:
        assert s.keys <= KEYS, f"{s.id}: unknown snippet keys {sorted(s.keys - KEYS)}"
        assert "skip" not in s.keys or s.why, f"{s.id}: a skipped snippet must say why"
    assert sum("skip" in s.keys for s in SNIPPETS) <= 2, "snippets marked not runnable should stay few"


def test_every_replacement_is_used():
    used = {name for name in NAMES if any(name in s.code for s in SNIPPETS)}
    assert used == set(NAMES), f"NAMES no page uses: {sorted(set(NAMES) - used)}"


def test_snippets_compile_and_define_their_names(tmp_path):
    """Every snippet (slow and skipped ones too) is valid Python that defines every name it uses (ruff F821)."""
    files = []
    for i, s in enumerate(SNIPPETS):
        compile(s.code, s.id, "exec")
        files.append(tmp_path / f"snippet_{i}.py")
        files[-1].write_text(s.code)
    cmd = [sys.executable, "-m", "ruff", "check", "--no-cache", "--isolated", "--select", "F821,F822,F823"]
    done = subprocess.run([*cmd, "--output-format", "concise", *map(str, files)], capture_output=True, text=True)
    where = {str(f): s for f, s in zip(files, SNIPPETS)}  # a report's file:line -> the page's line
    report = "\n".join(
        re.sub(r"^(\S+?\.py):(\d+)", lambda m: f"{where[m[1]].page}:{where[m[1]].line + int(m[2]) - 1}", line)
        for line in done.stdout.splitlines()
        if ".py:" in line
    )
    assert done.returncode == 0, f"snippets use names they do not define:\n{report or done.stdout + done.stderr}"


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    """The tiny random target (4096 positions: the pages' token budgets fit) and its noisy copy, saved with the
    tiny tokenizer (a pad token set, as TRL needs): (target dir, draft dir)."""
    from .helpers.tiny import make_model, make_tokenizer, noisy_copy

    folder = tmp_path_factory.mktemp("snippet-models")
    tok = make_tokenizer()
    tok.pad_token = "<unk>"
    target = make_model(0, max_positions=4096)
    for name, model in (("target", target), ("draft", noisy_copy(target, 0.3))):
        model.save_pretrained(folder / name)
        tok.save_pretrained(folder / name)
    return str(folder / "target"), str(folder / "draft")


def _run(code: str, path: Path) -> None:
    """Execute a snippet as a script in `path` (its working directory), in a fresh namespace."""
    here = os.getcwd()
    os.chdir(path)
    try:
        exec(compile(code, "snippet", "exec"), {"__name__": "__main__"})
    finally:
        os.chdir(here)


LITERAL = [
    s
    for s in SNIPPETS
    if not s.keys & {"server", "skip"} and any(n in s.code for n in DEFAULT_ONLY)
    if not any(n in s.code for n in set(NAMES) - DEFAULT_ONLY)
]


# a slow snippet whose only model is the default one runs literally only (the tiny model is no stand-in for it there)
ON_TINY = [s for s in SNIPPETS if not ("slow" in s.keys and s in LITERAL)]


@pytest.mark.parametrize("snippet", [_tier(s) for s in ON_TINY])
def test_snippet_runs(snippet: Snippet, tiny_models, tmp_path):
    """The snippet runs on the tiny models (and, marked `server`, against a live server over the tiny target)."""
    target, draft = tiny_models
    where = dict(target=target, draft=draft, url=f"{SERVER}/v1", base=SERVER)
    if "server" not in snippet.keys:
        return _run(substitute(snippet.code, **where), tmp_path)
    from verispec.engine import SpeculativeGenerator
    from verispec.model import load_model

    from .helpers.server import LiveServer

    with LiveServer(SpeculativeGenerator(load_model(target)), enable_weight_updates=True) as server:
        _run(substitute(snippet.code, **(where | dict(url=server.url + "/v1", base=server.url))), tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("snippet", LITERAL, ids=[s.id for s in LITERAL])
def test_snippet_runs_literally(snippet: Snippet, tmp_path):
    """The snippets whose only model is the default one, run as written (the real default model)."""
    _run(snippet.code, tmp_path)
