"""`verispec bench acceptance` on the tiny saved pair (a smoke test of the command and its report; the
expectations it computes are tested where they are defined: block_stop_law in tests/sampling/test_block.py)."""

from __future__ import annotations

import json

from verispec.cli import main

from ..helpers.saved import read_strict_json, save_tiny_pair


def test_acceptance_report(tmp_path):
    save_tiny_pair(tmp_path)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "a b c a b", "category": "code"}) + "\n")
    argv = ["bench", "acceptance", "--target", str(tmp_path / "target"), "--draft", str(tmp_path / "draft")]
    argv += ["--prompts", str(prompts), "--num-prompts", "1", "--max-new-tokens", "12", "--gamma", "3", "--no-chat"]
    assert main([*argv, "--out", str(tmp_path / "out")]) == 0
    rec = read_strict_json(tmp_path / "out" / "acceptance.json")["records"][0]
    assert rec["steps"] > 0 and rec["e_token"] > 0 and rec["e_block"] > 0
    assert 0 < rec["coupling_bound"] <= rec["one_minus_tv"] <= 1
    assert main(["bench", "acceptance", "--prompts", str(prompts)]) == 2  # no --draft
