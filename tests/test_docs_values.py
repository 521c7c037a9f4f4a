"""The numbers the docs quote from the code: every value marker `<!--v:SOURCE-->TEXT<!--/v-->` of a page (filled in
from the code by the docs build, scripts/docs_hooks.py) names a value that exists, and its TEXT, what a reader of the
raw file sees, is that value now (so the source does not drift either: change the code, and this test names the
pages to update)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _hooks():
    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "scripts" / "docs_hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


HOOKS = _hooks()
MARKERS = [(path, m) for path in PAGES for m in HOOKS.VALUE_MARKER.finditer(path.read_text())]


def test_the_guides_read_their_numbers_from_the_code():
    pages = {path.name for path, _ in MARKERS}
    assert {"generating.md", "serving.md", "certify.md", "rl-rollouts.md"} <= pages
    assert len(MARKERS) >= 20


@pytest.mark.parametrize(
    "path, marker",
    MARKERS,
    ids=[f"{p.relative_to(ROOT)}:{m.group(1)}" for p, m in MARKERS],
)
def test_a_value_marker_shows_the_live_value(path, marker):
    live = HOOKS.value(marker.group(1).strip(), marker.group(2) or "")
    written = marker.group(3).strip("`")
    assert written == live, f"{path.relative_to(ROOT)} writes {written!r} for {marker.group(1)}, the code says {live!r}"


def test_fill_values_replaces_markers_and_keeps_code_spans():
    text = "a <!--v:verispec.engine.adaptive.MAX_GAMMA-->1<!--/v--> b <!--v:default:serve:--port-->`1`<!--/v-->"
    from verispec.engine.adaptive import MAX_GAMMA

    assert HOOKS.fill_values(text) == f"a {MAX_GAMMA} b `8000`"
    with pytest.raises(HOOKS.PluginError):
        HOOKS.fill_values("<!--v:verispec.engine.adaptive.NO_SUCH_NAME-->1<!--/v-->")
