"""random=auto (the default): a request that carries a seed is Gumbel-coupled, one without draws from its stream.

- a seeded request gives the same tokens (plain decoding's under the coupling) under gamma 1, 3, 6 and auto,
  alone and in a batch beside unseeded and seeded requests that joined at other times (other output positions),
  for a draft model's chains, prompt lookup and a tree: exact equality over several seeds;
- an unseeded request draws exactly what random=stream draws (the same global RNG state: the same tokens),
  alone and beside seeded rows;
- the output distribution of a batch mixing seeded and unseeded rows is the target's: the chi-square test of
  tests/engine/test_distribution.py (first L = 3 tokens, N = 12 000 samples, level 1e-4), whose power the same
  test shows on a broken engine (q handed to verification not the one drafts came from) at the same N and the same
  mix (slow tier; measured p ~ 2e-11), and on the broken engine of tests/engine/test_distribution.py at the same N
  (default tier).
"""

from __future__ import annotations

import dataclasses
from dataclasses import replace

import numpy as np
import pytest
import torch

from verispec.drafting import Draft, DraftModelProposer
from verispec.drafting.batch import BatchView
from verispec.engine.config import SpecConfig
from verispec.engine.generator import SpeculativeGenerator
from verispec.sampling import SamplingParams
from verispec.sampling.randomness import RANDOMNESS

from ..helpers import sequences as dist
from ..helpers.tiny import V
from .test_distribution import QBeforeTemperature

PROMPT = [3, 7, 7, 12, 3, 7, 5, 9, 3, 7]  # repeats itself: prompt lookup drafts
OTHERS = [[5, 9, 3], [12, 12, 4, 8, 3], [7], [9, 3, 7, 7], [4, 4, 4, 4], [3, 12]]
T1 = SamplingParams(temperature=1.0)
NEW = 16
SEEDS = (0, 1, 2, 3, 4, 5)
GAMMAS = [1, 3, 6, "auto"]

DRAFTERS = {  # gamma (the tree's shape sets its draft; gamma only switches it on), random -> generator
    "draft-chain": lambda t, d, g, random="auto": SpeculativeGenerator(
        t, d, config=SpecConfig(draft="model", stop_below=None, gamma=g, random=random)
    ),
    "ngram": lambda t, d, g, random="auto": SpeculativeGenerator(
        t, config=SpecConfig(draft="ngram", gamma=g, random=random)
    ),
    "tree-iid": lambda t, d, g, random="auto": SpeculativeGenerator(
        t, d, config=SpecConfig(draft="model", gamma=g, tree="2-1", verify="iid", random=random)
    ),
}


def _drive(sess) -> dict:
    done = {}
    while not sess.idle:
        for event in sess.step():
            if event.completion is not None:
                done[event.key] = event.completion
    return done


