"""A request's stop strings, matched at a cost that does not grow with how many there are (`StopMatcher`).

A row looks for its stop strings in each step's new text and holds back a tail that may be the start of one. Looping
over the strings costs O(number of strings) per row per step (10,000 strings: 10x a server's run time); here an
Aho-Corasick automaton (pyahocorasick, in C) finds every occurrence in one pass over the text, and a trie of the
strings less their last character answers the hold-back in O(longest string) prefix lookups. Both are built once
per list of stop strings (10,000 strings of ~8 characters: ~15 ms, under 10 MB), and the last few lists' matchers are
kept: the rows of one call, which share its stop strings, share one matcher.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import ahocorasick

__all__ = ["StopMatcher", "matcher_of"]


class StopMatcher:
    """The stop strings of one request (non-empty strings, as `check_limits` admits; duplicates allowed).

    `first(text, start)` is `min((text.find(s, start), s) for s in stops if s in text[start:])`: the earliest stop
    string that starts at or after `start` (two starting at the same index: one is a prefix of the other, and the
    shorter, the smaller string, wins). `held(text)` is the length of the longest suffix of `text` that is a proper
    prefix of a stop string (0: none), what a stream holds back. Indices count code points, as `str` does."""

    def __init__(self, stops: Sequence[str]):
        if not stops or any(not isinstance(s, str) or s == "" for s in stops):
            raise ValueError("StopMatcher needs one or more non-empty stop strings")
        self.stops = tuple(stops)
        self.longest = max(map(len, self.stops))
        self._automaton = ahocorasick.Automaton(ahocorasick.STORE_LENGTH)  # values: each string's length
        self._starts = ahocorasick.Automaton(ahocorasick.STORE_LENGTH)  # a trie: its prefixes are the proper ones
        for s in set(self.stops):
            self._automaton.add_word(s)
            if len(s) > 1:
                self._starts.add_word(s[:-1])
        self._automaton.make_automaton()

    def __reduce__(self):  # rebuilt from its strings when pickled (a row may cross a process boundary)
        return StopMatcher, (self.stops,)

    def window(self, old: int) -> int:
        """Where a stop string that ends past text[:old] may start: `old - (longest - 1)`, at least 0."""
        return max(old - self.longest + 1, 0)

    def found(self, text: str, start: int = 0) -> bool:
        """Whether a stop string occurs in text[start:] (one pass over text[start:], stopping at the first)."""
        return next(self._automaton.iter(text, start), None) is not None

    def first(self, text: str, start: int = 0) -> tuple[int, str] | None:
        """The earliest stop string in text[start:]: (its index in `text`, the string), or None. The scan stops
        once no later occurrence can start before the best one (a longest string's length past it)."""
        best: tuple[int, int] | None = None  # (start, length)
        for end, n in self._automaton.iter(text, start):  # in order of their ends
            if best is None or (end - n + 1, n) < best:
                best = (end - n + 1, n)
            if end - self.longest + 1 >= best[0]:  # every later occurrence starts at or after best's start
                break
        return None if best is None else (best[0], text[best[0] : best[0] + best[1]])

    def held(self, text: str) -> int:
        """The length of the longest suffix of `text` that is a proper prefix of a stop string (0: none):
        at most longest - 1 prefix lookups in the trie, longest first."""
        for m in range(min(self.longest - 1, len(text)), 0, -1):
            if self._starts.match(text[len(text) - m :]):
                return m
        return 0


@lru_cache(maxsize=8)
def _matcher(stops: tuple[str, ...]) -> StopMatcher:
    return StopMatcher(stops)


def matcher_of(stops: Sequence[str]) -> StopMatcher | None:
    """The matcher of a request's stop strings (shared with the last few requests that had the same ones: a
    matcher is never changed); None for none (no automaton, nothing to do per step)."""
    return _matcher(tuple(stops)) if stops else None
