"""logit_bias + allowed_token_ids + bad_words (one-token and multi-token) in the engine: plain and speculative
decoding (draft-model chains, draft-model trees, prompt lookup) sample the first 3 tokens from the target's exact
sequence distribution under these options, computed here independently of verispec's processors (plain Python
masks and biases on the target's own logits).

Hypothesis tests: chi-square goodness of fit (bins merged to expected counts >= 5), significance level
LEVEL = 1e-4 per test, seeds fixed. A sample with a sequence of probability 0 (a bad word produced, a token outside
allowed_token_ids) rejects outright.
Power: the deliberately broken engine whose target p builds the bad-word context without the drafts (every
verification slot sees the context before the step, as if the drafts before it were not there) emits the banned
pair 22 -> 23 after an accepted draft 22: measured on these seeds, 1174 of its 3000 samples (39%) are sequences
of probability 0, so the same test at N = 3000 rejects it with probability > 1 - 0.62 ** 3000 (power ~ 1; each
sample has a probability-0 sequence with probability ~ 0.39, so even N = 50 would give power > 0.9999). The default
tier runs the broken engine on N_POWER = 300 of those seeds (power > 1 - 0.62 ** 300 > 1 - 1e-60), and the law
tests of plain decoding, draft-model chains and i.i.d. trees at N; the slow tier runs the other drafters and rules
(SLOW) at the same N (a larger N would add nothing to this power).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from verispec.drafting import Draft, Proposer
from verispec.engine import verify
from verispec.engine.config import SpecConfig
from verispec.engine.generator import SpeculativeGenerator
from verispec.engine.session import GenerationSession

from ..helpers.sequences import gof, sample_sequences
from ..helpers.tiny import V

pytestmark = pytest.mark.statistical

LEVEL = 1e-4
N = 3000
N_POWER = 300  # the broken engine's sample size in the default tier (its power: the docstring above)
L = 3
PROMPT = [3, 7, 7, 12, 3, 7]
ALLOWED = (3, 7, 9, 10, 12, 15, 22, 23)
BAD = ((15,), (22, 23), (7, 7), (10, 9, 22))  # (7, 7): the prompt ends with 7, so the first token is never 7
BIAS = {22: 1.5, 23: 2.0, 10: -1.0, 9: 0.5}
TEMPERATURE = 0.8


def params():
    from verispec.sampling import SamplingParams

    return SamplingParams(
        temperature=TEMPERATURE, logit_bias=BIAS, allowed_token_ids=ALLOWED, bad_words=[list(w) for w in BAD]
    )


def reference_probs(logits: torch.Tensor, context: list[int]) -> np.ndarray:
    """The processed target distribution at one position, from first principles (no verispec processors)."""
    x = logits.double().clone()
    for t in range(V):
        if t not in ALLOWED:
            x[t] = float("-inf")
    for w in BAD:
        if len(w) == 1 or tuple(context[-(len(w) - 1) :]) == w[:-1]:
            x[w[-1]] = float("-inf")
    for t, b in BIAS.items():
        x[t] += b
    return (x / TEMPERATURE).softmax(-1).numpy()


@torch.no_grad()
def exact_sequence_probs(model) -> np.ndarray:
    """P(x1, x2, x3 | PROMPT) over all V^3 sequences (flattened), zero outside the allowed tokens."""
    joint = np.zeros(V**L)
    prefixes: list[tuple[tuple[int, ...], float]] = [((), 1.0)]
    for _ in range(L):
        ids = torch.tensor([PROMPT + list(p) for p, _ in prefixes])
        logits = model(ids).logits[:, -1]
        nxt = []
        for (prefix, mass), row in zip(prefixes, logits):
            probs = reference_probs(row, PROMPT + list(prefix))
            nxt += [(prefix + (t,), mass * float(probs[t])) for t in ALLOWED if probs[t] > 0]
        prefixes = nxt
    for (a, b, c), mass in prefixes:
        joint[(a * V + b) * V + c] = mass
    return joint / joint.sum()


@pytest.fixture(scope="module")
def exact(tiny_target):
    return exact_sequence_probs(tiny_target.model)


def sample(gen: SpeculativeGenerator, n: int) -> np.ndarray:
    return sample_sequences(gen, params(), n)  # [n, L]: the same prompt, per-sample seeds


def _generator(kind: str, target, noisy) -> SpeculativeGenerator:
    if kind == "plain":
        return SpeculativeGenerator(target, config=SpecConfig(draft="none"))
    if kind == "ngram":
        return SpeculativeGenerator(target, config=SpecConfig(draft="ngram", gamma=3))
    if kind == "self-int8":
        return SpeculativeGenerator(target, config=SpecConfig(draft="self", quant="int8", stop_below=None, gamma=3))
    if kind.startswith("tree-"):
        return SpeculativeGenerator(
            target, noisy, config=SpecConfig(draft="model", tree="2-2-1", verify=kind.removeprefix("tree-"))
        )
    if kind == "dynamic-tree":
        return SpeculativeGenerator(target, noisy, config=SpecConfig(draft="model", tree="dynamic-3-2-5"))
    if kind == "block":
        return SpeculativeGenerator(
            target, noisy, config=SpecConfig(draft="model", stop_below=None, gamma=3, verify="block")
        )
    return SpeculativeGenerator(target, noisy, config=SpecConfig(draft="model", stop_below=None, gamma=3))  # "chain"


FAST = ("plain", "chain", "tree-iid")
SLOW = ("ngram", "self-int8", "tree-without_replacement", "dynamic-tree", "block")  # ngram: also greedy, below


@pytest.mark.parametrize(
    "kind,n",
    [(k, N) for k in FAST] + [pytest.param(k, N, marks=pytest.mark.slow) for k in SLOW],
)
def test_generator_with_token_options_samples_the_exact_distribution(kind, n, tiny_target, tiny_noisy, exact):
    gen = _generator(kind, tiny_target, tiny_noisy)
    result = gof(sample(gen, n), exact)
    assert not result.rejects(LEVEL), result
    if kind != "plain":
        assert gen.last_stats.accepted > 0 and gen.last_stats.accepted < gen.last_stats.drafted


def _score_without_draft_context(batch, chunk, ids, par, parents=None):
    """Broken on purpose: every verification slot's p sees the bad-word context before the step (the drafts on
    the path to it left out), while penalties still count them."""
    view = batch.view
    logits = batch.runner.forward(chunk, parents=parents)[:, : ids.shape[1] + 1]
    counts, _, _ = view.node_context(ids, par)
    recent = view.recent.unsqueeze(1).expand(-1, ids.shape[1] + 1, -1)
    return logits, view.probs(logits, counts, recent)


def test_bad_word_context_without_the_drafts_is_rejected(tiny_target, tiny_noisy, exact, monkeypatch):
    monkeypatch.setattr(verify, "score", _score_without_draft_context)
    gen = _generator("chain", tiny_target, tiny_noisy)
    result = gof(sample(gen, N_POWER), exact)
    assert result.rejects(LEVEL), result


class BannedProposer(Proposer):
    """A one-hot drafter that ignores the token options: its chains start with a token the request can never
    sample there (23 right after 22, else the bad word 15), then 31 (not allowed). p = 0 at the first draft, so
    every step rejects it and samples from p: no draft is ever accepted and the output is still the target's."""

    def propose(self, view, caps):
        k = max(caps, default=0)
        ids = torch.full((len(caps), k), -1, dtype=torch.int64)
        for b, c in enumerate(caps):
            row = [23 if view.seqs[b][-1] == 22 else 15, 31, 31][:c]
            ids[b, : len(row)] = torch.tensor(row, dtype=torch.int64)
        return Draft.chain_of(ids, None, [min(c, 3) for c in caps])


