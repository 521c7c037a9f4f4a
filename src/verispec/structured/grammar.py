"""Grammars on a tokenizer: `Grammars` compiles a `Constraint` for one tokenizer (xgrammar, cached), and a
`GrammarState` follows one request's output and gives the grammar's mask after any path of drafts below it.

Why xgrammar: measured on this project's CPU with SmolLM2's tokenizer (V = 49,152) over a 58-token JSON document
under a 5-field schema, xgrammar 0.2.9 fills a token mask in 10.6 us on average (llguidance 1.9.1: 50 us), rolls
back in ~8 us (jump-forward is read from its masks, `GrammarState.jump`: its own `find_jump_forward_tokens` never
returns on an endless forced text); `docs/bench/grammar-engines.md` has the comparison.

A state's masks are cached per path for one step (`advance` clears them): the draft model's q at draft j and the
target's p at slot j read the same mask, computed once. A path with a token the grammar refuses is dead: its slots
take the mask of its longest live prefix (never emitted: the refused token has p = 0, so nothing below it is
accepted), and the slots after a stop token allow every token (the row ends at the stop token). A dead end — an
incomplete output no token of the vocabulary continues — allows every token too, for p and q alike; `advance` cuts
what was drawn there and `stuck` ends the request, as plain constrained decoding would.
"""

from __future__ import annotations

import json
import re
import sys
import threading
import time
import urllib.parse
from collections.abc import Iterable, Sequence
from functools import wraps

import numpy as np
import torch
from torch import Tensor

from ..sampling.constraint import Constraint, ConstraintError

__all__ = ["JUMP_CAP", "GrammarState", "Grammars", "check_syntax"]

# bit i of word w of xgrammar's bitmask is token 32 w + i: on a little-endian host byte k of word w holds tokens
# 32 w + 8 k ... + 7, lowest bit first, which np.unpackbits(bitorder="little") reads in one C pass
if sys.byteorder != "little":  # pragma: no cover - every platform torch ships wheels for is little-endian
    raise ImportError("verispec.structured unpacks xgrammar's bitmasks byte by byte: it needs a little-endian host")
_CACHE_BYTES = 256 << 20  # xgrammar's compiled-grammar cache (the same schema every epoch compiles once)
# Jump-forward is walked a token at a time and stops at the caller's limit (a row's remaining room, the spec's jump)
# or at JUMP_CAP, whichever is first: a grammar that forces an endless text ("root ::= "a" root", a JSON schema whose
# object requires itself) costs that many steps. (xgrammar's own find_jump_forward_tokens builds the whole forced text
# first and never returns on such a grammar, eating memory until the process dies.)
JUMP_CAP = 64
_JUMP_SCAN = 1024  # a state allowing more tokens than this, all starting with one byte, is not read for forced text


def _xgrammar():
    try:
        import xgrammar
    except ImportError as e:  # pragma: no cover - a dependency; a broken install says so
        raise ConstraintError(f"structured outputs need the xgrammar package ({e})") from None
    return xgrammar


