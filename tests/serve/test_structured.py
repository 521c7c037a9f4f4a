"""Structured outputs on the OpenAI routes (`verispec.serve.jobs.request_constraint`): OpenAI's response_format,
vLLM's structured_outputs and guided_* fields, on a character-level tokenizer (tests/helpers/json_tok.py: a choice's
text is its tokens joined) so the returned text can be checked against the constraint exactly. Every form of field
constrains the output (a random model left alone would not write these strings); every bad input is a 400 naming
the field and saying what is wrong."""

from __future__ import annotations

import json
import re

import pytest
from fastapi.testclient import TestClient

from verispec.engine.config import SpecConfig
from verispec.engine.generator import SpeculativeGenerator
from verispec.model.loading import LoadedModel
from verispec.sampling.constraint import MAX_CONSTRAINT_CHARS
from verispec.serve import create_app

from ..helpers.json_tok import json_model, make_json_tokenizer
from ..helpers.server import MODEL, LiveServer

PROMPT = "ab"
ROUTES = ["/v1/completions", "/v1/chat/completions"]
ENUM_SCHEMA = {
    "type": "object",
    "properties": {"k": {"enum": ["ab", "cd", 10]}},
    "required": ["k"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def app():
    tok = make_json_tokenizer()
    target = LoadedModel(json_model(0), tok, "json-target")
    draft = LoadedModel(json_model(1, layers=1), tok, "json-draft")
    return create_app(
        SpeculativeGenerator(target, draft, config=SpecConfig(draft="model", gamma=3)), MODEL, max_batch=8
    )


@pytest.fixture(scope="module")
def client(app):
    with TestClient(app, base_url="http://localhost") as c:
        yield c


def body(route: str, **fields) -> dict:
    where = {"prompt": PROMPT} if route.endswith("/completions") and "chat" not in route else None
    base = {"model": MODEL, "max_tokens": 24, "seed": 1}
    base |= where or {"messages": [{"role": "user", "content": PROMPT}]}
    return base | fields


def text_of(route: str, choice: dict) -> str:
    return choice["message"]["content"] if "chat" in route else choice["text"]


def post(client, route: str, **fields) -> dict:
    r = client.post(route, json=body(route, **fields))
    assert r.status_code == 200, r.text
    return r.json()


def refused(client, route: str, **fields) -> dict:
    raw = json.dumps(body(route, **fields))  # ASCII: a lone surrogate travels as its \u escape
    r = client.post(route, content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    return r.json()["error"]


# --- each field form constrains the output ------------------------------------------------------------------------


def test_the_unconstrained_model_writes_none_of_these(client):
    """The power of the tests below: without a constraint these seeds give text no constraint here allows."""
    for route in ROUTES:
        for seed in range(4):
            out = text_of(route, post(client, route, seed=seed, max_tokens=8)["choices"][0])
            assert out not in ("ab", "cd") and not re.fullmatch(r"[xyz][0-9]{2}", out), out
            with pytest.raises(ValueError):
                json.loads(out)


CHOICE_FORMS = {
    "guided_choice": {"guided_choice": ["ab", "cd"]},
    "structured_outputs.choice": {"structured_outputs": {"choice": ["ab", "cd"], "backend": "xgrammar"}},
}


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("form", CHOICE_FORMS)
def test_a_choice_returns_exactly_one_of_the_strings(client, route, form):
    out = post(client, route, n=3, **CHOICE_FORMS[form])
    assert len(out["choices"]) == 3
    for c in out["choices"]:
        assert text_of(route, c) in ("ab", "cd") and c["finish_reason"] == "stop"


REGEX = r"[xyz][0-9]{2}"
REGEX_FORMS = {
    "guided_regex": {"guided_regex": REGEX, "guided_decoding_backend": "auto"},
    "structured_outputs.regex": {"structured_outputs": {"regex": REGEX}},
    "guided_grammar": {"guided_grammar": "root ::= [xyz] d d\nd ::= [0-9]"},
    "structured_outputs.grammar": {"structured_outputs": {"grammar": 'root ::= ("x" | "y" | "z") [0-9] [0-9]'}},
}


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("form", REGEX_FORMS)
def test_a_regex_or_grammar_is_matched_by_the_whole_output(client, route, form):
    out = post(client, route, n=2, **REGEX_FORMS[form])
    for c in out["choices"]:
        assert re.fullmatch(REGEX, text_of(route, c)) and c["finish_reason"] == "stop", c


SCHEMA_FORMS = {
    "response_format": {
        "response_format": {"type": "json_schema", "json_schema": {"name": "k", "schema": ENUM_SCHEMA, "strict": True}}
    },
    "response_format, strict false": {
        "response_format": {"type": "json_schema", "json_schema": {"name": "k", "schema": ENUM_SCHEMA, "strict": False}}
    },
    "guided_json": {"guided_json": ENUM_SCHEMA},
    "guided_json as text": {"guided_json": json.dumps(ENUM_SCHEMA)},
    "structured_outputs.json": {"structured_outputs": {"json": ENUM_SCHEMA}},
}


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("form", SCHEMA_FORMS)
def test_a_json_schema_gives_json_valid_under_it(client, route, form):
    out = post(client, route, n=2, **SCHEMA_FORMS[form])
    for c in out["choices"]:
        assert c["finish_reason"] == "stop", c
        doc = json.loads(text_of(route, c))
        assert set(doc) == {"k"} and doc["k"] in ("ab", "cd", 10)


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize(
    "form", [{"response_format": {"type": "json_object"}}, {"structured_outputs": {"json_object": True}}]
)
def test_json_object_gives_an_object(client, route, form):
    out = post(client, route, n=2, max_tokens=64, **form)
    for c in out["choices"]:
        text = text_of(route, c)
        assert text.startswith("{"), text
        if c["finish_reason"] == "stop":
            assert isinstance(json.loads(text), dict)
        else:  # cut by max_tokens: a JSON object's beginning, never complete JSON
            assert c["finish_reason"] == "length"
            with pytest.raises(ValueError):
                json.loads(text)


@pytest.mark.parametrize("route", ROUTES)
def test_response_format_text_and_empty_structured_outputs_constrain_nothing(client, route):
    plain = post(client, route, seed=2, max_tokens=8)
    for form in ({"response_format": {"type": "text"}}, {"structured_outputs": {}}, {"guided_json": None}):
        assert post(client, route, seed=2, max_tokens=8, **form)["choices"] == plain["choices"]


@pytest.mark.parametrize("route", ROUTES)
def test_streaming_with_a_constraint_gives_the_plain_answer(client, route):
    fields = {"n": 2, "seed": 5, **SCHEMA_FORMS["guided_json"]}
    plain = post(client, route, **fields)["choices"]
    texts, ends = {0: "", 1: ""}, {}
    with client.stream("POST", route, json=body(route, stream=True, **fields)) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for c in json.loads(line[6:])["choices"]:
                texts[c["index"]] += c["text"] if "chat" not in route else c["delta"].get("content") or ""
                if c["finish_reason"] is not None:
                    ends[c["index"]] = c["finish_reason"]
    assert [texts[i] for i in (0, 1)] == [text_of(route, c) for c in plain]
    assert ends == {0: "stop", 1: "stop"}
    for t in texts.values():
        assert json.loads(t)["k"] in ("ab", "cd", 10)


def test_the_openai_client_sends_response_format(app):
    """The official client's shapes: response_format as the SDK sends it, vLLM's fields through extra_body."""
    with LiveServer(app.state.served.gen, max_batch=4) as s:
        c = s.client()
        fmt = {"type": "json_schema", "json_schema": {"name": "k", "schema": ENUM_SCHEMA, "strict": True}}
        out = c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=24, seed=3, response_format=fmt
        )
        assert json.loads(out.choices[0].message.content)["k"] in ("ab", "cd", 10)
        out = c.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=8, seed=3, extra_body={"guided_choice": ["ab", "cd"]}
        )
        assert out.choices[0].text in ("ab", "cd")


# --- bad input: a 400 naming the field and the problem --------------------------------------------------------


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize(
    "fields,param,says",
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "k", "schema": {"type": "nonsense"}}}},
            "response_format.json_schema.schema",
            "nonsense",
        ),
        ({"guided_json": {"type": "nonsense"}}, "guided_json", "nonsense"),
        ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
        ({"structured_outputs": {"json": {"type": "nonsense"}}}, "structured_outputs.json", "nonsense"),
        ({"guided_regex": "("}, "guided_regex", "parenthesis"),
        ({"structured_outputs": {"regex": "a{2"}}, "structured_outputs.regex", "regex"),
        ({"guided_grammar": "root ::= "}, "guided_grammar", "EBNF"),
        ({"structured_outputs": {"grammar": 'start ::= "a"'}}, "structured_outputs.grammar", "root"),
        ({"guided_choice": []}, "guided_choice", "at least 1"),
        ({"guided_choice": ["ab", ""]}, "guided_choice", "non-empty"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "required"),
        ({"response_format": {"type": "yaml"}}, "response_format.type", "json_schema"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "k"}}},
            "response_format.json_schema.schema",
            "Field required",
        ),
    ],
)
def test_a_bad_constraint_is_a_400_naming_its_field(client, route, fields, param, says):
    err = refused(client, route, **fields)
    assert err["param"] == param and says in err["message"], err
    assert err["type"] == "invalid_request_error"