def test_impossible_one_hot_drafts_are_always_rejected(tiny_target):
    gen = SpeculativeGenerator(tiny_target, BannedProposer(), config=SpecConfig(draft="custom", gamma=3))
    outs = gen.generate(
        [PROMPT] * 40, [replace(params(), seed=i) for i in range(40)], max_new_tokens=6, ignore_eos=True
    )
    assert gen.last_stats.drafted > 0 and gen.last_stats.accepted == 0
    for o in outs:
        seq = PROMPT + o.token_ids
        assert all(t in ALLOWED and t != 15 for t in o.token_ids)
        assert all((a, b) != (22, 23) and (a, b) != (7, 7) for a, b in zip(seq[len(PROMPT) - 1 :], seq[len(PROMPT) :]))


@pytest.mark.parametrize("kind", ["chain", "tree-deterministic", "ngram"])
def test_greedy_with_token_options_equals_plain_greedy(kind, tiny_target, tiny_noisy):
    greedy = replace(params(), temperature=0.0)
    prompts = [PROMPT, [9, 22, 9, 22, 10, 9], [23, 23, 12]]
    plain = SpeculativeGenerator(tiny_target, config=SpecConfig(draft="none")).generate(
        prompts, greedy, max_new_tokens=12
    )
    spec = _generator(kind, tiny_target, tiny_noisy)
    assert [o.token_ids for o in spec.generate(prompts, greedy, max_new_tokens=12)] == [o.token_ids for o in plain]
    for o, prompt in zip(plain, prompts):
        seq = prompt + o.token_ids
        assert all(t in ALLOWED and t != 15 for t in o.token_ids)
        for w in BAD[1:]:
            k = len(w)
            assert all(tuple(seq[i : i + k]) != w for i in range(len(prompt) - k + 1, len(seq) - k + 1))


