"""The generator certificate (`verispec.certify.generate`) on rollouts after two weight updates, with history from the
old weights and a stale separate draft model in play: it must PASS against the *updated* target (N = 2000
continuations of 3 tokens per prompt, family-wise level 0.01, as the default-tier certificates of tests/certify)."""

from __future__ import annotations

import pytest

from verispec.certify.generate import MethodSpec, certify_generate
from verispec.engine import SpecConfig
from verispec.rollout import RolloutEngine
from verispec.sampling import SamplingParams

from ..helpers.tiny import loaded

pytestmark = pytest.mark.statistical

PROMPTS = [[3, 7, 7, 12, 3, 7], [5, 9, 11, 4]]
T1 = SamplingParams(temperature=1.0)
G = 8


def rollout_sampler(eng: RolloutEngine):
    """certify_generate's sample function: the seeds of one call become groups of G rollouts of the prompt."""

    def sample(prompt, params, seeds, length):
        out = []
        for start in range(0, len(seeds), G):
            chunk = seeds[start : start + G]
            outs = eng.generate(
                [prompt], n=len(chunk), params=T1, max_new_tokens=length, seed=chunk[0], ignore_eos=True
            )
            out += [o.completion_token_ids for o in outs]
        return out, eng.last_stats

    return sample


@pytest.mark.slow  # the default tier's rollout distribution test covers the same setting (tests/rollout)
def test_certificate_after_two_updates_with_stale_history_and_draft():
    policy, stale_draft = loaded(0), loaded(1, layers=1)
    cfg = SpecConfig.parse("draft=model+history,gamma=2,stop_below=none,random=stream")
    eng = RolloutEngine(policy, stale_draft, config=cfg, max_batch_size=G)
    for version, seed in enumerate((5, 6), 1):
        eng.generate(PROMPTS, n=G, params=T1, max_new_tokens=8, seed=version)  # history under the old weights
        eng.update_weights(loaded(seed).model.state_dict().items())
        assert eng.weight_version == version
    assert len(eng.history) == len(PROMPTS)
    updated = loaded(6)
    report = certify_generate(
        MethodSpec(method="verispec", config=eng.config),
        PROMPTS,
        T1,
        samples=2000,
        length=3,
        reference=updated,
        sample_fn=rollout_sampler(eng),
        show_progress=False,
    )
    assert report.verdict == "PASS", [(t.name, t.holm_pvalue) for t in report.tests]
    assert sum(eng.gen.core.proposer.accepted_by_source.values()) > 0
