"""`verispec bench e2e` with chain and tree methods side by side, on tiny random models (a smoke test: speed is
measured by the benchmark itself, never asserted in tests)."""

from __future__ import annotations

import json

import pytest

from verispec.bench import e2e
from verispec.cli import main

from ..helpers.saved import read_strict_json, save_tiny_pair


def test_tree_methods_side_by_side(tmp_path, capsys):
    save_tiny_pair(tmp_path)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "a b c a b", "category": "code"}) + "\n")
    methods = (
        "verispec-plain,verispec-draft@2,verispec-draft@2/block,verispec-tree@2-2/without_replacement,"
        "verispec-tree@dynamic-2-2-4,verispec-ngram-tree@2-1,verispec:draft=model,gamma=2,random=gumbel"
    )
    assert (
        main(
            [
                "bench",
                "e2e",
                "--target",
                str(tmp_path / "target"),
                "--draft",
                str(tmp_path / "draft"),
                "--prompts",
                str(prompts),
                "--num-prompts",
                "1",
                "--batch",
                "1",
                "--max-new-tokens",
                "8",
                "--temperatures",
                "1",
                "--methods",
                methods,
                "--spec",
                "max_gamma=4",
                "--no-chat",
                "--out",
                str(tmp_path / "out"),
            ]
        )
        == 0
    )
    result = read_strict_json(tmp_path / "out" / "e2e.json")
    assert {"commit", "dirty", "date", "command", "torch", "threads"} <= set(result)  # verispec.bench.provenance
    recs = {r["method"]: r for r in result["records"]}
    assert set(recs) == {*methods.split(",")[:-3], "verispec:draft=model,gamma=2,random=gumbel"}
    assert (
        result["config"]["spec"] == "max_gamma=4" and recs["verispec:draft=model,gamma=2,random=gumbel"]["tokens"] == 8
    )
    tree = recs["verispec-tree@2-2/without_replacement"]
    assert tree["tokens"] == 8 and tree["nodes"] > 0 and tree["drafted_per_step"] > 2
    assert len(result["cost_curve_s"]) == 7  # calibrated up to the widest verification (6 nodes + root)
    assert recs["verispec-draft@2/block"]["tokens"] == 8


@pytest.mark.parametrize(
    "bad", ["verispec-tree", "verispec-tree@4-x", "verispec-draft@x", "nope", "verispec-tree@dynamic-2-2-4/iid"]
)
def test_bad_methods(bad):
    with pytest.raises(ValueError):
        e2e.check_method(bad)


def test_verispec_spec_methods():
    """verispec:SPEC is a method; in --methods its key=value items run up to the next method name."""
    from verispec.cli.bench_e2e import _methods

    listed = "verispec-plain,verispec:draft=model,gamma=2,verify=block,hf-plain,verispec:draft=ngram"
    assert _methods(listed) == (
        "verispec-plain",
        "verispec:draft=model,gamma=2,verify=block",
        "hf-plain",
        "verispec:draft=ngram",
    )
    e2e.check_method("verispec:draft=model,gamma=2,verify=block")
    for bad in ("verispec:draft=model,verify=iid", "verispec:gamma=x", "verispec:draft=custom"):
        with pytest.raises(ValueError, match="method 'verispec:"):
            e2e.check_method(bad)
