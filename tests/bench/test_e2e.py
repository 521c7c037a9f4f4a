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
    tree = "verispec:draft=model,tree=2-2,gamma=auto,verify=without_replacement"
    block = "verispec:draft=model,gamma=2,verify=block"
    methods = (
        f"verispec-plain,verispec:draft=model,gamma=2,{block},{tree},verispec:draft=model,tree=dynamic-2-2-4,"
        "verispec:draft=ngram,tree=2-1,gamma=auto,verispec:draft=model,gamma=2,random=gumbel"
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
    assert set(recs) == {
        "verispec-plain",
        "verispec:draft=model,gamma=2",
        block,
        tree,
        "verispec:draft=model,tree=dynamic-2-2-4",
        "verispec:draft=ngram,tree=2-1,gamma=auto",
        "verispec:draft=model,gamma=2,random=gumbel",
    }
    assert (
        result["config"]["spec"] == "max_gamma=4" and recs["verispec:draft=model,gamma=2,random=gumbel"]["tokens"] == 8
    )
    assert recs[tree]["tokens"] == 8 and recs[tree]["nodes"] > 0 and recs[tree]["drafted_per_step"] > 2
    assert len(result["cost_curve_s"]) == 7  # calibrated up to the widest verification (6 nodes + root)
    assert recs[block]["tokens"] == 8


@pytest.mark.parametrize(
    "bad, message",
    [
        ("verispec:draft=model,tree=4-x", "method 'verispec:draft=model,tree=4-x'"),
        ("verispec:draft=model,tree=dynamic-2-2-4,verify=iid", "deterministic"),
        ("nope", "unknown method 'nope'"),
        # the old aliases are gone: verispec:SPEC is the one spelling of a configuration
        ("verispec-draft@2", "unknown method 'verispec-draft@2'"),
        ("verispec-tree@2-2/iid", "unknown method"),
        ("verispec-ngram-tree@2-1", "unknown method"),
    ],
)
def test_bad_methods(bad, message):
    with pytest.raises(ValueError, match=message):
        e2e.method_config(bad, e2e.E2EConfig(methods=()))


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
    cfg = e2e.E2EConfig(methods=())
    assert str(e2e.method_config("verispec:draft=model,gamma=2,verify=block", cfg)).startswith("draft=model,gamma=2")
    for bad in ("verispec:draft=model,verify=iid", "verispec:gamma=x", "verispec:draft=custom"):
        with pytest.raises(ValueError, match="method 'verispec:"):
            e2e.method_config(bad, cfg)