@pytest.mark.parametrize("route", ROUTES)
def test_two_constraints_are_refused_naming_both(client, route):
    err = refused(client, route, guided_regex="a", response_format={"type": "json_object"})
    assert "response_format" in err["message"] and "guided_regex" in err["message"], err
    err = refused(client, route, structured_outputs={"choice": ["a"], "regex": "a"})
    assert "structured_outputs.choice" in err["message"] and "structured_outputs.regex" in err["message"], err


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize(
    "fields,param",
    [
        ({"guided_choice": ["ab"], "guided_decoding_backend": "outlines"}, "guided_decoding_backend"),
        ({"structured_outputs": {"choice": ["ab"], "backend": "guidance"}}, "structured_outputs.backend"),
    ],
)
def test_another_backend_is_refused(client, route, fields, param):
    err = refused(client, route, **fields)
    assert err["param"] == param and "xgrammar" in err["message"], err


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize(
    "fields,param",
    [
        ({"guided_whitespace_pattern": r"\s*"}, "guided_whitespace_pattern"),
        ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern"),
        ({"response_format": {"type": "json_object", "schema": {}}}, "response_format.schema"),
    ],
)
def test_unsupported_options_are_refused_by_name(client, route, fields, param):
    err = refused(client, route, guided_regex="a", **fields) if "guided" in param else refused(client, route, **fields)
    assert err["param"] == param and param in err["message"], err


