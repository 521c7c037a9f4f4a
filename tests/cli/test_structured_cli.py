"""`verispec generate`'s structured-output flags (--choice, --regex, --json-schema FILE, --json-object, --grammar FILE)
end to end, in-process, on a tiny target and draft saved with the character-level tokenizer of
tests/helpers/json_tok.py (a text is its tokens joined, so the output can be checked against the constraint)."""

from __future__ import annotations

import json
import re

import pytest

from verispec.cli import main

from ..helpers.json_tok import json_model, make_json_tokenizer


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("json-models")
    tok = make_json_tokenizer()
    for name, seed, layers in (("target", 0, 2), ("draft", 1, 1)):
        json_model(seed, layers=layers).save_pretrained(root / name)
        tok.save_pretrained(root / name)
    return root


def generate(models, *flags: str, seed: int = 1, max_new_tokens: int = 24) -> list[str]:
    """argv for a --json run on the saved models."""
    return [
        "generate", "ab", "--target", str(models / "target"), "--draft", str(models / "draft"), "--gamma", "3",
        "--seed", str(seed), "--max-new-tokens", str(max_new_tokens), "--json", *flags,
    ]  # fmt: skip


def run_json(models, capsys, *flags: str, seed: int = 1) -> dict:
    assert main(generate(models, *flags, seed=seed)) == 0
    return json.loads(capsys.readouterr().out)


def test_without_flags_the_model_writes_something_else(models, capsys):
    """The power of the tests below: unconstrained, these seeds write text no constraint here allows."""
    for seed in range(3):
        text = run_json(models, capsys, seed=seed)["text"]
        assert text not in ("ab", "cd") and not re.fullmatch(r"[xyz][0-9]{2}", text), text
        with pytest.raises(ValueError):
            json.loads(text)


def test_choice(models, capsys):
    for seed in range(3):
        doc = run_json(models, capsys, "--choice", "ab", "--choice", "cd", seed=seed)
        assert doc["text"] in ("ab", "cd") and doc["finish_reason"] == "stop", doc


def test_regex_and_grammar_file(models, capsys, tmp_path):
    grammar = tmp_path / "g.ebnf"
    grammar.write_text('root ::= ("x" | "y" | "z") [0-9] [0-9]\n')
    for flags in (("--regex", "[xyz][0-9]{2}"), ("--grammar", str(grammar))):
        doc = run_json(models, capsys, *flags)
        assert re.fullmatch(r"[xyz][0-9]{2}", doc["text"]) and doc["finish_reason"] == "stop", (flags, doc)


def test_json_schema_file(models, capsys, tmp_path):
    schema = {"type": "object", "properties": {"k": {"enum": ["ab", "cd", 10]}}, "required": ["k"]}
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    for seed in range(2):
        doc = run_json(models, capsys, "--json-schema", str(path), seed=seed)
        assert doc["finish_reason"] == "stop", doc
        assert json.loads(doc["text"]) in ({"k": "ab"}, {"k": "cd"}, {"k": 10})


def test_bad_files_and_schemas_are_usage_errors(models, capsys, tmp_path):
    not_json, bad_schema = tmp_path / "not.json", tmp_path / "bad.json"
    not_json.write_text("{not json")
    bad_schema.write_text('{"type": "nonsense"}')
    bad_grammar = tmp_path / "bad.ebnf"
    bad_grammar.write_text('start ::= "a"\n')
    cases = [
        (("--json-schema", str(tmp_path / "missing.json")), ["--json-schema", "cannot read", "missing.json"]),
        (("--json-schema", str(not_json)), ["--json-schema", "not valid JSON"]),
        (("--json-schema", str(bad_schema)), ["json_schema", "nonsense"]),  # found when compiled for the tokenizer
        (("--grammar", str(tmp_path / "missing.ebnf")), ["--grammar", "cannot read"]),
        (("--grammar", str(bad_grammar)), ["grammar", "root"]),
        (("--regex", "("), ["regex", "parenthesis"]),
        (("--choice", ""), ["--choice", "non-empty"]),
    ]
    for flags, says in cases:
        assert main(generate(models, *flags)) == 2, flags
        err = capsys.readouterr().err
        line = next((x for x in err.splitlines() if x.startswith("verispec: error: ")), "")
        assert all(s in line for s in says) and "Traceback" not in err, (flags, err)


def test_a_constraint_beside_stop_is_a_usage_error(models, capsys):
    assert main(generate(models, "--choice", "ab", "--stop", "b")) == 2
    assert "stop strings" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags",
    [
        ("--choice", "ab", "--regex", "a"),
        ("--json-object", "--json-schema", "s.json"),
        ("--grammar", "g.ebnf", "--regex", "a"),
    ],
)
def test_two_constraint_flags_are_refused_by_argparse(models, capsys, flags):
    with pytest.raises(SystemExit) as e:
        main(generate(models, *flags))
    assert e.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err