class Grammars:
    """Constraints compiled for one tokenizer: `state(constraint)` gives a new request's `GrammarState`.

    vocab_size: the ids the engine samples (masks have this length; a larger tokenizer's extra ids are never
    allowed); stop_ids: the tokens that end a request (EOS): the grammar allows them only where the output is
    complete."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids: Iterable[int]):
        xgr = _xgrammar()
        self.vocab_size = int(vocab_size)
        self.stop_ids = sorted({int(t) for t in stop_ids})
        size = max(self.vocab_size, len(tokenizer))
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=size, stop_token_ids=self.stop_ids)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_limit_bytes=_CACHE_BYTES)
        special = set(self.info.special_token_ids) | set(self.stop_ids)
        # each sampled token's text (bytes; empty for special and stop tokens) and first byte (-1: none), for jump
        self.texts = [
            b"" if t in special else bytes(w) for t, w in enumerate(self.info.decoded_vocab[: self.vocab_size])
        ]
        self.texts += [b""] * (self.vocab_size - len(self.texts))
        self.first = torch.tensor([w[0] if w else -1 for w in self.texts], dtype=torch.int16)
        self._lock = threading.Lock()  # compiles come from the server's threads and the engine's

    def compile(self, c: Constraint):
        """The compiled grammar of a constraint (cached by xgrammar); ConstraintError naming what is wrong."""
        if not isinstance(c, Constraint):
            raise ConstraintError(f"expected a Constraint, got {type(c).__name__}")
        try:
            with self._lock:
                return self._compile(c)
        except ConstraintError:
            raise
        except Exception as e:  # xgrammar raises RuntimeError / ValueError / its own errors with the reason
            raise ConstraintError(f"the {c.describe()} constraint does not compile: {_reason(e)}") from None

    def _compile(self, c: Constraint):
        comp = self.compiler
        if c.kind == "json_schema":
            _check_enforceable(json.loads(c.source))
            return comp.compile_json_schema(c.source, any_whitespace=c.whitespace, strict_mode=True)
        if c.kind == "json_object":
            return comp.compile_json_schema('{"type": "object"}', any_whitespace=c.whitespace, strict_mode=False)
        if c.kind == "regex":
            return comp.compile_regex(c.source)
        if c.kind == "choice":
            return comp.compile_grammar("root ::= " + " | ".join(_ebnf_string(s) for s in c.choices))
        _check_no_temperature(c.source)
        return comp.compile_grammar(c.source)

    def state(self, c: Constraint, stop_ids: Iterable[int] = ()) -> GrammarState:
        """A matcher at the start of an output; stop_ids: the request's own stop tokens beside EOS (ended like it)."""
        xgr, t0 = _xgrammar(), time.perf_counter()
        stops = sorted(set(self.stop_ids) | {int(t) for t in stop_ids})
        matcher = xgr.GrammarMatcher(self.compile(c), override_stop_tokens=stops or None)
        state = GrammarState(matcher, self.info.vocab_size, self.vocab_size, xgr, self, stops)
        state.seconds = time.perf_counter() - t0  # its setup counts as its own time
        return state


def check_syntax(c: Constraint) -> None:
    """Parse a constraint's regex, EBNF grammar or JSON schema without a tokenizer (xgrammar's `Grammar`; well under
    a millisecond for a typical one), so that a malformed one is refused before any model loads. `Grammars.compile`
    still compiles it for the tokenizer (what only a vocabulary can refuse is refused there).

    Raises:
        ConstraintError: The regex, grammar or schema does not parse, or the schema has a keyword the grammar would
            not enforce; the message is the one `Grammars.compile` gives.
    """
    if not isinstance(c, Constraint):
        raise ConstraintError(f"expected a Constraint, got {type(c).__name__}")
    grammar = _xgrammar().Grammar
    try:
        if c.kind == "json_schema":
            _check_enforceable(json.loads(c.source))
            grammar.from_json_schema(c.source, any_whitespace=c.whitespace, strict_mode=True)
        elif c.kind == "regex":
            grammar.from_regex(c.source)
        elif c.kind == "grammar":
            _check_no_temperature(c.source)
            grammar.from_ebnf(c.source)
    except ConstraintError:
        raise
    except Exception as e:  # xgrammar raises RuntimeError / ValueError / its own errors with the reason
        raise ConstraintError(f"the {c.describe()} constraint does not compile: {_reason(e)}") from None


def _check_no_temperature(ebnf: str) -> None:
    if _TEMPERATURE.search(ebnf):  # xgrammar reads per-rule temperatures; the sampling here would not
        raise ConstraintError("a grammar rule's temperature attribute is not supported: set the request's temperature")


_TEMPERATURE = re.compile(r"\[\s*temperature\s*=")  # an EBNF rule attribute: rule[temperature=0.1] ::= ...
_LOG_PREFIX = re.compile(r"^\s*(\[[\d:]+\]\s*)?(\S+\.(cc|h|cpp):\d+:\s*)?")  # xgrammar's "[08:02:40] /x.cc:12: "


def _reason(e: Exception) -> str:
    """The first line of a grammar engine's error, without its log prefix (time stamp, source file and line)."""
    lines = [line for line in str(e).strip().splitlines() if line.strip()]
    return _LOG_PREFIX.sub("", lines[0]).strip() if lines else type(e).__name__


