"""Grammars on a tokenizer: `Grammars` compiles a `Constraint` for one tokenizer (xgrammar, cached), and a
`GrammarState` follows one request's output and gives the grammar's mask after any path of drafts below it.

Why xgrammar: measured on this project's CPU with SmolLM2's tokenizer (V = 49,152) over a 58-token JSON document
under a 5-field schema, xgrammar 0.2.9 fills a token mask in 10.6 us on average (llguidance 1.9.1: 50 us), rolls
back in ~8 us, and gives jump-forward tokens (`find_jump_forward_tokens`); `docs/bench/grammar-engines.md` has the comparison.

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
from collections.abc import Iterable, Sequence

import numpy as np
import torch
from torch import Tensor

from ..sampling.constraint import Constraint, ConstraintError

__all__ = ["GrammarState", "Grammars"]

# bit i of word w of xgrammar's bitmask is token 32 w + i: on a little-endian host byte k of word w holds tokens
# 32 w + 8 k ... + 7, lowest bit first, which np.unpackbits(bitorder="little") reads in one C pass
if sys.byteorder != "little":  # pragma: no cover - every platform torch ships wheels for is little-endian
    raise ImportError("verispec.structured unpacks xgrammar's bitmasks byte by byte: it needs a little-endian host")
_CACHE_BYTES = 256 << 20  # xgrammar's compiled-grammar cache (the same schema every epoch compiles once)


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
        if _TEMPERATURE.search(c.source):  # xgrammar reads per-rule temperatures; the sampling here would not
            raise ConstraintError(
                "a grammar rule's temperature attribute is not supported: set the request's temperature"
            )
        return comp.compile_grammar(c.source)

    def state(self, c: Constraint, stop_ids: Iterable[int] = ()) -> GrammarState:
        """A matcher at the start of an output; stop_ids: the request's own stop tokens beside EOS (ended like it)."""
        xgr = _xgrammar()
        stops = sorted(set(self.stop_ids) | {int(t) for t in stop_ids})
        matcher = xgr.GrammarMatcher(self.compile(c), override_stop_tokens=stops or None)
        return GrammarState(matcher, self.info.vocab_size, self.vocab_size, xgr)


_TEMPERATURE = re.compile(r"\[\s*temperature\s*=")  # an EBNF rule attribute: rule[temperature=0.1] ::= ...
_LOG_PREFIX = re.compile(r"^\s*(\[[\d:]+\]\s*)?(\S+\.(cc|h|cpp):\d+:\s*)?")  # xgrammar's "[08:02:40] /x.cc:12: "


def _reason(e: Exception) -> str:
    """The first line of a grammar engine's error, without its log prefix (time stamp, source file and line)."""
    lines = [line for line in str(e).strip().splitlines() if line.strip()]
    return _LOG_PREFIX.sub("", lines[0]).strip() if lines else type(e).__name__


# JSON-schema keywords a grammar cannot enforce, or that xgrammar 0.2.9 compiles without enforcing (it logs and drops
# them): a schema with one is refused, so that "stop" keeps meaning "valid under the schema"
_UNENFORCED = (
    "not", "if", "then", "else", "dependentRequired", "dependentSchemas", "dependencies", "contains", "minContains",
    "maxContains", "propertyNames", "patternProperties", "unevaluatedProperties", "unevaluatedItems", "multipleOf",
)  # fmt: skip
_SCHEMA_MAPS = ("properties", "$defs", "definitions")  # keyword -> {name: schema}
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")  # keyword -> [schema, ...]
_SCHEMAS = ("items", "additionalProperties", "additionalItems")  # keyword -> schema (items: or a list of them)


def _check_enforceable(schema, where: str = "#") -> None:
    """ConstraintError naming the first keyword of `schema` (at its JSON pointer) the grammar would not enforce.
    Only keyword positions are read: a property named "if" is a name, not the keyword."""
    if not isinstance(schema, dict):
        return
    for key in _UNENFORCED:
        if key in schema:
            raise ConstraintError(f"the JSON schema's {key!r} (at {where}) cannot be enforced by the grammar engine")
    if schema.get("uniqueItems") is True:
        raise ConstraintError(f"the JSON schema's 'uniqueItems' (at {where}) cannot be enforced by the grammar engine")
    if "pattern" in schema and ("minLength" in schema or "maxLength" in schema):
        raise ConstraintError(
            f"the JSON schema's 'pattern' beside 'minLength' / 'maxLength' (at {where}) cannot be enforced by the "
            "grammar engine: put the length into the pattern (e.g. ^[a-z]{1,8}$)"
        )
    for key in _SCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            for name, sub in schema[key].items():
                _check_enforceable(sub, f"{where}/{key}/{name}")
    for key in (*_SCHEMA_LISTS, *_SCHEMAS):
        value = schema.get(key)
        for i, sub in enumerate(value) if isinstance(value, list) else [(None, value)]:
            _check_enforceable(sub, f"{where}/{key}" + ("" if i is None else f"/{i}"))


def _ebnf_string(s: str) -> str:
    """A literal as an EBNF string (json.dumps's escapes are EBNF's)."""
    return json.dumps(s, ensure_ascii=False)


class GrammarState:
    """One request's grammar matcher: at its committed output (`advance`), and able to walk any path of drafts below
    it (`mask`, `accepts`, `jump`). One matcher does both: a walk accepts the path's tokens and rolls back to the
    common prefix for the next path (xgrammar's rollback), so no copy of the parser state is made."""

    def __init__(self, matcher, full_vocab: int, vocab_size: int, xgr):
        self.matcher = matcher
        self.V = vocab_size
        self._bits = xgr.allocate_token_bitmask(1, full_vocab)  # [1, ceil(full_vocab / 32)] int32
        self._at: list[int] = []  # the walk: tokens accepted beyond the committed output
        self._masks: dict[tuple[int, ...], Tensor] = {}  # path -> [V] bool, this step's
        self._all = torch.ones(vocab_size, dtype=torch.bool)
        self.masks_filled = 0  # grammar masks computed (for the mask-cost share in benchmarks)

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

    def accepts(self, path: Sequence[int]) -> int:
        """How many tokens of `path` (from the committed state) the grammar accepts in a row."""
        return self._walk(list(path))

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
            self.matcher.fill_next_token_bitmask(self._bits, 0)
            self.masks_filled += 1
            packed = self._bits[0].numpy().view(np.uint8)  # bit i of word w is token 32 w + i (little-endian bytes)
            m = torch.from_numpy(np.unpackbits(packed, bitorder="little")[: self.V].view(np.bool_))
        self._masks[key] = m
        return m

    def jump(self, path: Sequence[int], limit: int) -> list[int]:
        """Up to `limit` tokens the grammar forces after `path` (jump-forward: xgrammar's greedy tokenization of the
        forced text, which the target may tokenize otherwise; they are proposals like any other, verified against p)."""
        if limit <= 0 or self._walk(list(path)) < len(path) or self.matcher.is_terminated():
            return []
        out = []
        for t in self.matcher.find_jump_forward_tokens()[:limit]:
            if not 0 <= t < self.V:
                break
            out.append(int(t))
        return out