def _in_a_busy_batch(gen: SpeculativeGenerator, seed: int) -> list[int]:
    """The seeded request joins a running batch of unseeded and seeded requests two steps in, more join after it
    (every row at another output position, the batch changing under it); its tokens."""
    sess = gen.session()
    first = [replace(T1, seed=900 + i) if i % 2 else T1 for i in range(3)]  # seeded and unseeded, unrelated seeds
    for prompt, params in zip(OTHERS[:3], first):
        sess.add(prompt, params, max_new_tokens=NEW + 4, ignore_eos=True)
    sess.step()
    sess.step()
    key = sess.add(PROMPT, replace(T1, seed=seed), max_new_tokens=NEW, ignore_eos=True)
    sess.step()
    for i, prompt in enumerate(OTHERS[3:]):
        sess.add(prompt, replace(T1, seed=950 + i) if i % 2 == 0 else T1, max_new_tokens=NEW // 2, ignore_eos=True)
    return _drive(sess)[key].token_ids


@pytest.fixture(scope="module")
def coupled_plain(tiny_target):
    """Plain decoding under the coupling (random=gumbel): what every seeded request must give."""
    gen = SpeculativeGenerator(tiny_target, config=SpecConfig(draft="none", random="gumbel"))
    return {
        s: gen.generate([PROMPT], replace(T1, seed=s), max_new_tokens=NEW, ignore_eos=True)[0].token_ids for s in SEEDS
    }


# gamma 3 and auto for every drafter in the default tier (each against plain decoding's coupled output); gamma 1 and
# 6 in the slow tier (~2 s each on 2 cores)
@pytest.mark.parametrize("drafter", list(DRAFTERS))
@pytest.mark.parametrize("gamma", [g if g in (3, "auto") else pytest.param(g, marks=pytest.mark.slow) for g in GAMMAS])
def test_a_seeded_request_repeats_under_every_gamma_alone_and_under_load(
    drafter, gamma, tiny_target, tiny_noisy, coupled_plain
):
    gen = DRAFTERS[drafter](tiny_target, tiny_noisy, gamma)
    assert gen.config.random == "auto" and gen.core.randomness.name == "auto"
    for s in SEEDS:
        alone = gen.generate([PROMPT], replace(T1, seed=s), max_new_tokens=NEW, ignore_eos=True)[0]
        assert alone.token_ids == coupled_plain[s], (drafter, gamma, s)
        assert _in_a_busy_batch(gen, s) == coupled_plain[s], (drafter, gamma, s)
    assert gen.stats.drafted > 0  # speculation happened
    if not (drafter == "ngram" and gamma == "auto"):  # (gamma auto stops prompt lookup here: its drafts miss at T = 1)
        assert gen.stats.accepted > 0  # and drafts were kept


@pytest.mark.parametrize("rule", ["iid", "deterministic"])
def test_a_draft_models_tree_is_coupled_too(rule, tiny_target, tiny_noisy):
    """A seeded request's tree children are the top of q / E under the target's noise (not drawn apart from it,
    which the target's race winner would match with probability sum_x p(x) q(x) only): a tree keeps about as many
    drafts as on the stream (measured, 256 requests of 48 tokens: tau 3.66 coupled, 3.56 on the stream; children
    drawn apart from the noise: 1.08)."""
    reqs = [(PROMPT if i % 2 else OTHERS[1], replace(T1, seed=i)) for i in range(16)]
    tau = {}
    for random in ("auto", "stream"):
        config = SpecConfig(draft="model", tree="2-2-1", verify=rule, random=random)
        gen = SpeculativeGenerator(tiny_target, tiny_noisy, config=config)
        gen.generate([p for p, _ in reqs], [sp for _, sp in reqs], max_new_tokens=24, ignore_eos=True)
        tau[random] = gen.stats.tau
    assert tau["auto"] > 0.85 * tau["stream"] and tau["auto"] > 2.5, tau


def _mixed(gen: SpeculativeGenerator, rng_seed: int = 7) -> list[list[int]]:
    """Seeded and unseeded rows in one batch, the unseeded rows' seeds drawn from the global RNG at rng_seed."""
    torch.manual_seed(rng_seed)
    prompts = [PROMPT, *OTHERS[:5]]
    params = [replace(T1, seed=40 + b) if b % 2 == 0 else T1 for b in range(len(prompts))]
    return [o.token_ids for o in gen.generate(prompts, params, max_new_tokens=NEW, ignore_eos=True)]


@pytest.mark.parametrize("drafter", list(DRAFTERS))
def test_unseeded_requests_draw_what_the_stream_draws(drafter, tiny_target, tiny_noisy):
    """Beside seeded rows (coupled) the unseeded ones give random=stream's tokens exactly, and alone too; the seeded
    rows give the coupling's."""
    build = DRAFTERS[drafter]
    stream_gen = build(tiny_target, tiny_noisy, 3, "stream")
    auto = _mixed(build(tiny_target, tiny_noisy, 3))
    stream, gumbel = _mixed(stream_gen), _mixed(build(tiny_target, tiny_noisy, 3, "gumbel"))
    assert [auto[b] for b in (1, 3, 5)] == [stream[b] for b in (1, 3, 5)]  # unseeded: the stream's
    assert [auto[b] for b in (0, 2, 4)] == [gumbel[b] for b in (0, 2, 4)]  # seeded: the coupling's
    assert [auto[b] for b in (0, 2, 4)] != [stream[b] for b in (0, 2, 4)]  # ... which is not the stream's
    for rng in (3, 4):  # alone, a batch of unseeded rows only: stream's work and draws
        torch.manual_seed(rng)
        a = build(tiny_target, tiny_noisy, 3).generate([PROMPT, OTHERS[1]], T1, max_new_tokens=NEW, ignore_eos=True)
        torch.manual_seed(rng)
        b = stream_gen.generate([PROMPT, OTHERS[1]], T1, max_new_tokens=NEW, ignore_eos=True)
        assert [o.token_ids for o in a] == [o.token_ids for o in b]


def test_seeded_greedy_requests_are_not_coupled_and_unchanged(tiny_target, tiny_noisy):
    """A greedy row is the argmax either way: auto leaves it to the stream (no coupling work)."""
    greedy = SamplingParams(temperature=0.0, seed=5)
    auto = SpeculativeGenerator(tiny_target, tiny_noisy, config=SpecConfig(draft="model", gamma=3))
    stream = SpeculativeGenerator(tiny_target, tiny_noisy, config=SpecConfig(draft="model", gamma=3, random="stream"))
    a = auto.generate([PROMPT, OTHERS[0]], greedy, max_new_tokens=NEW, ignore_eos=True)
    b = stream.generate([PROMPT, OTHERS[0]], greedy, max_new_tokens=NEW, ignore_eos=True)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    sess = auto.session()
    sess.add(PROMPT, greedy, max_new_tokens=2)
    sess.add(PROMPT, replace(T1, seed=5), max_new_tokens=2)
    sess.add(PROMPT, T1, max_new_tokens=2)
    sess.schedule()
    assert sess._view().keyed == [False, True, False]


def test_a_verification_override_keeps_the_configs_randomness(tiny_target, tiny_noisy):
    """certify's injected bugs and the lossy study replace the verification functions; the randomness stays the
    config's (an override changes no other setting): a caller that wants p for every row says random=stream."""
    from verispec.engine.verify import Verification
    from verispec.sampling import verify_chain

    for random in ("auto", "stream", "gumbel"):
        config = SpecConfig(draft="model", gamma=3, random=random)
        gen = SpeculativeGenerator(
            tiny_target, tiny_noisy, config=config, verification=Verification(chain=verify_chain)
        )
        assert gen.core.randomness.name == random


# --- the randomness on its own ---------------------------------------------------------------------------------


def _view(keyed, gen_seed: int = 0) -> BatchView:
    B = len(keyed)
    return BatchView(
        seqs=[[3, 4]] * B,
        params=[T1] * B,
        generators=[torch.Generator().manual_seed(gen_seed + b) for b in range(B)],
        vocab_size=V,
        seeds=[70 + b for b in range(B)],
        positions=[5 + 2 * b for b in range(B)],
        randomness=RANDOMNESS["auto"],
        keyed=keyed,
    )


def test_per_request_targets_and_draws_act_per_row():
    """Keyed rows get the coupling's targets and draws, the others p itself and the stream's draws; with no keyed
    row, p is returned as it is (no coupling work) and the draws are the stream's, uniform for uniform."""
    auto, stream, gumbel = RANDOMNESS["auto"], RANDOMNESS["stream"], RANDOMNESS["gumbel"]
    g = torch.Generator().manual_seed(1)
    p = torch.rand((3, 4, V), generator=g).softmax(-1)  # [B, T, V]
    q = torch.rand((3, V), generator=g).softmax(-1)
    chain = Draft.chain_of(torch.zeros((3, 3), dtype=torch.int64), None, [3, 3, 3])
    none = _view([False, False, False])
    assert auto.targets(p, none, chain) is p
    assert torch.equal(auto.draw(q, none, 1, [True] * 3), stream.draw(q, _view([False] * 3), 1, [True] * 3))
    mixed = _view([True, False, True])
    out = auto.targets(p, mixed, chain)
    every = gumbel.targets(p, mixed, chain)  # every row coupled
    assert torch.equal(out[1], p[1]) and torch.equal(out[[0, 2]], every[[0, 2]])
    drawn = auto.draw(q, mixed, 2, [True, True, False])
    assert drawn[0] == gumbel.draw(q, mixed, 2, [True, True, False])[0]
    assert drawn[1] == stream.draw(q, _view([False] * 3), 2, [False, True, False])[1]  # row 1's stream, untouched


# --- the distribution -------------------------------------------------------------------------------------------


def _mixed_samples(gen: SpeculativeGenerator, params: SamplingParams, n: int = dist.N) -> np.ndarray:
    """n samples of dist.PROMPT in one batch, even rows seeded (coupled), odd rows unseeded (the stream)."""
    torch.manual_seed(20_000)
    rows = [replace(params, seed=10_000 + i) if i % 2 == 0 else replace(params, seed=None) for i in range(n)]
    outs = gen.generate([dist.PROMPT] * n, rows, max_new_tokens=dist.L, ignore_eos=True)
    seqs = np.array([o.token_ids for o in outs])
    assert seqs.shape == (n, dist.L)
    return seqs


@pytest.mark.statistical
def test_a_mixed_batch_keeps_the_targets_distribution(tiny_target, tiny_draft):
    params = dist.SETTINGS["top_k_top_p"]
    gen = SpeculativeGenerator(tiny_target, tiny_draft, config=SpecConfig(draft="model", gamma=2))
    assert gen.config.random == "auto"
    result = dist.gof(_mixed_samples(gen, params), dist.exact_sequence_probs(tiny_target.model, dist.PROMPT, params))
    assert not result.rejects(dist.LEVEL), result
    assert 0 < gen.last_stats.accepted < gen.last_stats.drafted  # speculation, with rejections


class FlatQ(QBeforeTemperature):
    """Broken on purpose: drafts are sampled from q, but verification is handed (q + uniform) / 2."""

    def propose(self, view, caps):
        draft = self.inner.propose(view, caps)
        if draft.probs is None:
            return draft
        return dataclasses.replace(draft, probs=0.5 * draft.probs + 0.5 / draft.probs.shape[-1])


@pytest.mark.slow
@pytest.mark.statistical
def test_the_broken_engine_fails_in_a_mixed_batch(tiny_target, tiny_draft):
    """Power at the same N, setting and mix: a q handed to verification that is not the one drafts were sampled
    from breaks the unseeded half (the classic rule reads q; the coupled half is plain decoding whatever q says).
    Measured on these seeds: p ~ 2e-11 (the stream alone, every row broken: p ~ 5e-97). Slow tier (~13 s on 2
    cores); the same test's power at the same N is shown in the default tier by
    tests/engine/test_distribution.py::test_broken_engine_fails."""
    params = dist.SETTINGS["top_k_top_p"]
    flat = FlatQ(DraftModelProposer(tiny_draft.model, V))
    gen = SpeculativeGenerator(tiny_target, flat, config=SpecConfig(draft="custom", gamma=2))
    result = dist.gof(_mixed_samples(gen, params), dist.exact_sequence_probs(tiny_target.model, dist.PROMPT, params))
    assert result.rejects(dist.LEVEL), result