# JSON-schema keywords a grammar cannot enforce, or that xgrammar 0.2.9 compiles without enforcing (it logs and drops
# them, or drops them silently): a schema with one is refused, so that "stop" keeps meaning "valid under the schema"
_UNENFORCED = (
    "not", "if", "then", "else", "dependentRequired", "dependentSchemas", "dependencies", "contains", "minContains",
    "maxContains", "propertyNames", "patternProperties", "unevaluatedProperties", "unevaluatedItems", "multipleOf",
    "$dynamicRef", "$recursiveRef",
)  # fmt: skip
_SCHEMA_MAPS = ("properties", "$defs", "definitions")  # keyword -> {name: schema}
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")  # keyword -> [schema, ...]
_SCHEMAS = ("items", "additionalProperties", "additionalItems")  # keyword -> schema (items: or a list of them)
# keywords that constrain a value: beside a $ref or an allOf, xgrammar 0.2.9 keeps one side and drops the other
_ASSERTING = (
    "type", "enum", "const", "properties", "required", "additionalProperties", "items", "prefixItems",
    "additionalItems", "minItems", "maxItems", "minProperties", "maxProperties", "minLength", "maxLength", "pattern",
    "format", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "anyOf", "oneOf", "allOf", "$ref",
)  # fmt: skip
# the string formats xgrammar 0.2.9 enforces (on a schema of type "string"); any other format is an annotation only
# (JSON Schema's default: a validator need not assert formats), accepted unchecked
_FORMATS = (
    "date", "date-time", "duration", "email", "hostname", "ipv4", "ipv6", "json-pointer", "relative-json-pointer",
    "time", "uri", "uri-reference", "uri-template", "uuid",
)  # fmt: skip


def _check_enforceable(root) -> None:
    """ConstraintError naming the first keyword of a JSON schema (at its JSON pointer) the grammar would not enforce.
    Every schema position is read: keyword values, $defs / definitions, and the targets of local $refs (#/...).
    Only keyword positions are read: a property named "if" is a name, not the keyword."""
    seen: set[int] = set()

    def refuse(what: str, where: str, hint: str = "") -> None:
        raise ConstraintError(f"the JSON schema's {what} (at {where}) cannot be enforced by the grammar engine{hint}")

    def check(schema, where: str) -> None:
        if not isinstance(schema, dict) or id(schema) in seen:
            return
        seen.add(id(schema))
        for key in _UNENFORCED:
            if key in schema:
                refuse(repr(key), where)
        if schema.get("uniqueItems") is True:
            refuse("'uniqueItems'", where)
        for bound in ("minLength", "maxLength"):
            if "pattern" in schema and bound in schema:
                refuse(f"'pattern' beside {bound!r}", where, ": put the length into the pattern (e.g. ^[a-z]{1,8}$)")
            if "format" in schema and bound in schema:
                refuse(f"'format' beside {bound!r}", where, ": drop one of them (the format would win)")
        if isinstance(schema.get("pattern"), str) and _lookaround(schema["pattern"]):
            refuse("'pattern' with a lookahead (?= / (?!", where)
        # a format xgrammar does not check, or one on a non-string (OpenAPI's int32, pydantic's password), is an
        # annotation, as JSON Schema's default vocabulary makes every format: alone it leaves nothing unenforced
        if "format" in schema and "pattern" in schema:
            refuse("'format' beside 'pattern'", where, ": the pattern would be dropped (drop the format)")
        if isinstance(schema.get("allOf"), list):
            beside = [k for k in _ASSERTING if k in schema and k != "allOf"]
            if len(schema["allOf"]) > 1 or beside:
                refuse("'allOf'", where, ": write it as one schema (allOf of one schema, beside annotations only)")
        if "$ref" in schema:
            ref = schema["$ref"]
            if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
                refuse(f"'$ref': {ref!r}", where, ": only references into the same schema (#/...) are resolved")
            beside = [k for k in _ASSERTING if k in schema and k != "$ref"]
            if beside:
                refuse(f"'$ref' beside {beside[0]!r}", where, ": move it into the referenced schema or an anyOf")
            check(_pointer(root, ref), ref)
        for key in _SCHEMA_MAPS:
            if isinstance(schema.get(key), dict):
                for name, sub in schema[key].items():
                    check(sub, f"{where}/{key}/{name}")
        for key in (*_SCHEMA_LISTS, *_SCHEMAS):
            value = schema.get(key)
            for i, sub in enumerate(value) if isinstance(value, list) else [(None, value)]:
                check(sub, f"{where}/{key}" + ("" if i is None else f"/{i}"))

    check(root, "#")


