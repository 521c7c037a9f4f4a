"""Property tests (hypothesis) for the request validators: whatever JSON a client sends, a request model either
accepts it or the error becomes one 400 naming a field the body holds (`serve.errors.validation_error`); strings
are refused exactly when UTF-8 cannot encode them; prompt lists are refused exactly when they mix kinds."""

from __future__ import annotations

import pytest
from fastapi.exceptions import RequestValidationError
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from verispec.serve.completions import prompt_list
from verispec.serve.errors import APIError, validation_error
from verispec.serve.ops import DetokenizeRequest, TokenizeRequest
from verispec.serve.protocol import ChatCompletionRequest, CompletionRequest
from verispec.serve.rl import GenerateRequest

MODELS = [CompletionRequest, ChatCompletionRequest, GenerateRequest, TokenizeRequest, DetokenizeRequest]
any_text = st.text(st.characters(codec=None, exclude_categories=()), max_size=8)  # lone surrogates included
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | any_text,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(any_text, inner, max_size=4),
    max_leaves=12,
)
FIELDS = ["model", "prompt", "messages", "prompts", "n", "seed", "stop", "max_tokens", "bad_words", "logit_bias",
          "tokens", "temperature", "generation_kwargs", "role", "content", "logprobs"]  # fmt: skip
bodies = st.dictionaries(st.sampled_from(FIELDS) | any_text, json_values, max_size=6) | json_values


def _paths(value, prefix: str = "") -> set[str]:
    """Every field path in a JSON value, as `field_path` writes them (a.b[0].c)."""
    out = {prefix} if prefix else set()
    if isinstance(value, dict):
        for k, v in value.items():
            out |= _paths(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out |= _paths(v, f"{prefix}[{i}]")
    return out


@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.__name__)
@settings(max_examples=150, deadline=None, derandomize=True)
@given(body=bodies)
def test_any_body_is_accepted_or_one_400_naming_a_field_it_holds(model, body):
    try:
        model.model_validate(body)
    except ValidationError as e:
        err = validation_error(RequestValidationError(e.errors(), body=body))
        assert err.status == 400 and err.message
        assert err.param is None or err.param in _paths(body) or err.param.split(".")[-1] in FIELDS + ["abort_all"]
        err.body()  # serialisable


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


@settings(max_examples=500, deadline=None, derandomize=True)
@given(text=any_text)
def test_a_string_is_refused_exactly_when_utf8_cannot_encode_it(text):
    body = {"model": "m", "prompt": text}
    try:
        CompletionRequest.model_validate(body)
        accepted = True
    except ValidationError as e:
        accepted = False
        assert "surrogate" in str(e) and validation_error(RequestValidationError(e.errors())).param == "prompt"
    assert accepted == _encodable(text)


prompt_items = st.one_of(st.text(max_size=3), st.integers(0, 50), st.lists(st.integers(0, 50), max_size=3))


@settings(max_examples=250, deadline=None, derandomize=True)
@given(prompt=st.text(max_size=3) | st.lists(prompt_items, max_size=5))
def test_prompt_lists_are_refused_exactly_when_empty_or_mixed(prompt):
    mixed = isinstance(prompt, list) and len({type(p) for p in prompt}) > 1
    try:
        out = prompt_list(prompt)
    except APIError as e:
        assert e.status == 400 and (mixed or prompt == [])
        return
    assert not mixed and prompt != []
    assert out == ([prompt] if isinstance(prompt, str) else [prompt] if isinstance(prompt[0], int) else prompt)