@pytest.mark.parametrize("route", ROUTES)
def test_a_constraint_beside_stop_or_ignore_eos_is_refused(client, route):
    err = refused(client, route, guided_choice=["ab"], stop=["b"])
    assert err["param"] == "stop" and "guided_choice" in err["message"], err
    err = refused(client, route, guided_choice=["ab"], ignore_eos=True)
    assert err["param"] == "ignore_eos" and "guided_choice" in err["message"], err
    assert post(client, route, guided_choice=["ab"], stop=[])["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("route", ROUTES)
def test_constraints_over_the_size_cap_are_refused_before_any_work(client, route):
    big = {"enum": ["a" * (MAX_CONSTRAINT_CHARS // 2), "b" * (MAX_CONSTRAINT_CHARS // 2)]}
    for fields, param in (
        ({"guided_json": big}, "guided_json"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "k", "schema": big}}},
         "response_format.json_schema.schema"),
        ({"guided_regex": "a" * (MAX_CONSTRAINT_CHARS + 1)}, "guided_regex"),
        ({"structured_outputs": {"choice": ["a" * 40000, "b" * 40000]}}, "structured_outputs.choice"),
    ):  # fmt: skip
        err = refused(client, route, **fields)
        assert err["param"] == param and str(MAX_CONSTRAINT_CHARS) in err["message"], err
    err = refused(client, route, guided_json={"enum": ["\ud800"]})
    assert err["param"] == "guided_json" and "surrogate" in err["message"], err
