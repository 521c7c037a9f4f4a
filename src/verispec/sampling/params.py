"""Sampling parameters: one frozen, validated description of the distribution to sample from; the same
`SamplingParams` builds the target's p and the draft's q (`probs_from_logits`), which keeps decoding lossless."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from numbers import Integral, Real

from .constraint import Constraint

__all__ = [
    "MAX_BAD_WORDS",
    "MAX_BAD_WORD_TOKENS",
    "MAX_REPETITION_PENALTY",
    "MAX_TEMPERATURE",
    "MIN_REPETITION_PENALTY",
    "MIN_TEMPERATURE",
    "ParamError",
    "SamplingParams",
    "bad_words_from_text",
    "check_seed",
]

MAX_BAD_WORDS = 256  # token sequences per request (vLLM allows 128 words; a string gives up to two sequences)
MAX_BAD_WORD_TOKENS = 1024  # tokens over all of a request's bad words (vLLM's limit)
MAX_LOGIT_BIAS = 100.0  # |bias| bound (OpenAI's)
# A temperature t > 0 divides the logits, shifted so their largest is 0 (`probs_from_logits`: nothing overflows, for
# any t); t itself is a float32 scalar there, so it must be a normal float32: below MIN_TEMPERATURE it is subnormal
# or 0 (0 / 0 = NaN at the largest logit), above MAX_TEMPERATURE inf (-inf / inf = NaN). 0 is greedy.
MIN_TEMPERATURE = 1.1754943508222875e-38  # float32's smallest normal number
MAX_TEMPERATURE = 3.4028234663852886e38  # float32's largest finite number
# repetition_penalty r divides (or multiplies) seen tokens' logits: within [1/100, 100] it cannot overflow either
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 1e-2, 1e2


def check_seed(seed, field: str = "seed") -> int | None:
    """A request seed: None, or an integer in [0, 2**63) (ParamError naming `field` otherwise)."""
    if seed is None:
        return None
    if isinstance(seed, bool) or not isinstance(seed, Integral) or not 0 <= seed < 2**63:
        raise ParamError(field, f"must be None or an integer in [0, 2**63), got {seed!r}")
    return int(seed)


class ParamError(ValueError):
    """A sampling parameter out of range (a ValueError); front ends name the field in their own words.

    Attributes:
        field: The SamplingParams field at fault.
        message: What is wrong, without the field's name: "must be >= 0 (0 = greedy), got -1.0".
    """

    def __init__(self, field: str, message: str):
        super().__init__(f"SamplingParams.{field} {message}")
        self.field, self.message = field, message


def _real(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, Real):
        raise ParamError(name, f"must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ParamError(name, f"must be finite, got {value!r}")
    return value + 0.0  # -0.0 -> 0.0


def _in_range(name: str, value: object, lo: float, hi: float, interval: str, open_low: bool = False) -> float:
    v = _real(name, value)
    if not (lo < v if open_low else lo <= v) or v > hi:
        raise ParamError(name, f"must be in {interval}, got {v}")
    return v


def _temperature(value: object) -> float:
    t = _real("temperature", value)
    if t < 0:
        raise ParamError("temperature", f"must be >= 0 (0 = greedy), got {t}")
    if t != 0 and not MIN_TEMPERATURE <= t <= MAX_TEMPERATURE:
        raise ParamError(
            "temperature",
            f"must be 0 (greedy) or a normal float32 number in [{MIN_TEMPERATURE:.4g}, {MAX_TEMPERATURE:.4g}] "
            f"(beyond it the temperature is subnormal or inf in float32 and the probabilities NaN), got {t!r}",
        )
    return t


def _token_id(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, Integral) or value < 0:
        raise ParamError(name, f"must hold token ids (integers >= 0), got {value!r}")
    return int(value)


def _logit_bias(value: object) -> tuple[tuple[int, float], ...]:
    if value is None:
        return ()
    if isinstance(value, Mapping):
        value = value.items()
    elif isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise ParamError("logit_bias", f"must map token ids to biases ({{id: bias}}), got {type(value).__name__}")
    out: dict[int, float] = {}
    for item in value:
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            raise ParamError("logit_bias", f"must map token ids to biases, got the entry {item!r}")
        tok, bias = _token_id("logit_bias", item[0]), _real("logit_bias", item[1])
        if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
            raise ParamError("logit_bias", f"biases must lie in [-100, 100], got {bias} for token {tok}")
        out[tok] = bias
    return tuple(sorted(out.items()))


def _allowed(value: object) -> tuple[int, ...] | None:
    if value is None:
        return None
    if isinstance(value, (str, bytes)) or not isinstance(value, (Sequence, set, frozenset)):
        raise ParamError("allowed_token_ids", f"must be None or a list of token ids, got {type(value).__name__}")
    ids = tuple(sorted({_token_id("allowed_token_ids", t) for t in value}))
    if not ids:
        raise ParamError("allowed_token_ids", "must not be empty (None allows every token)")
    return ids


def _bad_words(value: object) -> tuple[tuple[int, ...], ...]:
    if value is None:
        return ()
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise ParamError("bad_words", f"must be a list of token-id sequences, got {type(value).__name__}")
    words: dict[tuple[int, ...], None] = {}  # deduplicated, in order
    for w in value:
        if isinstance(w, bytes):
            raise ParamError("bad_words", f"entries must be token-id sequences, got bytes {w!r}")
        if isinstance(w, str):
            raise ParamError(
                "bad_words",
                f"holds token-id sequences: tokenize {w!r} first (`bad_words_from_text`, as the server does)",
            )
        if not isinstance(w, Sequence) or not len(w):
            raise ParamError("bad_words", f"entries must be non-empty token-id sequences, got {w!r}")
        words[tuple(_token_id("bad_words", t) for t in w)] = None
    if len(words) > MAX_BAD_WORDS or sum(map(len, words)) > MAX_BAD_WORD_TOKENS:
        raise ParamError("bad_words", f"holds at most {MAX_BAD_WORDS} sequences of {MAX_BAD_WORD_TOKENS} tokens in all")
    return tuple(words)


def bad_words_from_text(words: Sequence[str], encode: Callable[[str], list[int]]) -> list[list[int]]:
    """Bad-word strings as token-id sequences for `SamplingParams.bad_words`, tokenized as vLLM does.

    Each word (leading spaces stripped) is tokenized on its own, and also with a leading space when that gives a
    different first token and as many tokens, so the word is banned at the start of the text and in its middle.

    Args:
        words: The words never to produce.
        encode: Tokenizes a string without special tokens, e.g.
            `lambda s: tokenizer.encode(s, add_special_tokens=False)`.

    Returns:
        One or two token-id sequences per word (ParamError for a word that tokenizes to nothing).
    """
    if isinstance(words, str) or not isinstance(words, Sequence):
        raise ParamError("bad_words", f"must be a list of strings, got {type(words).__name__}")
    out: list[list[int]] = []
    for w in words:
        if not isinstance(w, str):
            raise ParamError("bad_words", f"must be a list of strings, got the entry {w!r}")
        plain = [int(t) for t in encode(w.lstrip())]
        if not plain:
            raise ParamError("bad_words", f"entry {w!r} gives no tokens")
        out.append(plain)
        spaced = [int(t) for t in encode(" " + w.lstrip())]
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    return out


@dataclass(frozen=True)
class SamplingParams:
    """How to turn a model's logits into the distribution that is sampled from. Frozen and validated.

    The processing order is `probs_from_logits`'. The defaults give plain sampling at temperature 1. Token ids are
    checked against the vocabulary where it is known (`check_vocab`).

    Attributes:
        temperature: > 0 divides the logits (shifted so their largest is 0: nothing overflows); 0 means greedy (a
            one-hot distribution on the argmax, ties broken towards the lowest token id). It must be a normal
            float32 number, [1.18e-38, 3.40e38]: a subnormal or larger value is refused (NaN probabilities).
        top_k: Keep the k most probable tokens; 0 disables.
        top_p: Keep the smallest set of most probable tokens whose mass reaches top_p; in (0, 1], 1 disables.
        min_p: Drop tokens whose probability is below min_p times the largest one; in [0, 1], 0 disables.
        repetition_penalty: In [0.01, 100]; tokens seen in the prompt or the output get logit / r if positive, logit * r
            otherwise (the HF transformers / vLLM convention); 1 disables.
        presence_penalty: In [-2, 2]; subtracted once from the logit of every token already in the output.
        frequency_penalty: In [-2, 2]; subtracted once per occurrence in the output.
        seed: Per-request seed for the request's own random stream; None draws from the global one.
        logit_bias: {token id: bias in [-100, 100]} added to the logits (OpenAI's semantics); stored as sorted
            (id, bias) pairs; None or {} disables.
        allowed_token_ids: Only these tokens may be sampled (the others get logit -inf); stored sorted; None
            allows every token.
        bad_words: Token-id sequences never to produce (strings: tokenize them with `bad_words_from_text`). A
            one-token word is banned everywhere; for a longer one its last token is banned wherever the context
            before the position (prompt + output, and inside a speculative step the drafts on the path to it)
            ends with the word's other tokens (vLLM's rule). Where those context bans would leave no token at
            all, that position keeps only the static bans (allowed_token_ids, one-token words).
        constraint: A structured-output `Constraint` (JSON schema, JSON object, regex, choice, grammar) the output
            must match, or None. Its mask is applied before everything above (vLLM's order): a token the grammar
            forbids at a position has probability 0 there, for p and q alike.

    Raises:
        ParamError: A field is out of range or of the wrong type.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    logit_bias: Mapping[int, float] | tuple[tuple[int, float], ...] | None = ()
    allowed_token_ids: Sequence[int] | None = None
    bad_words: Sequence[Sequence[int]] = ()
    constraint: Constraint | None = None

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen: normalise the validated values in place, once
        set_(self, "temperature", _temperature(self.temperature))
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, Integral) or self.top_k < 0:
            raise ParamError("top_k", f"must be an integer >= 0 (0 = disabled), got {self.top_k!r}")
        set_(self, "top_k", int(self.top_k))
        set_(self, "top_p", _in_range("top_p", self.top_p, 0.0, 1.0, "(0, 1]", open_low=True))
        set_(self, "min_p", _in_range("min_p", self.min_p, 0.0, 1.0, "[0, 1]"))
        lo, hi = MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY
        rep = _in_range("repetition_penalty", self.repetition_penalty, lo, hi, f"[{lo:g}, {hi:g}] (1 = disabled)")
        set_(self, "repetition_penalty", rep)
        for name in ("presence_penalty", "frequency_penalty"):
            set_(self, name, _in_range(name, getattr(self, name), -2.0, 2.0, "[-2, 2]"))
        set_(self, "seed", check_seed(self.seed))
        set_(self, "logit_bias", _logit_bias(self.logit_bias))
        set_(self, "allowed_token_ids", _allowed(self.allowed_token_ids))
        set_(self, "bad_words", _bad_words(self.bad_words))
        if self.constraint is not None and not isinstance(self.constraint, Constraint):
            raise ParamError(
                "constraint", f"must be None or a Constraint (verispec.sampling.Constraint), got {self.constraint!r}"
            )
        if self.constraint is not None and (self.allowed_token_ids is not None or self.bad_words):
            raise ParamError(
                "constraint",
                "cannot be combined with allowed_token_ids or bad_words: together they may leave no token at a "
                "position the grammar needs one (put the restriction into the grammar instead)",
            )
        if self.allowed_token_ids is not None and set(self.allowed_token_ids) <= set(self.banned_token_ids):
            raise ParamError("bad_words", "ban every token of allowed_token_ids: nothing could be sampled")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def uses_truncation(self) -> bool:
        """True when top_k or top_p needs a sort of the vocabulary."""
        return self.top_k > 0 or self.top_p < 1.0

    @property
    def banned_token_ids(self) -> tuple[int, ...]:
        """The one-token bad words: banned at every position."""
        return tuple(sorted({w[0] for w in self.bad_words if len(w) == 1}))

    @cached_property
    def _static_bans(self) -> tuple[frozenset[int] | None, frozenset[int]]:
        allowed = None if self.allowed_token_ids is None else frozenset(self.allowed_token_ids)
        return allowed, frozenset(self.banned_token_ids)

    def blocks(self, token: int) -> bool:
        """True when `token` is never sampled, at any position: outside allowed_token_ids, or a one-token bad word
        (a chosen draft of it is rejected for sure, so drafters may stop before it)."""
        allowed, banned = self._static_bans
        return token in banned or (allowed is not None and token not in allowed)

    @property
    def bad_word_depth(self) -> int:
        """How many context tokens the multi-token bad words look back at (their longest length - 1; 0: none)."""
        return max((len(w) - 1 for w in self.bad_words), default=0)

    @property
    def uses_token_options(self) -> bool:
        """True when logit_bias, allowed_token_ids or bad_words is set."""
        return bool(self.logit_bias) or self.allowed_token_ids is not None or bool(self.bad_words)

    @property
    def is_identity(self) -> bool:
        """True when the processed distribution is softmax(logits) itself: temperature 1 and nothing else."""
        return (
            self.temperature == 1.0
            and not self.uses_truncation
            and self.min_p == 0.0
            and not self.uses_penalties
            and not self.uses_token_options
            and self.constraint is None
        )

    def check_vocab(self, vocab_size: int) -> None:
        """Check the token ids of logit_bias, allowed_token_ids and bad_words against a vocabulary.

        Args:
            vocab_size: The vocabulary's size V: valid ids are in [0, V).

        Raises:
            ParamError: A token id is outside [0, V), or the bad words ban every token.
        """
        for name, ids in (
            ("logit_bias", [t for t, _ in self.logit_bias]),
            ("allowed_token_ids", self.allowed_token_ids or ()),
            ("bad_words", [t for w in self.bad_words for t in w]),
        ):
            bad = sorted({t for t in ids if t >= vocab_size})
            if bad:
                raise ParamError(name, f"has token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
        if self.allowed_token_ids is None and len(self.banned_token_ids) >= vocab_size:
            raise ParamError("bad_words", "ban every token of the vocabulary: nothing could be sampled")
