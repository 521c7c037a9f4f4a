"""Cross-vocabulary speculation is exact: the engine's outputs, drafted by a model with another tokenizer (token-level
intersection, `cross_vocab=tli`, chains and trees; string-level exact match, `cross_vocab=slem`), follow the target's
own law, for every verification rule and randomness.

The law: the target's output after PROMPT (SAMPLES[3] in the target's tokens) with a budget of L = 3 tokens, as
(token ids without EOS, finish reason): every outcome enumerated with its probability from full forwards of the target
model (no cache) and the processed distribution (`probs_from_logits`: temperature 1, or top_k 8 + top_p 0.9), EOS
(`<|im_end|>`) ending an output. 40 495 outcomes at temperature 1, 215 with top_k / top_p.

The test: N = 3000 seeded samples per configuration (one `generate` call), a chi-square goodness of fit over the
outcomes (bins merged to expected counts >= 5, one probability-0 bin for anything else) at significance level
LEVEL = 1e-3 per test, seeds fixed (each test's outcome is deterministic; a false alarm would be a 1e-3 event).
Power (asserted in test_power): at N = 3000 the test detects every alternative at total variation >= 0.13
(temperature 1) / 0.11 (top_k / top_p) from the exact law with probability >= 0.99 (`detectable_tv`, worst case
over directions). The slow tier runs every pair of configuration and setting the default tier does not (DEFAULT) at
the same N, and each drafter kind's one full-power law test, TLI's and SLEM's chain at temperature 1 with N = 20 000
(TV >= 0.07).

The pair: tests/helpers/cross_tok.py's agreeing draft (the target's layers, its rows remapped to the draft's ids with
noise; fixed_pair.py caches it). Its byte-fallback duplicates ('<0x61>' beside 'a',
'<0x20>' beside '▁', '<0x2E>' beside '.') carry real mass, and PROMPT's law puts mass on 'a', ' ' and '.'.

Broken on purpose, the same test fails: a TLI drafter that draws each draft from q summed over the duplicates (the
right law) but hands verification q built from one of them alone (merge="last", transformers' translator's last
write). Its look-alike, the same wrapper handing the summed q, passes.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from verispec.certify.stats import detectable_tv
from verispec.crossvocab import BridgedRunner, VocabMap
from verispec.drafting import DraftModelProposer, Proposer
from verispec.drafting.base import Draft
from verispec.engine.config import SpecConfig
from verispec.engine.drafters import build_proposer
from verispec.engine.generator import SpeculativeGenerator
from verispec.sampling import SamplingParams
from verispec.sampling.tree import chain_parents

from ..helpers.cross_tok import DRAFT_VOCAB, SAMPLES, TARGET_EOS, TARGET_VOCAB
from ..helpers.enum_law import exact_law
from .fixed_pair import pair

pytestmark = pytest.mark.statistical

LEVEL = 1e-3
N = 3000
N_SLOW = 20_000
L = 3
V_T, V_D = len(TARGET_VOCAB), len(DRAFT_VOCAB)
T1 = SamplingParams(temperature=1.0)
TOPKP = SamplingParams(temperature=1.0, top_k=8, top_p=0.9)
SETTINGS = {"t1": T1, "topkp": TOPKP}

TLI = "draft=model,cross_vocab=tli"
CONFIGS = {
    "chain": f"{TLI},gamma=3,stop_below=none,random=stream",
    "chain-stop": f"{TLI},gamma=3,random=stream",  # stop_below 0.3: chains of the draft's choosing
    "block": f"{TLI},gamma=3,stop_below=none,verify=block,random=stream",
    "tree-iid": f"{TLI},tree=2-2,verify=iid,random=stream",
    "tree-without-replacement": f"{TLI},tree=2-2,verify=without_replacement,random=stream",
    "tree-deterministic": f"{TLI},tree=2-2,verify=deterministic,random=stream",
    "position": f"{TLI},gamma=3,stop_below=none,random=position",
    "auto-seeded": f"{TLI},gamma=3,stop_below=none",  # random=auto, every request seeded: Gumbel-coupled
    "auto-seeded-tree": f"{TLI},tree=2-2,verify=iid",
    "slem": "draft=model,cross_vocab=slem,gamma=3,random=stream",
    "slem-auto-seeded": "draft=model,cross_vocab=slem,gamma=3",
}
DEFAULT = [  # (config, setting) in the default tier; the slow tier runs every other pair at N, and FULL at N_SLOW
    ("chain", "t1"),
    ("block", "topkp"),
    ("tree-iid", "t1"),
    ("tree-without-replacement", "t1"),
    ("tree-deterministic", "topkp"),
    ("auto-seeded", "t1"),
    ("slem", "t1"),
    ("slem", "topkp"),
]
FULL = [("chain", "t1"), ("slem", "t1")]  # one full-power law test per drafter kind (TLI, SLEM), in the slow tier


@pytest.fixture(scope="module")
def models():
    return pair(0, agree=True)


@pytest.fixture(scope="module")
def prompt(models):
    return models[0].tokenizer.encode(SAMPLES[3])


@pytest.fixture(scope="module")
def laws(models, prompt):
    return {name: exact_law(models[0].model, prompt, params, L, TARGET_EOS) for name, params in SETTINGS.items()}


def sample(gen, prompt, params: SamplingParams, n: int, seed0: int = 1000):
    rows = [replace(params, seed=seed0 + i) for i in range(n)]
    return gen.generate([prompt] * n, rows, max_new_tokens=L)


def generator(models, spec: str) -> SpeculativeGenerator:
    target, draft = models
    return SpeculativeGenerator(target, draft, config=SpecConfig.parse(spec))


def test_power(laws):
    assert len(laws["t1"].outcomes) == 40_495 and len(laws["topkp"].outcomes) == 215
    assert detectable_tv(laws["t1"].probs, N, LEVEL, 0.99) < 0.13
    assert detectable_tv(laws["topkp"].probs, N, LEVEL, 0.99) < 0.11
    assert detectable_tv(laws["t1"].probs, N_SLOW, LEVEL, 0.99) < 0.07
    # the duplicated draft strings' target tokens are likely here: a q merged wrongly shows
    dup = [TARGET_VOCAB.index(t) for t in ("a", "Ġ", ".")]
    first = {}
    for (tokens, _), p in zip(laws["t1"].outcomes, laws["t1"].probs):
        if tokens:
            first[tokens[0]] = first.get(tokens[0], 0.0) + p
    assert sum(first.get(t, 0.0) for t in dup) > 0.15


def check(gen, completions, law, spec):
    result = law.gof(completions)
    assert not result.rejects(LEVEL), (spec, result)
    stats = gen.last_stats
    assert stats.drafted > 0 and stats.accepted > 0, spec  # speculation happened ...
    if "random=stream" in spec or "random=position" in spec:  # (coupled drafts are kept when they are the token)
        assert stats.accepted < stats.drafted, spec  # ... with rejections


@pytest.mark.parametrize(
    "name, setting, n",
    [pytest.param(c, s, N, id=f"{c}-{s}") for c, s in DEFAULT]
    + [
        pytest.param(c, s, N, id=f"{c}-{s}", marks=pytest.mark.slow)
        for c in CONFIGS
        for s in SETTINGS
        if (c, s) not in DEFAULT
    ]
    + [pytest.param(c, s, N_SLOW, id=f"{c}-{s}-large", marks=pytest.mark.slow) for c, s in FULL],
)
def test_cross_vocab_law(name, setting, n, models, prompt, laws):
    spec = CONFIGS[name]
    gen = generator(models, spec)
    check(gen, sample(gen, prompt, SETTINGS[setting], n), laws[setting], spec)


def test_mixed_batch(models, prompt, laws):
    """One generate call, random=auto, three kinds of rows interleaved: seeded (Gumbel-coupled) rows of PROMPT at
    temperature 1, unseeded (stream) rows of another prompt with top_k / top_p, greedy rows of a third. Each group
    follows its own law (n = 1000 each: detectable TV at power 0.99 asserted below), greedy rows are the target's
    greedy output."""
    target, _ = models
    n = 1000
    other = target.tokenizer.encode(SAMPLES[1])
    greedy_prompt = target.tokenizer.encode(SAMPLES[0])
    other_law = exact_law(target.model, other, TOPKP, L, TARGET_EOS)
    assert detectable_tv(laws["t1"].probs, n, LEVEL, 0.99) < 0.18
    assert detectable_tv(other_law.probs, n, LEVEL, 0.99) < 0.17
    prompts, params = [], []
    for i in range(n):
        prompts += [prompt, other, greedy_prompt]
        params += [replace(T1, seed=5000 + i), TOPKP, SamplingParams(temperature=0.0)]
    gen = generator(models, CONFIGS["auto-seeded"])
    outs = gen.generate(prompts, params, max_new_tokens=L)
    seeded, unseeded, greedy = outs[0::3], outs[1::3], outs[2::3]
    for group, law in ((seeded, laws["t1"]), (unseeded, other_law)):
        result = law.gof(group)
        assert not result.rejects(LEVEL), result
    plain = SpeculativeGenerator(target, config=SpecConfig(draft="none")).generate(
        greedy_prompt, SamplingParams(temperature=0.0), max_new_tokens=L
    )
    assert {(tuple(c.token_ids), c.finish_reason) for c in greedy} == {
        (tuple(plain[0].token_ids), plain[0].finish_reason)
    }
    assert gen.last_stats.drafted > 0 and gen.last_stats.accepted > 0


# --- broken on purpose -------------------------------------------------------------------------------------------------
class RecordingRunner(BridgedRunner):
    """A BridgedRunner that keeps the draft's own logits of every forward (the drafter's q is computed from them)."""

    def __init__(self, inner, vocab: VocabMap, vocab_size: int):
        super().__init__(inner, vocab, vocab_size)
        self.seen: list[torch.Tensor] = []

    def forward(self, tokens, logits_at="all", parents=None, tree_start=None):
        own = self.draft_forward(tokens, logits_at, parents, tree_start)
        self.seen.append(own)
        return self.map.target_logits(own, self.vocab_size)


class HandsOtherQ(Proposer):
    """A TLI chain drafter whose drafts are drawn as usual, from the draft's q summed over duplicates, while the q
    handed to verification is rebuilt from the same draft logits through `handed` (merge="last": broken;
    merge="sum": the same q, a look-alike that must pass)."""

    def __init__(self, inner: DraftModelProposer, handed: VocabMap):
        bridged = inner.runner
        self.runner = inner.runner = RecordingRunner(bridged.inner, bridged.map, bridged.vocab_size)
        self.inner, self.handed = inner, handed

    def start(self, view, capacity):
        self.inner.start(view, capacity)

    def add(self, view, capacity):
        self.inner.add(view, capacity)

    def select(self, rows):
        self.inner.select(rows)

    def update(self, view, old_lengths, draft, paths):
        self.inner.update(view, old_lengths, draft, paths)

    def propose(self, view, caps) -> Draft:
        self.runner.seen.clear()
        draft = self.inner.propose(view, caps)
        if draft.probs is None:
            return draft
        B, k = draft.token_ids.shape
        q = draft.probs.clone()
        for j, own in enumerate(self.runner.seen[:k]):  # one draft forward per chain position
            ctx = view.node_context(draft.token_ids[:, :j], chain_parents(B, j, q.device)).at(j)
            q[:, j] = view.probs(self.handed.target_logits(own, V_T), *ctx)
        return replace(draft, probs=q)


def handing(models, merge: str) -> SpeculativeGenerator:
    target, draft = models
    spec = CONFIGS["chain"]
    cfg = SpecConfig.parse(spec)
    inner = build_proposer(cfg, target, draft).proposer
    handed = VocabMap.build(target.tokenizer, draft.tokenizer, V_T, V_D, merge=merge)
    custom = spec.replace("draft=model,cross_vocab=tli", "draft=custom")
    return SpeculativeGenerator(target, HandsOtherQ(inner, handed), config=SpecConfig.parse(custom))


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_last_write_q_fails(setting, models, prompt, laws):
    gen = handing(models, "last")
    result = laws[setting].gof(sample(gen, prompt, SETTINGS[setting], N))
    assert result.rejects(LEVEL), result
    assert gen.last_stats.accepted < gen.last_stats.drafted


@pytest.mark.slow
def test_summed_q_handed_by_the_wrapper_passes(models, prompt, laws):
    gen = handing(models, "sum")
    result = laws["t1"].gof(sample(gen, prompt, T1, N))
    assert not result.rejects(LEVEL), result
