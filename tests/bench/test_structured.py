"""`verispec bench structured` (smoke, tiny character-level model): the report's structure, validity counted (an
invalid document counts as invalid), the JSON strict, and the shipped prompt set well formed."""

from __future__ import annotations

import json

import pytest

from verispec.bench import structured
from verispec.bench.structured import StructuredConfig, load_extract_prompts, run_structured, summarize, validate
from verispec.model.loading import LoadedModel
from verispec.strict_json import dumps

from ..helpers.json_tok import json_model, make_json_tokenizer

SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "array", "items": {"type": "string"}, "maxItems": 2}},
    "required": ["a", "b"],
    "additionalProperties": False,
}
PROMPTS = [
    {"category": "x", "prompt": '{"a": 1, "b": ["ab"]}', "schema": SCHEMA},
    {
        "category": "y",
        "prompt": '{"en": true}',
        "schema": {"type": "object", "properties": {"en": {"type": "boolean"}}},
    },
]


@pytest.fixture(scope="module")
def result():
    tok = make_json_tokenizer()
    target = LoadedModel(json_model(0), tok, "json-target")
    draft = LoadedModel(json_model(1, layers=1), tok, "json-draft")
    cfg = StructuredConfig(
        max_new_tokens=24, runner="hf", methods=("plain", "spec", "spec-nojump", "jump-only", "draft")
    )
    return run_structured(target, draft, PROMPTS, cfg, log=lambda m: None)


def test_report_structure(result):
    methods = ["plain", "spec", "spec-nojump", "jump-only", "draft"]
    assert result["config"]["methods"] == methods
    assert len(result["records"]) == len(PROMPTS) * len(methods)
    rows = {(r["method"], r["category"]): r for r in result["summary"]}
    assert set(rows) == {(m, c) for m in methods for c in ("x", "y", "all")}
    for r in rows.values():
        assert r["stopped"] + r["length"] == r["outputs"]
        assert r["valid"] + r["invalid"] == r["stopped"]
        assert r["tokens"] > 0 and r["masks"] > 0 and 0 < r["mask_s"] <= r["grammar_s"]  # masks: inside the grammar
    assert rows[("plain", "all")]["speedup"] == pytest.approx(1.0)
    assert rows[("plain", "all")]["tau"] == pytest.approx(1.0)
    assert rows[("spec-nojump", "all")]["jump_proposed"] == 0
    assert 0 < rows[("jump-only", "all")]["jump_accepted"] <= rows[("jump-only", "all")]["jump_proposed"]
    # the engine is lossless and seeded requests are Gumbel-coupled (random=auto): every method emits plain's text
    assert all(r["same_as_plain"] for r in result["records"])
    for r in result["records"]:  # every finished document is valid under its schema: the grammar held
        assert r["valid"] is (True if r["finish_reason"] == "stop" else None)
    md = structured.to_markdown(result)
    assert "| 1 | all | spec |" in md and "valid / stopped" in md


def test_json_is_strict(result):
    text = dumps(result)
    json.loads(text, parse_constant=lambda c: pytest.fail(f"non-strict JSON constant {c}"))


def test_validity_counts_invalid_outputs(result):
    records = [dict(r) for r in result["records"] if r["method"] == "plain"]
    records[0].update(finish_reason="stop", text='{"a": "not an integer", "b": []}')
    records[0].update(structured._validity(records[0], SCHEMA, structured._validator()[1]))
    records[1].update(finish_reason="stop", text='{"en": tru')
    records[1].update(structured._validity(records[1], PROMPTS[1]["schema"], None))
    rows = {r["category"]: r for r in summarize(records) if r["method"] == "plain"}
    assert rows["x"]["invalid"] == 1 and rows["x"]["validity"] == 0.0
    assert rows["y"]["invalid"] == 1 and rows["all"]["invalid"] == 2
    assert validate('{"a": 3, "b": ["q"]}', SCHEMA, structured._validator()[1]) == (True, None)
    assert validate("[1,", SCHEMA)[0] is False


def test_the_shipped_prompt_set():
    prompts = load_extract_prompts()
    assert len(prompts) >= 16
    assert {p["category"] for p in prompts} == {"people", "products", "events", "code"}
    assert all(p["schema"]["type"] == "object" and p["schema"]["required"] for p in prompts)


def test_unknown_method():
    with pytest.raises(ValueError, match="unknown method"):
        StructuredConfig(methods=("plain", "nope"))
    with pytest.raises(ValueError, match="plain"):
        StructuredConfig(methods=("spec",))