def _pointer(root, ref: str):
    """The value a local JSON pointer ("#/a/b") names in `root`; None where it names nothing (xgrammar says so)."""
    node = root
    for part in ref[2:].split("/") if ref.startswith("#/") else []:
        part = urllib.parse.unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _lookaround(pattern: str) -> bool:
    """Whether a regex has a lookahead group, (?= or (?!, outside a character class (xgrammar 0.2.9 compiles a JSON
    schema's pattern without it, logging that it ignored it; a regex constraint with one it refuses itself)."""
    i, n = 0, len(pattern)
    while i < n:
        if pattern[i] == "\\":
            i += 2
            continue
        if pattern[i] == "[":  # a character class, to its closing "]" (a "]" first in it, or after "^", is a member)
            i += 2 if pattern[i + 1 : i + 2] == "^" else 1
            i += 1 if pattern[i : i + 1] == "]" else 0
            while i < n and pattern[i] != "]":
                i += 2 if pattern[i] == "\\" else 1
        elif pattern.startswith(("(?=", "(?!"), i):
            return True
        i += 1
    return False


def _ebnf_string(s: str) -> str:
    """A literal as an EBNF string (json.dumps's escapes are EBNF's)."""
    return json.dumps(s, ensure_ascii=False)


def _timed(method):
    """A GrammarState method whose wall time adds to the state's `seconds` (the outermost call: no time twice)."""

    @wraps(method)
    def timed(self, *args):
        if self._timing:
            return method(self, *args)
        self._timing, t0 = True, time.perf_counter()
        try:
            return method(self, *args)
        finally:
            self.seconds += time.perf_counter() - t0
            self._timing = False

    return timed


