"""`verispec bench rollout` on tiny saved models: every method side by side over epochs with weight updates (a smoke
test of the workload and its report: speed is measured by the benchmark itself, never asserted in tests)."""

from __future__ import annotations

import json

import torch

from verispec.bench.rollout import perturbed
from verispec.cli import main

from ..helpers.saved import read_strict_json, save_tiny_pair
from ..helpers.tiny import make_model


def test_every_method_over_epochs_with_updates(tmp_path):
    save_tiny_pair(tmp_path)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        "\n".join(json.dumps({"prompt": p, "category": c}) for p, c in (("a b c a b", "code"), ("x0 d e d", "math")))
    )
    methods = "plain,draft,self,history,history+self,history+draft,history/draft"
    argv = ["bench", "rollout", "--target", str(tmp_path / "target"), "--draft", str(tmp_path / "draft")]
    argv += ["--prompts", str(prompts), "--group", "3", "--max-new-tokens", "6", "--epochs", "2", "--no-chat"]
    argv += ["--methods", methods, "--out", str(tmp_path / "out")]
    assert main(argv) == 0
    result = read_strict_json(tmp_path / "out" / "rollout.json")
    recs = result["records"]
    assert {(r["method"], r["epoch"], r["category"]) for r in recs} == {
        (m, e, c) for m in methods.split(",") for e in (0, 1) for c in ("code", "math")
    }
    assert all(r["tokens"] == 3 * 6 and r["weight_version"] == r["epoch"] for r in recs)
    assert all(r["ratio_to_plain"] == 1.0 for r in recs if r["method"] == "plain")
    combined = [r for r in recs if r["method"] == "history+self"]
    assert all(set(r["accepted_by_source"]) == {"chain", "branches"} for r in combined)
    ups = result["updates"]
    assert {u["method"] for u in ups} == set(methods.split(",")) and all(u["version"] == 1 for u in ups)
    assert all(u["requantize_seconds"] > 0 for u in ups if u["method"] in ("self", "history+self"))
    assert (tmp_path / "out" / "rollout.png").stat().st_size > 0


def test_perturbation_is_seeded_and_scaled():
    model = make_model(0)
    a, b = dict(perturbed(model, 1e-3, 1)), dict(perturbed(model, 1e-3, 1))
    assert a.keys() == {n for n, w in model.named_parameters() if w.dim() >= 2}
    for name, w in model.named_parameters():
        if name in a:
            assert torch.equal(a[name], b[name])
            rel = (a[name] - w).pow(2).mean().sqrt() / w.pow(2).mean().sqrt()
            assert 0.5e-3 < rel < 2e-3