def test_out_of_vocabulary_token_options_are_refused_at_add(tiny_target):
    from verispec.sampling import SamplingParams

    gen = SpeculativeGenerator(tiny_target, config=SpecConfig(draft="none"))
    with pytest.raises(ValueError, match=r"SamplingParams.logit_bias .*outside the vocabulary \[0, 32\)"):
        gen.generate([PROMPT], SamplingParams(logit_bias={40: 1.0}))
    sess = gen.session()
    with pytest.raises(ValueError, match="allowed_token_ids"):
        sess.add(PROMPT, SamplingParams(allowed_token_ids=[1, 32]))
    assert sess.num_active == 0


def test_mixed_rows_joining_and_leaving_keep_their_own_options(tiny_target, tiny_draft):
    """Rows with different token options, budgets and arrival times in one continuous batch (one joins mid-run,
    one is aborted): each row's greedy output equals that row decoded alone, so the batch's SamplingMetadata
    follows every membership change in row order (a stale or shuffled one would hand a row another's bans)."""
    from verispec.sampling import SamplingParams

    rows = [
        (PROMPT, SamplingParams(temperature=0.0, bad_words=[[22, 23], [7]]), 7),
        ([3, 12, 22], SamplingParams(temperature=0.0, allowed_token_ids=[9, 10, 22, 23]), 3),
        ([9, 9, 10], SamplingParams(temperature=0.0, logit_bias={23: 8.0, 12: 5.0}), 9),
        ([12, 3], SamplingParams(temperature=0.0, bad_words=[[10, 9], [3, 12, 3]]), 6),
    ]
    gen = SpeculativeGenerator(tiny_target, tiny_draft, config=SpecConfig(draft="model", gamma=2, runner="hf"))

    def alone(prompt, p, n):
        return gen.generate([prompt], p, max_new_tokens=n, ignore_eos=True)[0].token_ids

    expected = [alone(*r) for r in rows]
    sess = GenerationSession(gen)
    keys = [
        sess.add(prompt, p, max_new_tokens=n, ignore_eos=True, index=i) for i, (prompt, p, n) in enumerate(rows[:3])
    ]
    aborted = sess.add([3, 3, 3], SamplingParams(temperature=0.0, allowed_token_ids=[3]), max_new_tokens=9, index=9)
    done = {}
    for step in range(40):
        if step == 1:
            keys.append(sess.add(rows[3][0], rows[3][1], max_new_tokens=rows[3][2], ignore_eos=True, index=3))
            sess.abort(aborted)
        for ev in sess.step():
            if ev.completion is not None:
                done[ev.completion.index] = ev.completion.token_ids
        if not sess.num_active:
            break
    assert 9 not in done and {i: done[i] for i in range(4)} == dict(enumerate(expected))
    assert len({tuple(e) for e in expected}) == 4  # the rows do differ