class GrammarState:
    """One request's grammar matcher: at its committed output (`advance`), and able to walk any path of drafts below
    it (`mask`, `accepts`, `jump`). One matcher does both: a walk accepts the path's tokens and rolls back to the
    common prefix for the next path (xgrammar's rollback), so no copy of the parser state is made."""

    def __init__(self, matcher, full_vocab: int, vocab_size: int, xgr, grammars: Grammars, stops: Iterable[int]):
        self.matcher = matcher
        self.V = vocab_size
        self._text, self._first = grammars.texts, grammars.first  # [V] bytes, [V] int16 (jump-forward's reading)
        self._is_stop = torch.zeros(vocab_size, dtype=torch.bool)  # [V]
        self._is_stop[[t for t in stops if 0 <= t < vocab_size]] = True
        self._bits = xgr.allocate_token_bitmask(1, full_vocab)  # [1, ceil(full_vocab / 32)] int32
        self._at: list[int] = []  # the walk: tokens accepted beyond the committed output
        self._masks: dict[tuple[int, ...], Tensor] = {}  # path -> [V] bool, this step's
        self._all = torch.ones(vocab_size, dtype=torch.bool)
        # the grammar's cost to this request, read by benchmarks: masks computed, their seconds, and the seconds of
        # every call (masks, walks, jump-forward, advances; setup included)
        self.masks_filled, self.mask_seconds, self.seconds, self._timing = 0, 0.0, 0.0, False

    @_timed
    def advance(self, tokens: Sequence[int]) -> int:
        """The request emitted these tokens: the committed state moves past them. Returns how many to keep: all of
        them, or those before the first the grammar refuses — which happens only after a dead end (a state no
        token of the vocabulary continues, see `stuck`), where the slot's mask allowed every token."""
        self._walk(())
        self._masks.clear()
        for n, t in enumerate(tokens):
            if self.matcher.is_terminated():
                break
            if not self.matcher.accept_token(int(t)):
                return n
        return len(tokens)

    @property
    @_timed
    def stuck(self) -> bool:
        """The committed state is a dead end: the output is incomplete and no token of the vocabulary continues it
        (a tokenizer without some character the grammar needs next). The request ends there, "length"."""
        return not self.matcher.is_terminated() and not bool(self._fill(()).any())

    def _walk(self, path: Sequence[int]) -> int:
        """Move the matcher to the longest prefix of `path` the grammar accepts; returns its length."""
        at, c = self._at, 0
        while c < len(at) and c < len(path) and at[c] == path[c]:
            c += 1
        if len(at) > c:
            self.matcher.rollback(len(at) - c)
            del at[c:]
        for t in path[c:]:
            if self.matcher.is_terminated() or not 0 <= t < self.V or not self.matcher.accept_token(int(t)):
                break
            at.append(int(t))
        return len(at)

    @_timed
    def accepts(self, path: Sequence[int]) -> int:
        """How many tokens of `path` (from the committed state) the grammar accepts in a row."""
        return self._walk(list(path))

    @_timed
    def mask(self, path: Sequence[int] = ()) -> Tensor:  # [V] bool, CPU
        """The tokens the grammar allows after `path` (see the module docstring for dead and finished paths; a dead
        end, where the grammar allows nothing, allows every token: what is drawn there is cut by `advance`)."""
        key = tuple(int(t) for t in path)
        hit = self._masks.get(key)
        if hit is not None:
            return hit if hit.any() else self._all
        live = self._walk(key)
        if live == len(key):
            m = self._fill(key)  # (cached there)
            return m if m.any() else self._all
        m = self._masks[key] = self.mask(key[:live])  # a dead path: its longest live prefix's mask
        return m

    def _fill(self, key: tuple[int, ...]) -> Tensor:  # [V] bool: the grammar's own mask after a live path
        hit = self._masks.get(key)
        if hit is not None:
            return hit
        self._walk(key)
        if self.matcher.is_terminated():
            m = self._all
        else:
            t0 = time.perf_counter()
            self.matcher.fill_next_token_bitmask(self._bits, 0)
            packed = self._bits[0].numpy().view(np.uint8)  # bit i of word w is token 32 w + i (little-endian bytes)
            m = torch.from_numpy(np.unpackbits(packed, bitorder="little")[: self.V].view(np.bool_))
            self.masks_filled, self.mask_seconds = self.masks_filled + 1, self.mask_seconds + time.perf_counter() - t0
        self._masks[key] = m
        return m

    @_timed
    def jump(self, path: Sequence[int], limit: int) -> list[int]:
        """Up to `limit` (and at most JUMP_CAP) tokens the grammar forces after `path` (jump-forward), walked one
        token at a time (`_forced`), so a grammar that forces an endless text costs `limit` steps, not all memory.
        They are proposals like any other, verified against p; the walk's masks are this step's masks of the slots
        they fill, which the drafts' q and the target's p read next (cached, not computed twice)."""
        key = tuple(int(t) for t in path)
        if limit <= 0 or self._walk(key) < len(key):
            return []
        out: list[int] = []
        while len(out) < min(limit, JUMP_CAP):
            t = self._forced(key + tuple(out))
            if t is None:
                break
            out.append(t)
        return out

    def _forced(self, key: tuple[int, ...]) -> int | None:
        """The next token of the text the grammar forces after a live path, or None: nothing forced (a choice next,
        the output may end here, a dead end).

        Read from the path's mask alone. Every token it allows is a prefix of the forced text F or extends F, and
        every token that is a prefix of F is allowed. Where one allowed token extends all the others, it is
        proposed: F reaches its end, or ends inside it with no other continuation the vocabulary spells. Otherwise
        F is the common prefix of the allowed tokens no other extends, and the longest allowed token within F is
        proposed (the next token of F's greedy tokenization) unless it ends exactly at F's end: a longer token may
        spell F and what follows, so xgrammar's greedy tokenization omits that last token too."""
        if self._walk(key) < len(key) or self.matcher.is_terminated():
            return None
        ids = torch.nonzero(self._fill(key)).flatten()
        if len(ids) == 0 or bool(self._is_stop[ids].any()):
            return None  # a dead end, or the output may end here
        first = self._first[ids]
        if bool((first < 0).any()) or bool((first != first[0]).any()) or len(ids) > _JUMP_SCAN:
            return None  # no common first byte (or a token without text): nothing forced; or too many to read
        words = sorted((self._text[t], t) for t in ids.tolist())
        top = [(w, t) for i, (w, t) in enumerate(words) if i + 1 == len(words) or not words[i + 1][0].startswith(w)]
        if len(top) == 1:
            return top[0][1]  # every allowed token is a prefix of this one
        a, b = top[0][0], top[-1][0]  # (sorted: the first and last have the least in common)
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        forced = a[:n]
        within = [(len(w), t) for w, t in words if len(w) < len(forced) and forced.startswith(w)]
        return max(within)[1] if within else None
