"""A structured-output constraint: what the output must match (a JSON schema, any JSON object, a regular expression,
one of a list of strings, or a grammar), as a frozen description with no tokenizer and no grammar engine.

A constraint is part of the sampling process: it is applied to the logits before every other processing step
(`probs_from_logits`, vLLM's order), to the target's p and the draft's q alike, at every position of a speculative
step. `verispec.structured` compiles it against a tokenizer (xgrammar) and follows each request's output with a
matcher; this module only says what is asked.

    Constraint.json_schema({"type": "object", "properties": {"name": {"type": "string"}}})
    Constraint.json_object()                  # any JSON object
    Constraint.regex(r"\\d{3}-\\d{4}")
    Constraint.choice(["yes", "no"])
    Constraint.grammar('root ::= "a" root | "b"')  # EBNF (xgrammar's / llama.cpp's GBNF dialect)
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["CONSTRAINT_KINDS", "MAX_CONSTRAINT_CHARS", "Constraint", "ConstraintError"]

CONSTRAINT_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
MAX_CONSTRAINT_CHARS = 1 << 16  # a schema, regex or grammar's text (64 KiB): compiling is bounded before any work


class ConstraintError(ValueError):
    """A constraint that cannot be used (a ValueError): malformed, or refused by the grammar engine when compiled."""


@dataclass(frozen=True)
class Constraint:
    """What the output must match: a structured-output constraint, part of `SamplingParams`.

    Build it with the class methods. A constraint shapes p and q alike at every drafted position, so every
    verification rule stays exact. Equal constraints compile to the same grammar (compilations are cached by it).

    ```python
    params = SamplingParams(temperature=1.0, seed=0, constraint=Constraint.json_schema(schema))
    ```

    Attributes:
        kind: One of CONSTRAINT_KINDS: "json_schema", "json_object", "regex", "choice" or "grammar".
        source: The canonical text: the schema as compact JSON (keys in their given order), the regex or grammar
            as given, the choices as a JSON list ("" for json_object).
        whitespace: JSON kinds: allow any whitespace between tokens (else one space after ':' and ',').

    Raises:
        ConstraintError: An unknown kind, an empty or too long source, or whitespace on a non-JSON kind.
    """

    kind: str
    source: str = ""
    whitespace: bool = False  # JSON kinds: allow any whitespace between tokens (else one space after ':' and ',')

    def __post_init__(self):
        if self.kind not in CONSTRAINT_KINDS:
            raise ConstraintError(
                f"a constraint's kind must be one of {', '.join(CONSTRAINT_KINDS)}, got {self.kind!r}"
            )
        if len(_text(f"a {self.kind} constraint's source", self.source)) > MAX_CONSTRAINT_CHARS:
            raise ConstraintError(
                f"a {self.kind} constraint is at most {MAX_CONSTRAINT_CHARS} characters, got {len(self.source)}"
            )
        if self.kind != "json_object" and not self.source:
            raise ConstraintError(f"a {self.kind} constraint is empty")
        if not isinstance(self.whitespace, bool):
            raise ConstraintError(f"whitespace must be a bool, got {self.whitespace!r}")
        if self.whitespace and self.kind not in ("json_schema", "json_object"):
            raise ConstraintError(f"whitespace applies to JSON constraints, not to a {self.kind} constraint")

    @classmethod
    def json_schema(cls, schema: Mapping | str | bool, whitespace: bool = False) -> Constraint:
        """The output is JSON valid under this schema.

        Args:
            schema: The JSON schema: a dict, or its JSON text; `True` allows any JSON value.
            whitespace: Allow any whitespace between tokens.

        Raises:
            ConstraintError: The schema is not valid JSON, not an object, or nested too deeply. Keywords the
                grammar would not enforce are refused when it is compiled.
        """
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise ConstraintError(f"the JSON schema is not valid JSON: {e}") from None
            except RecursionError:
                raise ConstraintError("the JSON schema is nested too deeply") from None
        if not isinstance(schema, (Mapping, bool)):
            raise ConstraintError(f"a JSON schema must be an object (or true), got {type(schema).__name__}")
        try:
            text = json.dumps(schema, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise ConstraintError(f"the JSON schema cannot be written as JSON: {e}") from None
        except RecursionError:
            raise ConstraintError("the JSON schema is nested too deeply") from None
        return cls("json_schema", text, whitespace)

    @classmethod
    def json_object(cls, whitespace: bool = False) -> Constraint:
        """The output is a JSON object (OpenAI's response_format json_object).

        Args:
            whitespace: Allow any whitespace between tokens.
        """
        return cls("json_object", "", whitespace)

    @classmethod
    def regex(cls, pattern: str) -> Constraint:
        """The whole output matches this regular expression.

        Args:
            pattern: The regular expression.

        Raises:
            ConstraintError: The pattern is not a string (a malformed one is refused when it is compiled).
        """
        return cls("regex", _text("a regex", pattern))

    @classmethod
    def choice(cls, choices: Sequence[str]) -> Constraint:
        """The output is exactly one of these strings.

        Args:
            choices: The strings allowed, none empty.

        Raises:
            ConstraintError: `choices` is not a non-empty list of non-empty strings.
        """
        if isinstance(choices, str) or not isinstance(choices, Sequence):
            raise ConstraintError(f"choices must be a list of strings, got {type(choices).__name__}")
        if not choices or any(not isinstance(c, str) or not c for c in choices):
            raise ConstraintError("choices must be a non-empty list of non-empty strings")
        return cls("choice", json.dumps(list(choices), ensure_ascii=False))

    @classmethod
    def grammar(cls, ebnf: str) -> Constraint:
        """The output is a sentence of this EBNF grammar.

        Args:
            ebnf: The grammar, starting at rule `root` (xgrammar's dialect, which reads llama.cpp's GBNF).

        Raises:
            ConstraintError: The grammar is not a string (a malformed one is refused when it is compiled).
        """
        return cls("grammar", _text("a grammar", ebnf))

    @property
    def choices(self) -> list[str]:
        return json.loads(self.source) if self.kind == "choice" else []

    def describe(self) -> str:
        """A short label for messages and reports: `json_schema (412 chars)`, `regex '\\d+'`."""
        if self.kind == "json_object":
            return "json_object"
        if self.kind == "regex" and len(self.source) <= 40:
            return f"regex {self.source!r}"
        return f"{self.kind} ({len(self.source)} chars)"


def _text(what: str, value) -> str:
    if not isinstance(value, str):
        raise ConstraintError(f"{what} must be a string, got {type(value).__name__}")
    return value
