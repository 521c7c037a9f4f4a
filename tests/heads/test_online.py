"""draft=online (`verispec.heads.online`): an EAGLE-3 head trained from what the engine verifies, exact across head
versions. An 8-layer tiny target (EAGLE-3's default aux layers 2, 4, 5).

The law: the first 3 tokens of N = 12,000 seeded samples against the target's exact sequence distribution, chi-square
at level 1e-4 (tests/helpers/sequences.py), with the head replaced by a materially different one after every step.
Power: the same run verifying the head's drafts against the q of the head published after they were drafted (the
race the issue names) fails it.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from verispec.engine import SpecConfig, SpeculativeGenerator
from verispec.engine.observe import StepObserver
from verispec.heads.learn import init_head
from verispec.sampling import SamplingParams

from ..helpers.sequences import LEVEL, PROMPT, SETTINGS, N, exact_sequence_probs, gof
from ..helpers.tiny import V, loaded

AUX = (2, 4, 5)
CHUNK = 400  # rows per generate call: N / CHUNK calls of ~3 steps each, a new head after every step


@pytest.fixture(scope="module")
def tiny8():
    return loaded(0, layers=8)


def random_head(target, k: int):
    """Head k: the target-initialised EAGLE-3 head with its weights moved by noise of seed k (heads differ)."""
    head = init_head(target.model, torch.arange(V), AUX)
    g = torch.Generator().manual_seed(k)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn(p.shape, generator=g) * (0.3 if p.dim() == 2 else 0.0))
    return head


class NewHeadEveryStep(StepObserver):
    """After every step, the learner publishes a different head (the version count goes up by one)."""

    def __init__(self, target):
        self.gen, self.target, self.k = None, target, 0  # gen: set once the generator is built

    def after_commit(self, view, out):
        self.k += 1
        self.gen.learner.replace_head(random_head(self.target, self.k))


class Forced:
    """A randomness that 'draws' given tokens (teacher forcing): the q a head gives along a chain it did not draw."""

    lookahead = 0

    def __init__(self, ids):
        self.ids = ids

    def draw(self, q, view, offset, active):
        return self.ids[:, offset].clamp(min=0)


class NewestHeadsQ(NewHeadEveryStep):
    """Broken on purpose: a new head is published between drafting and verification, and the head's drafts are
    verified against the new head's q along the same tokens (not the q they were drawn from)."""

    def after_draft(self, view, draft):
        rows = [b for b, s in enumerate(view.sources or []) if s == 1 and draft.num_nodes[b]]
        if not rows or draft.probs is None:
            return None
        self.after_commit(view, None)  # the newer head
        online = self.gen.core.proposer.parts[1]
        fresh = online._drafter(self.gen.learner.head)
        fresh.start(view, online._capacity)
        forced = dataclasses.replace(view, randomness=Forced(draft.token_ids))
        q_new = fresh._chain(forced, list(draft.num_nodes)).probs
        probs = draft.probs.clone()
        for b in rows:
            n = draft.num_nodes[b]
            probs[b, :n] = q_new[b, :n]
        return dataclasses.replace(draft, probs=probs)


def online_gen(target, observer_cls):
    obs = observer_cls(target)
    config = SpecConfig(draft="online", gamma=2, random="stream")
    obs.gen = gen = SpeculativeGenerator(target, config=config, observers=[obs])
    gen.learner.replace_head(random_head(target, 0))
    return gen


def sample(gen, params):
    import numpy as np

    out = []
    for start in range(0, N, CHUNK):
        rows = [dataclasses.replace(params, seed=10_000 + i) for i in range(start, min(N, start + CHUNK))]
        out += [o.token_ids for o in gen.generate([PROMPT] * len(rows), rows, max_new_tokens=3, ignore_eos=True)]
    return np.array(out)


@pytest.mark.slow  # ~11 s each on 2 cores
@pytest.mark.statistical
def test_the_law_holds_with_the_head_replaced_every_step(tiny8):
    params = SETTINGS["top_k_top_p"]
    gen = online_gen(tiny8, NewHeadEveryStep)
    result = gof(sample(gen, params), exact_sequence_probs(tiny8.model, PROMPT, params))
    assert not result.rejects(LEVEL), result
    switch = gen.core.proposer
    assert gen.learner.version > 50 and switch.kept[1] > 1000  # many versions, and the head's drafts were kept


