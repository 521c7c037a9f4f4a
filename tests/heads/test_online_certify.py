"""The generator certificate of draft=online on the built-in default model (SmolLM2-135M), while the head trains:
versions are published during the certified sampling, and the certificate PASSES (N = 400, its first-token, PIT
and log-likelihood tests; the two-sample test against plain decoding is left out for time). Slow tier (~2-3 min
on 2 cores; the full-size run, N = 2000 with the two-sample test, passed in 443 s: the issue's closing note)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from verispec.certify.generate import certify_generate
from verispec.certify.methods import MethodSpec
from verispec.engine import SpecConfig, SpeculativeGenerator
from verispec.model.loading import load_model
from verispec.sampling import SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.statistical]

WARM = ["Write a short poem about rain.", "def fibonacci(n):", "What is 12 times 7? Explain.", "List three fruits."]


def test_the_certificate_passes_while_the_head_trains():
    target = load_model(None)
    # gamma 3 fixed: the head drafts wherever prompt lookup finds no match (auto would choose plain where it lags)
    gen = SpeculativeGenerator(target, config=SpecConfig.parse("draft=online,gamma=3,online_budget=0.5,random=stream"))
    gen.generate(WARM * 2, SamplingParams(temperature=1.0, seed=0), max_new_tokens=80, chat=True)
    gen.learner.train(steps=4)
    start = gen.learner.version
    assert start >= 1

    def sample(prompt, params, seeds, length):
        outs = gen.generate(
            [list(prompt)] * len(seeds),
            [replace(params, seed=s) for s in seeds],
            max_new_tokens=length,
            ignore_eos=True,
        )
        return [list(o.token_ids) for o in outs], gen.last_stats, [list(o.raw_logprobs) for o in outs]

    prompts = [gen.encode("Tell me about the moon.", chat=True)]
    kept_before = gen.core.proposer.kept[1]
    report = certify_generate(
        MethodSpec(config="draft=online,gamma=3,random=stream"),
        prompts,
        SamplingParams(temperature=1.0),
        samples=400,
        two_sample_tokens=0,
        sample_fn=sample,
        show_progress=False,
    )
    assert report.passed, report.to_markdown()
    assert gen.learner.version >= start + 3  # new versions were published while it sampled
    assert gen.core.proposer.kept[1] > kept_before  # ... and their drafts were kept
