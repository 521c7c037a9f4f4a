"""The engine's output distribution: the first 3 generated tokens, over many seeded samples, against the
target's exact sequence distribution (all V^3 = 32768 sequences enumerated from the target itself).

Significance level LEVEL = 1e-4 per chi-square test (bins merged to expected counts >= 5); seeds fixed.
Power: the deliberately broken engine (q reported before temperature, while drafts are sampled after it)
fails the same test at the same sample size.

The verification rules run on the stream (random=stream): every sample here is seeded, and the default, auto,
would Gumbel-couple them all (one-hot targets: tests/engine/test_auto_randomness.py tests auto itself).
"""

from __future__ import annotations

import dataclasses

import pytest

from verispec.drafting import DraftModelProposer, PromptLookupProposer, Proposer, SwitchProposer
from verispec.engine.config import SpecConfig
from verispec.engine.generator import SpeculativeGenerator
from verispec.engine.verify import Verification

from ..helpers.sequences import LEVEL, PROMPT, SETTINGS, exact_sequence_probs, gof, sample_sequences
from ..helpers.tiny import V

pytestmark = pytest.mark.statistical


class QBeforeTemperature(Proposer):
    """Broken on purpose: drafts are sampled from q at the request's temperature, but the q handed to
    verification is the draft's distribution *before* temperature (a bug seen in public engines)."""

    def __init__(self, inner: DraftModelProposer):
        self.inner = inner

    def start(self, view, capacity):
        self.inner.start(view, capacity)

    def propose(self, view, caps):
        draft = self.inner.propose(view, caps)
        if draft.probs is None:
            return draft
        t = view.params[0].temperature  # q_T = softmax(l / T)  =>  softmax(l) = normalise(q_T ** T)
        q1 = draft.probs.double() ** t
        return dataclasses.replace(draft, probs=(q1 / q1.sum(-1, keepdim=True).clamp_min(1e-300)).float())

    def update(self, view, old_lengths, draft, paths):
        self.inner.update(view, old_lengths, draft, paths)

    def select(self, rows):
        self.inner.select(rows)


CASES = (
    [("draft-model", s) for s in SETTINGS]
    + [("ngram", "temperature"), ("ngram", "penalties")]
    + [("self-int4", "top_k_top_p")]  # the target's own weights, int4-quantized, bfloat16 compute
    + [("draft-model-block", "top_k_top_p"), ("ngram-block", "penalties")]  # verify="block"
    + [("ngram+model", "top_k_top_p")]  # per row: prompt lookup where it matches, the draft model elsewhere
)
SLOW_CASES = {
    ("ngram", "temperature"),
    ("ngram", "penalties"),
    ("ngram-block", "penalties"),
    ("draft-model", "temperature"),
    ("draft-model", "top_k_top_p"),
    ("ngram+model", "top_k_top_p"),  # the default tier: its greedy test (tests/engine/test_generator.py)
}


# In the slow tier only (~10 s each on 2 cores), their mechanisms being checked in the default tier by a neighbour:
# prompt lookup (ngram-temperature, ngram-penalties): its one-hot drafts by the constrained law of prompt lookup with
# jump-forward (tests/structured/test_law.py, chi-square at N = 3000) and the kernel certificate's one-hot cases, the
# penalties' context holding the drafts by draft-model-penalties; draft-model-temperature: a draft model's chains at a
# temperature other than 1 by draft-model-penalties (0.8), this temperature (0.6) by the broken engine below;
# draft-model-top_k_top_p: the same draft, setting and N in a mixed batch whose unseeded half runs this rule
# (tests/engine/test_auto_randomness.py::test_a_mixed_batch_keeps_the_targets_distribution).
@pytest.mark.parametrize(
    "drafter,setting",
    [pytest.param(d, s, id=f"{d}-{s}", marks=[pytest.mark.slow] if (d, s) in SLOW_CASES else []) for d, s in CASES],
)
def test_engine_matches_target_sequence_distribution(drafter, setting, tiny_target, tiny_draft):
    params = SETTINGS[setting]
    drafter, block, _ = drafter.partition("-block")
    verify = "block" if block else "token"
    if drafter == "self-int4":
        gen = SpeculativeGenerator(tiny_target, config=SpecConfig(draft="self", quant="int4", gamma=2, random="stream"))
    elif drafter == "ngram+model":
        gen = SpeculativeGenerator(tiny_target, tiny_draft, config=SpecConfig(draft=drafter, gamma=2, random="stream"))
    else:
        draft, kind = (tiny_draft, "model") if drafter == "draft-model" else (None, "ngram")
        config = SpecConfig(draft=kind, gamma=2, verify=verify, random="stream")
        gen = SpeculativeGenerator(tiny_target, draft, config=config)
    seqs = sample_sequences(gen, params)
    result = gof(seqs, exact_sequence_probs(tiny_target.model, PROMPT, params))
    assert not result.rejects(LEVEL), result
    assert gen.last_stats.drafted > 0 and gen.last_stats.accepted > 0  # speculation really happened
    assert gen.last_stats.accepted < gen.last_stats.drafted  # ... and rejections too