@pytest.mark.slow
@pytest.mark.statistical
def test_verifying_with_a_newer_heads_q_fails(tiny8):
    params = SETTINGS["top_k_top_p"]
    gen = online_gen(tiny8, NewestHeadsQ)
    result = gof(sample(gen, params), exact_sequence_probs(tiny8.model, PROMPT, params))
    assert result.rejects(LEVEL), result


def test_greedy_equals_plain_while_the_head_trains(tiny8):
    """Budget 0.9: a training step after every decoding step, a version every 8; the tokens are plain greedy's."""
    on = SpeculativeGenerator(tiny8, config=SpecConfig(draft="online", gamma=3, online_budget=0.9))
    plain = SpeculativeGenerator(tiny8, config=SpecConfig(draft="none"))
    prompts = [[1, 5, 6, 7, 8], [1, 9, 9, 3], [1, 4, 20, 21, 4, 20]]
    greedy = SamplingParams(temperature=0.0)
    for it in range(3):
        on.generate(prompts * 8, SamplingParams(temperature=1.0, seed=it), max_new_tokens=24, ignore_eos=True)
        a = on.generate(prompts, greedy, max_new_tokens=24, ignore_eos=True)
        b = plain.generate(prompts, greedy, max_new_tokens=24, ignore_eos=True)
        assert [x.token_ids for x in a] == [x.token_ids for x in b]
    assert on.learner.version >= 3 and on.learner.steps >= 12
    assert on.core.proposer.kept[1] > 0  # the trained head's drafts were kept


@torch.no_grad()
def test_the_buffer_holds_the_targets_features_and_distributions(tiny8):
    """Every recorded position against a fresh forward of the target over the recorded sequence: the aux hidden
    states, a prompt position's next token as its hard label, an emitted position's top-K (ids and probabilities).
    Rows join a running batch (max_batch 2 of 5 requests, `add`), leave it at different lengths (`select`), and one
    prompt is longer than a prefill chunk (staged while the others decode)."""
    from verispec.model.runner import layer_inputs

    gen = SpeculativeGenerator(tiny8, config=SpecConfig(draft="online", gamma=2, random="stream"))
    gen.learner.replace_head(random_head(tiny8, 0))
    sess = gen.session(max_batch=2)
    sess.prefill_chunk = 4
    prompts = [[1, 5, 6, 7, 8], [1, 9, 9, 3], [1, 4, 20, 21, 4, 20, 5, 6, 7, 8, 9], [1, 2, 3], [1, 7, 7, 7, 7]]
    for k, p in enumerate(prompts):
        sess.add(p, SamplingParams(temperature=1.0, seed=k), max_new_tokens=6 + 3 * k, ignore_eos=True)
    while not sess.idle:
        sess.step()
    entries = gen.learner.buffer.sequences()
    assert sorted(len(e) for e in entries) == sorted(len(p) + 6 + 3 * k - 1 for k, p in enumerate(prompts))
    model, K = tiny8.model, gen.learner.settings.top_k
    for e in entries:
        aux, top_ids, top_p = e.tensors()
        ids = torch.tensor([e.ids])
        with layer_inputs(model.get_decoder(), AUX) as grabbed:
            logits = model(ids).logits[0]  # [n, V]
        want = torch.cat([grabbed[i][0] for i in AUX], -1)  # [n, 3H]
        torch.testing.assert_close(aux.float(), want, atol=2e-2, rtol=2e-2)  # bfloat16 in the buffer
        hard = e.prompt - 1  # positions before it carry the next prompt token
        assert top_ids[:hard, 0].tolist() == e.ids[1 : hard + 1] and bool((top_p[:hard, 0] == 1).all())
        p = logits[hard:].softmax(-1)  # [n - hard, V]
        best = p.topk(min(K, p.shape[-1]))
        assert top_ids[hard:, 0].tolist() == best.indices[:, 0].tolist()
        torch.testing.assert_close(top_p[hard:].float(), best.values, atol=2e-3, rtol=1e-2)
