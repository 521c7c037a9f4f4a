"""Structured outputs on the OpenAI routes: a request's constraint fields as one `Constraint` (the only place they are
read), and the field it came from, which every error about it names.

The fields (at most one constraint per request; two are a 400 naming both):
    response_format     OpenAI's: {"type": "text"} (none), {"type": "json_object"},
                        {"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}
                        (the schema is enforced whether strict is true or false)
    structured_outputs  vLLM's: {"json": schema or its JSON text, "regex", "choice": [...], "grammar": EBNF,
                        "json_object": true, "backend": "auto" | "xgrammar"}
    guided_json, guided_regex, guided_choice, guided_grammar, guided_decoding_backend: vLLM's older fields
A constraint that does not compile for the served tokenizer (a bad schema, regex or grammar) is a 400 naming its
field; so is a constraint beside `stop` strings or `ignore_eos`, which the engine refuses (a stop string could cut
the structure short; ignore_eos would run past its end)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from ..sampling import Constraint, ConstraintError
from .errors import APIError

__all__ = ["Asked", "request_constraint"]

_GUIDED = (
    ("guided_json", Constraint.json_schema),
    ("guided_regex", Constraint.regex),
    ("guided_choice", Constraint.choice),
    ("guided_grammar", Constraint.grammar),
)
_STRUCTURED = (
    ("json", "json_", Constraint.json_schema),
    ("regex", "regex", Constraint.regex),
    ("choice", "choice", Constraint.choice),
    ("grammar", "grammar", Constraint.grammar),
)


@dataclass(frozen=True)
class Asked:
    """A request's constraint and the field that asked for it, as the client wrote it (`guided_regex`,
    `response_format.json_schema.schema`)."""

    constraint: Constraint
    field: str


def _response_format(rf) -> tuple[str, Callable[[], Constraint]] | None:
    if rf.type != "json_schema":
        if rf.json_schema is not None:
            raise APIError(
                400,
                f'response_format.json_schema is read only with "type": "json_schema", not {rf.type!r}',
                "response_format.json_schema",
            )
        return None if rf.type == "text" else ("response_format", Constraint.json_object)
    if rf.json_schema is None:
        raise APIError(
            400,
            'response_format.json_schema is required with "type": "json_schema" (an object with name and schema)',
            "response_format.json_schema",
        )
    return "response_format.json_schema.schema", partial(Constraint.json_schema, rf.json_schema.schema_)


def _asked(req) -> list[tuple[str, Callable[[], Constraint]]]:
    """Every constraint field the request sets: (field, how to build its Constraint)."""
    found = []
    rf = getattr(req, "response_format", None)
    if rf is not None and (one := _response_format(rf)) is not None:
        found.append(one)
    so = getattr(req, "structured_outputs", None)
    if so is not None:
        for name, attr, make in _STRUCTURED:
            if (value := getattr(so, attr)) is not None:
                found.append((f"structured_outputs.{name}", partial(make, value)))
        if so.json_object:
            found.append(("structured_outputs.json_object", Constraint.json_object))
    for name, make in _GUIDED:
        if (value := getattr(req, name, None)) is not None:
            found.append((name, partial(make, value)))
    return found


def request_constraint(req) -> Asked | None:
    """The request's structured-output constraint (None: none asked), built from whichever field asks for it; 400
    when two fields ask, or when the value is malformed (naming the field). Compiling it for the tokenizer, which
    finds a bad schema, regex or grammar, is the caller's (`Served.constraint`)."""
    found = _asked(req)
    if len(found) > 1:
        names = [name for name, _ in found]
        raise APIError(
            400,
            f"{' and '.join(names)} each ask for a structured output; a request may send only one constraint",
            names[1],
        )
    if not found:
        return None
    name, make = found[0]
    try:
        return Asked(make(), name)
    except ConstraintError as e:
        raise APIError(400, f"{name}: {e}", name) from None
