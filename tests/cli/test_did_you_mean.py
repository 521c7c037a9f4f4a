"""A misspelt flag, command, choice, --spec key or value, or request field gets a "did you mean" naming the closest
one; an unknown flag is reported with its command's own usage line (not the top-level one)."""

from __future__ import annotations

import pytest
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from tests.helpers.cli import run_verispec


def _error(argv, capsys) -> str:
    """Run the command; it must exit with status 2 and no traceback; return its stderr."""
    r = run_verispec(argv, capsys)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    return r.stderr


@pytest.mark.parametrize(
    "argv,usage,message",
    [
        (
            ["generate", "x", "--temprature", "0.5"],
            "usage: verispec generate ",
            "verispec generate: error: unrecognized arguments: --temprature 0.5; did you mean --temperature?",
        ),
        (
            ["generate", "x", "--temprature=0.5", "--max-new-tokns", "3"],
            "usage: verispec generate ",
            "unrecognized arguments: --temprature=0.5 --max-new-tokns 3; --temprature: did you mean --temperature?; "
            "--max-new-tokns: did you mean --max-new-tokens?",
        ),
        (
            ["serve", "--prot", "8001"],
            "usage: verispec serve ",
            "verispec serve: error: unrecognized arguments: --prot 8001; did you mean --port?",
        ),
        (
            ["certify", "kernel", "--sampels", "5"],
            "usage: verispec certify kernel ",
            "unrecognized arguments: --sampels 5; did you mean --samples?",
        ),
        (
            ["generate", "x", "--draft-p-min", "0.1"],
            "usage: verispec generate ",
            "unrecognized arguments: --draft-p-min 0.1; --draft-p-min is --stop-below here",
        ),
        (["genrate", "x"], "usage: verispec ", "invalid choice: 'genrate' (choose from"),
        (["genrate", "x"], "usage: verispec ", "; did you mean 'generate'?"),
        (["bench", "e2f"], "usage: verispec bench ", "; did you mean 'e2e'?"),
    ],
)
def test_a_misspelt_flag_or_command_gets_a_suggestion_under_its_own_usage(argv, usage, message, capsys):
    err = _error(argv, capsys)
    assert err.startswith(usage) and message in err, err


def test_nothing_close_no_suggestion(capsys):
    err = _error(["generate", "x", "--zzzzzz", "1"], capsys)
    assert err.strip().endswith("unrecognized arguments: --zzzzzz 1")


@pytest.mark.parametrize(
    "spec,message",
    [
        ("gama=4", "unknown key 'gama' in spec 'gama=4'; the keys are draft, "),
        ("gama=4", "; did you mean 'gamma'?"),
        ("stop_bellow=0.1", "; did you mean 'stop_below'?"),
        ("runner=lamacpp", "runner must be one of auto, fast, hf, llamacpp, got 'lamacpp'; did you mean 'llamacpp'?"),
        ("verify=blok", "got 'blok'; did you mean 'block'?"),
    ],
)
def test_a_misspelt_spec_key_or_value_gets_a_suggestion(spec, message, capsys):
    assert message in _error(["generate", "x", "--spec", spec], capsys)


@pytest.mark.parametrize(
    "body,message",
    [
        (
            {"prompt": "a", "temprature": 0.5},
            "unknown field 'temprature': this server does not support it (did you mean 'temperature'?)",
        ),
        ({"prompt": "a", "max_token": 5}, "(did you mean 'max_tokens'?)"),
        ({"prompt": "a", "zzzzzz": 1}, "unknown field 'zzzzzz': this server does not support it"),
    ],
)
def test_a_misspelt_request_field_gets_a_suggestion(body, message):
    from verispec.serve.errors import validation_error
    from verispec.serve.protocol import CompletionRequest

    with pytest.raises(ValidationError) as e:
        CompletionRequest.model_validate({"model": "m", **body})
    err = validation_error(RequestValidationError(e.value.errors(), body=body))
    assert err.status == 400 and err.message.endswith(message), err.message
