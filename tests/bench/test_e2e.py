"""`verispec bench e2e` with chain and tree methods side by side, on tiny random models (a smoke test: speed is
measured by the benchmark itself, never asserted in tests)."""

from __future__ import annotations

import json

import pytest

from verispec.bench import e2e
from verispec.cli import main

from ..engine.tiny import make_model, make_tokenizer, noisy_copy


def test_tree_methods_side_by_side(tmp_path, capsys):
    tok = make_tokenizer()
    target = make_model(0)
    for name, model in (("target", target), ("draft", noisy_copy(target, 0.3))):
        model.save_pretrained(tmp_path / name)
        tok.save_pretrained(tmp_path / name)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "a b c a b", "category": "code"}) + "\n")
    methods = (
        "verispec-plain,verispec-draft@2,verispec-tree@2-2/without_replacement,verispec-tree@dynamic-2-2-4,"
        "verispec-ngram-tree@2-1"
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
                "--no-chat",
                "--out",
                str(tmp_path / "out"),
            ]
        )
        == 0
    )
    result = json.loads((tmp_path / "out" / "e2e.json").read_text(), parse_constant=_reject)  # strict JSON
    recs = {r["method"]: r for r in result["records"]}
    assert set(recs) == set(methods.split(","))
    tree = recs["verispec-tree@2-2/without_replacement"]
    assert tree["tokens"] == 8 and tree["nodes"] > 0 and tree["drafted_per_step"] > 2
    assert len(result["cost_curve_s"]) == 7  # calibrated up to the widest verification (6 nodes + root)


def _reject(name):
    raise AssertionError(f"e2e.json holds {name}: not valid JSON")


@pytest.mark.parametrize(
    "bad", ["verispec-tree", "verispec-tree@4-x", "verispec-draft@x", "nope", "verispec-tree@dynamic-2-2-4/iid"]
)
def test_bad_methods(bad):
    with pytest.raises(ValueError):
        e2e.check_method(bad)
