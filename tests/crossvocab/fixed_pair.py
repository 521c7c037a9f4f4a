"""The tiny cross-tokenizer pair (tests/helpers/cross_tok.py), built the same in every process.

`cross_tok.agreeing_draft` draws the noise of each shared draft id's rows while iterating the set
`shared_id_pairs()`, whose order follows the hashes of bytes keys (`PYTHONHASHSEED`): the agreeing draft's weights,
and so every sampled output of a test, would change from process to process. `pair()` builds it with the pairs
iterated in sorted order, so a seeded test's outcome is fixed.
"""

from __future__ import annotations

from functools import lru_cache

import pytest

from ..helpers import cross_tok


@lru_cache(maxsize=4)
def pair(seed: int = 0, agree: bool = True):
    """cross_tok.cross_pair(seed, agree), independent of the hash seed (shared by the tests; never modify it)."""
    pairs = cross_tok.shared_id_pairs
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cross_tok, "shared_id_pairs", lambda: sorted(pairs()))
        return cross_tok.cross_pair(seed, agree)