# Slow tier (~12 s on 2 cores): plain decoding of seeded requests is the keyed Gumbel race (random=auto), whose law the
# default tier checks as a sampler (tests/sampling/test_coupling.py) and in the engine, as the seeded half of a mixed
# batch with a draft model (tests/engine/test_auto_randomness.py), and whose tokens coupled speculation reproduces
# (tests/engine/test_coupling.py); this harness's control is every passing case above.
@pytest.mark.slow
def test_plain_decoding_matches_target_sequence_distribution(tiny_target):
    params = SETTINGS["temperature"]
    result = gof(
        sample_sequences(SpeculativeGenerator(tiny_target, config=SpecConfig(draft="none")), params),
        exact_sequence_probs(tiny_target.model, PROMPT, params),
    )
    assert not result.rejects(LEVEL), result


class UniformQForChosen(SwitchProposer):
    """Broken on purpose: prompt lookup and the draft model per row, but a row prompt lookup drafted is verified
    against a uniform q (a merge that forgot its one-hot q) instead of its own."""

    def propose(self, view, caps):
        draft = super().propose(view, caps)
        if draft.probs is None:
            return draft
        probs = draft.probs.clone()  # [B, k + 1, V]
        for b, (source, n) in enumerate(zip(view.sources, draft.num_nodes)):
            if source == 0 and n:
                probs[b] = 1.0 / V
        return dataclasses.replace(draft, probs=probs)


@pytest.mark.slow  # ~12 s, beside the case it gives power to
def test_a_merge_that_mixes_up_q_fails(tiny_target, tiny_draft):
    """Power of the ngram+model case above: the same sources with the chosen rows' q replaced fail the test (both
    sources draft thousands of rows here: the prompt's last two tokens recur, the continuations mostly do not)."""
    params = SETTINGS["top_k_top_p"]
    broken = UniformQForChosen([PromptLookupProposer(), DraftModelProposer(tiny_draft.model, V)])
    gen = SpeculativeGenerator(tiny_target, broken, config=SpecConfig(draft="custom", gamma=2, random="stream"))
    result = gof(sample_sequences(gen, params), exact_sequence_probs(tiny_target.model, PROMPT, params))
    assert result.rejects(LEVEL), result


def test_broken_engine_fails(tiny_target, tiny_draft):
    params = SETTINGS["temperature"]
    broken = QBeforeTemperature(DraftModelProposer(tiny_draft.model, V))
    gen = SpeculativeGenerator(tiny_target, broken, config=SpecConfig(draft="custom", gamma=2, random="stream"))
    result = gof(sample_sequences(gen, params), exact_sequence_probs(tiny_target.model, PROMPT, params))
    assert result.rejects(LEVEL), result


@pytest.mark.slow  # the kernel certificate shows the block bugs' failure in the default tier
def test_broken_block_engine_fails(tiny_target, tiny_draft):
    """The block case has power too: the engine with a block verifier that stops at the first u >= h fails
    (p ~ 1e-12 at this size; the subtler block_plain_residual needs the kernel certificate's sizes)."""
    from verispec.certify.bugs import broken_block_verifier

    params = SETTINGS["top_k_top_p"]
    broken = broken_block_verifier("block_first_rejection")
    gen = SpeculativeGenerator(
        tiny_target,
        tiny_draft,
        config=SpecConfig(draft="model", stop_below=None, gamma=2, random="stream"),
        verification=Verification(chain=broken),
    )
    result = gof(sample_sequences(gen, params), exact_sequence_probs(tiny_target.model, PROMPT, params))
    assert result.rejects(LEVEL), result
