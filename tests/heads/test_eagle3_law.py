"""Drafting with an EAGLE-3 head is exact: the engine's outputs follow the target's own law, for chains and trees,
every verification rule and randomness; the head bugs of `verispec.certify.mutants` do not.

The law: the tiny 4-layer target's output after PROMPT with a budget of L = 3 tokens, as (token ids without EOS,
finish reason): every outcome enumerated with its probability from full forwards of the target (transformers, no
cache) and the processed distribution (`probs_from_logits`: temperature 1, or top_k 8 + top_p 0.9), EOS ending an
output (see OUTCOMES for their numbers).

The test: N = 3000 seeded samples per configuration (one `generate` call), a chi-square goodness of fit over the
outcomes (bins merged to expected counts >= 5, one probability-0 bin for anything else) at LEVEL = 1e-3 per test,
seeds fixed (each outcome is deterministic; a false alarm would be a 1e-3 event). Power (asserted in test_power):
at N = 3000 the test detects every alternative at total variation >= 0.14 (temperature 1) / 0.12 (top_k / top_p)
with probability >= 0.99 (worst case over directions). The default tier runs three pairs (DEFAULT); the slow tier
runs every other configuration and setting at the same N, and the head's one full-power law test, the trained chain
at temperature 1 with N = 20 000 (TV >= 0.08).

The heads: a head distilled from the target (conftest.distil_eagle3: drafts accepted ~60% of the time at
temperature 1, so chains run deep and are rejected at every depth) and the flat random head (q near uniform over
its 24 draft ids, 8 target ids outside them). Broken on purpose, the same test fails: `head-no-d2t` (q handed to
verification at draft ids 0..23 instead of their target ids) and `head-full-vocab` (q handed from a zero-filled
target row: mass on the 8 ids never drafted), with the trained head at temperature 1 in the default tier (p-values
~1e-40 and ~1e-6 at N = 3000). The slow tier runs `head-no-d2t` with the flat head and with top_k / top_p at the
same N (measured p ~1e-36 to 1e-298); `head-full-vocab` is inert under top_k 8 (the zero-filled ids are cut: q is
unchanged) and smaller with the flat head (p ~0.01 at N = 3000), so that one runs at N = 20 000.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from verispec.certify.mutants import HEAD_BUGS, mutant
from verispec.certify.stats import detectable_tv
from verispec.engine.config import SpecConfig
from verispec.engine.generator import SpeculativeGenerator
from verispec.heads import load_head
from verispec.sampling import SamplingParams

from ..helpers.enum_law import exact_law
from ..helpers.tiny import EOS
from .conftest import one_thread

pytestmark = pytest.mark.statistical

LEVEL = 1e-3
N = 3000
N_SLOW = 20_000
L = 3
PROMPT = [1, 3, 7]
T1 = SamplingParams(temperature=1.0)
TOPKP = SamplingParams(temperature=1.0, top_k=8, top_p=0.9)
SETTINGS = {"t1": T1, "topkp": TOPKP}
OUTCOMES = {"t1": 30_784, "topkp": 357}

CONFIGS = {  # name -> (head fixture, spec)
    "chain": ("trained_head_dir", "draft=model,gamma=3,stop_below=none,random=stream"),
    "chain-stop": ("trained_head_dir", "draft=model,gamma=3,random=stream"),  # the head's own stop_below 0.3
    "chain-flat": ("flat_head_dir", "draft=model,gamma=3,stop_below=none,random=stream"),
    "block": ("trained_head_dir", "draft=model,gamma=3,stop_below=none,verify=block,random=stream"),
    "tree-iid": ("trained_head_dir", "draft=model,tree=2-2,verify=iid,random=stream"),
    "tree-without-replacement": ("trained_head_dir", "draft=model,tree=2-2,verify=without_replacement,random=stream"),
    "tree-deterministic": ("trained_head_dir", "draft=model,tree=2-2,verify=deterministic,random=stream"),
    "tree-dynamic": ("trained_head_dir", "draft=model,tree=dynamic-3-2-4,random=stream"),
    "position": ("trained_head_dir", "draft=model,gamma=3,stop_below=none,random=position"),
    "auto-seeded": ("trained_head_dir", "draft=model,gamma=3,stop_below=none"),  # random=auto: Gumbel-coupled
}
DEFAULT = [("chain", "t1"), ("tree-iid", "t1"), ("tree-deterministic", "topkp")]
BUGGED = "draft=model,gamma=3,stop_below=none,random=stream"


@pytest.fixture(scope="module")
def laws(target):
    with one_thread():
        return {name: exact_law(target.model, PROMPT, params, L, EOS) for name, params in SETTINGS.items()}


def sample(gen, params: SamplingParams, n: int, seed0: int = 1000):
    rows = [replace(params, seed=seed0 + i) for i in range(n)]
    return gen.generate([PROMPT] * n, rows, max_new_tokens=L)


def generator(target, folder, spec: str) -> SpeculativeGenerator:
    return SpeculativeGenerator(target, load_head(folder), config=SpecConfig.parse(spec))


def test_power(laws):
    assert {k: len(v.outcomes) for k, v in laws.items()} == OUTCOMES
    assert detectable_tv(laws["t1"].probs, N, LEVEL, 0.99) < 0.14
    assert detectable_tv(laws["topkp"].probs, N, LEVEL, 0.99) < 0.12
    assert detectable_tv(laws["t1"].probs, N_SLOW, LEVEL, 0.99) < 0.08


@pytest.mark.parametrize(
    "name, setting, n",
    [pytest.param(c, s, N, id=f"{c}-{s}") for c, s in DEFAULT]
    + [
        pytest.param(c, s, N, id=f"{c}-{s}", marks=pytest.mark.slow)
        for c in CONFIGS
        for s in SETTINGS
        if (c, s) not in DEFAULT
    ]
    + [pytest.param("chain", "t1", N_SLOW, id="chain-t1-large", marks=pytest.mark.slow)],  # the full-power one
)
def test_head_law(name, setting, n, target, laws, request):
    fixture, spec = CONFIGS[name]
    gen = generator(target, request.getfixturevalue(fixture), spec)
    result = laws[setting].gof(sample(gen, SETTINGS[setting], n))
    assert not result.rejects(LEVEL), (spec, result)
    stats = gen.last_stats
    assert stats.drafted > 0 and stats.accepted > 0, spec  # speculation happened ...
    if "random=stream" in spec or "random=position" in spec:  # (coupled drafts are kept when they are the token)
        assert stats.accepted < stats.drafted, spec  # ... with rejections
    if fixture == "trained_head_dir" and setting == "t1" and "tree" not in name:
        assert stats.acceptance_rate > 0.4, (spec, stats.acceptance_rate)  # chains run deep


@pytest.mark.parametrize(
    "bug, fixture, setting, n",
    [pytest.param(b, "trained_head_dir", "t1", N, id=f"{b}-trained-t1") for b in HEAD_BUGS]
    + [
        pytest.param("head-no-d2t", f, s, N, id=f"head-no-d2t-{f.split('_')[0]}-{s}", marks=pytest.mark.slow)
        for f, s in (("trained_head_dir", "topkp"), ("flat_head_dir", "t1"), ("flat_head_dir", "topkp"))
    ]
    + [
        pytest.param(
            "head-full-vocab", "flat_head_dir", "t1", N_SLOW, id="head-full-vocab-flat-t1-large", marks=pytest.mark.slow
        )
    ],  # (top_k 8 cuts the zero-filled ids: the bug is inert under topkp)
)
def test_head_bugs_fail(bug, fixture, setting, n, target, laws, request):
    cfg = SpecConfig.parse(BUGGED)
    gen = mutant(bug, cfg).generator(target, load_head(request.getfixturevalue(fixture)), cfg)
    result = laws[setting].gof(sample(gen, SETTINGS[setting], n))
    assert result.rejects(LEVEL), (bug, result)
    assert 0 < gen.last_stats.accepted < gen.last_stats.drafted
