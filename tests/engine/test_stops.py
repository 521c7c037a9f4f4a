"""StopMatcher against the loops over every stop string it replaces (verispec.engine.stops)."""

from __future__ import annotations

import pickle
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from verispec.engine.rows import Row
from verispec.engine.stops import StopMatcher, matcher_of
from verispec.sampling import SamplingParams

# small alphabets make overlaps, repeats and stops inside stops common; one has multi-code-point characters
ALPHABETS = ["ab", "abc", "aé🙂", "x\u0301y", "\u4e2d\u6587a"]


@st.composite
def cases(draw):
    alphabet = draw(st.sampled_from(ALPHABETS))
    word = st.text(alphabet=alphabet, min_size=1, max_size=5)
    stops = draw(st.lists(word, min_size=1, max_size=6))
    if draw(st.booleans()):  # a stop string inside another one
        s = draw(st.sampled_from(stops))
        i = draw(st.integers(0, len(s) - 1))
        stops.append(s[i : draw(st.integers(i + 1, len(s)))])
    text = draw(st.text(alphabet=alphabet, max_size=24))
    return stops, text, draw(st.integers(0, len(text) + 2))


def naive_first(text: str, stops, start: int = 0):
    """Row.event's loop before StopMatcher, on text[start:]."""
    return min(((start + text[start:].find(s), s) for s in stops if s in text[start:]), default=None)


def naive_held(text: str, stops) -> int:
    """The longest suffix of text that is a proper prefix of one of the stops."""
    return max((m for s in stops for m in range(1, min(len(s) - 1, len(text)) + 1) if text.endswith(s[:m])), default=0)


@settings(max_examples=600, deadline=None)
@given(cases())
def test_first_found_and_held_match_the_loops(case):
    stops, text, start = case
    m = StopMatcher(stops)
    assert m.first(text) == naive_first(text, stops)
    assert m.first(text, start) == naive_first(text, stops, start)
    assert m.found(text, start) == any(s in text[start:] for s in stops)
    assert m.held(text) == naive_held(text, stops)


@settings(max_examples=200, deadline=None)
@given(cases(), st.integers(0, 30))
def test_window_is_the_old_straddle_span(case, old):
    """Row.event looks at text[window(old):]: what it looked at before, text[max(old - (longest - 1), 0):]."""
    stops, text, _ = case
    m = StopMatcher(stops)
    span = max(map(len, stops)) - 1
    assert m.found(text, m.window(old)) == any(s in text[max(old - span, 0) :] for s in stops)


class _Chars:
    """A tokenizer whose token i is the character pieces[i]."""

    clean_up_tokenization_spaces = False

    def __init__(self, pieces):
        self.pieces = pieces

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.pieces[i] for i in ids)


def _stream(pieces, ids, steps, stop):
    """A row fed ids in steps of the given sizes (cycled): the text streamed after each step, and its end."""
    row = Row(0, [0], SamplingParams(), torch.Generator(), [0], max_new=len(ids), stop=tuple(stop))
    tok, shown, i = _Chars(pieces), [""], 0
    while row.done is None:
        n = steps[(len(shown) - 1) % len(steps)]
        before = len(row.tokens)
        row.take(ids[i : i + n], [0.0] * n, [0.0] * n, None, set(), None)
        i += n
        shown.append(shown[-1] + row.event(tok, before).delta)
    return shown[1:], row.done


@settings(max_examples=300, deadline=None)
@given(cases(), st.lists(st.integers(1, 4), min_size=1, max_size=3))
def test_a_row_cuts_at_the_first_stop_and_holds_back_only_a_possible_start(case, steps):
    """Character tokens in random steps: the row ends in the first step whose text has a stop string, cut at the
    first one there; each step before streams its text but the longest suffix that may start a stop string."""
    stops, text, _ = case
    pieces = sorted(set(text)) or ["a"]
    ids = [pieces.index(c) for c in text] or [0]
    text = "".join(pieces[i] for i in ids)
    shown, done = _stream(pieces, ids, steps, stops)
    seen, hit = 0, None
    for n, streamed in zip(steps * len(ids), shown):
        seen = min(seen + n, len(text))
        hit = naive_first(text[:seen], stops)
        if hit is not None or seen == len(text):
            break
        assert streamed == text[: seen - naive_held(text[:seen], stops)]
    assert done.text == (text[:seen] if hit is None else text[: hit[0]]) == shown[-1]
    assert done.stop_reason == (None if hit is None else hit[1])


def test_a_row_holds_back_what_may_start_a_stop_not_more():
    """Stops "ab" and "xy" after "xa": only "a" may start one ("x" is followed by "a", not "y"). The loop over the
    strings this replaced held "a" back for "ab", then "x" for "xy" in what was left: "xa" in all."""
    shown, done = _stream(["x", "a", "z"], [0, 1, 2], [1], ["ab", "xy"])
    assert shown == ["", "x", "xaz"] and done.text == "xaz"


def test_tie_at_one_index_reports_the_shorter_string():
    m = StopMatcher(["abc", "ab", "bc"])
    assert m.first("xabcd") == (1, "ab") == naive_first("xabcd", ["abc", "ab", "bc"])
    assert m.first("xabcd", 2) == (2, "bc")
    assert m.first("xabcd", 5) is None and m.first("", 0) is None


def test_a_long_stop_starting_first_beats_a_short_one_ending_first():
    m = StopMatcher(["abcdef", "c"])
    assert m.first("abcdef") == (0, "abcdef")


def test_held_counts_code_points_and_only_proper_prefixes():
    m = StopMatcher(["é🙂x", "🙂"])
    assert m.held("aé🙂") == 2  # "é🙂" starts "é🙂x"; a whole one-character stop is never held
    assert m.held("a🙂") == 0
    assert StopMatcher(["x"]).held("x") == 0


def test_no_stop_strings_no_matcher():
    assert matcher_of(()) is None
    with pytest.raises(ValueError):
        StopMatcher([])
    with pytest.raises(ValueError):
        StopMatcher(["a", ""])


def test_ten_thousand_strings_build_and_match():
    r = random.Random(0)
    stops = ["".join(r.choice("abcdefgh ") for _ in range(r.randint(3, 12))) for _ in range(10_000)]
    text = "".join(r.choice("abcdefgh ") for _ in range(300))
    m = StopMatcher(stops)
    assert m.first(text) == naive_first(text, stops)
    assert m.held(text) == naive_held(text, stops)
    twin = pickle.loads(pickle.dumps(m))
    assert twin.first(text) == m.first(text) and twin.held(text) == m.held(text)
