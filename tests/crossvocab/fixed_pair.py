"""The tiny cross-tokenizer pair (tests/helpers/cross_tok.py), built once per process and shared by the tests
(its weights do not depend on the hash seed: `agreeing_draft` iterates the shared pairs sorted)."""

from __future__ import annotations

from functools import lru_cache

from ..helpers import cross_tok


@lru_cache(maxsize=4)
def pair(seed: int = 0, agree: bool = True):
    """cross_tok.cross_pair(seed, agree), cached (shared by the tests; never modify it)."""
    return cross_tok.cross_pair(seed, agree)
