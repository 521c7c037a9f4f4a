"""`verispec bench stops` (smoke): every case runs, the same tokens where no stop string matches."""

from __future__ import annotations

import json

from verispec.bench.stops import LoopStops, StopsConfig, engine_cases
from verispec.cli import main
from verispec.engine.stops import StopMatcher


def test_bench_stops_smoke(capsys, tmp_path):
    out = tmp_path / "stops.json"
    args = ["--num-stops", "50", "--num-prompts", "2", "--max-new-tokens", "8", "--repeats", "1"]
    assert main(["bench", "stops", *args, "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "50 + 1 matching (automaton)" in printed and "| loops, before |" in printed  # the matcher's reference
    result = json.loads(out.read_text())
    assert {"commit", "dirty", "date", "command"} <= set(result)  # verispec.bench.provenance
    stopped = [r["stopped"] for r in result["engine"]]  # the matching string may be in other outputs too
    assert stopped[:2] == [0, 0] and stopped[2] >= 1
    assert [r["matcher"] for r in result["matcher"]] == ["automaton", "loops, before"]


def test_the_loop_reference_is_the_matcher():
    stops = ["ab", "b", "abc", "ca"]
    m, ref = StopMatcher(stops), LoopStops(stops)
    for text in ["", "xab", "cabc", "xc", "xa", "abca"]:
        assert (m.first(text), m.held(text), m.found(text, 1)) == (ref.first(text), ref.held(text), ref.found(text, 1))


def test_engine_cases_without_the_reference():
    found, texts = engine_cases(StopsConfig(num_stops=20, num_prompts=1, max_new_tokens=4, repeats=1, reference=False))
    assert [r["case"] for r in found] == ["no stop strings", "20 (automaton)", "20 + 1 matching (automaton)"]
    assert len(texts) == 1
