"""Rollouts keep the target's distribution exactly: after a weight update, with a rollout history sampled by a
*different* model and by the policy's older weights, alone and beside a sampled draft-model chain (rule "mixed").

The test is the engine's (tests/engine/test_distribution.py): the first L = 3 tokens of N = 12 000 seeded samples
against the updated target's exact sequence distribution, chi-square at LEVEL = 1e-4 (bins merged to expected
counts >= 5). Power: the same test at the same N rejects the deliberately broken engine there (q before
temperature) and, here, SPEC-RL's reuse rule (slow tier: ~20 s on 2 cores; in the default tier SPEC-RL's rule FAILS
the generator certificate with its power asserted, tests/certify/test_generate.py::test_spec_rl_reuse_rule_fails).
"""

from __future__ import annotations

import numpy as np
import pytest

from verispec.drafting import RolloutHistory
from verispec.engine import SpecConfig, SpeculativeGenerator
from verispec.engine.verify import Verification
from verispec.rollout import RolloutEngine
from verispec.sampling import SamplingParams

from ..helpers.sequences import LEVEL, PROMPT, exact_sequence_probs, gof
from ..helpers.tiny import loaded

pytestmark = pytest.mark.statistical

N = 12_000
G = 8
T1 = SamplingParams(temperature=1.0)


def foreign_history(model, n: int = 64) -> RolloutHistory:
    """Completions of PROMPT sampled by another model: what a stale history looks like at its worst."""
    history = RolloutHistory()
    gen = SpeculativeGenerator(model, config=SpecConfig(draft="none"))
    for o in gen.generate([PROMPT] * n, [SamplingParams(seed=i) for i in range(n)], max_new_tokens=8, ignore_eos=True):
        history.add(PROMPT, o.token_ids)
    return history


@pytest.mark.parametrize(
    "with_draft,choose_depth",
    [  # the default tier keeps the mixed tree of both sources; history alone and choose_depth in the slow tier
        pytest.param(False, None, id="history", marks=pytest.mark.slow),
        pytest.param(True, None, id="history+draft"),
        pytest.param(True, 2, id="history/draft", marks=pytest.mark.slow),
    ],
)
def test_rollouts_after_an_update_with_a_foreign_history_follow_the_new_target(with_draft, choose_depth, tiny_draft):
    """History alone, and beside a stale separate draft model's sampled chain (rule "mixed"; a weak draft, so that
    its chain is often rejected at the root and the history's branches get tested and accepted there), and with one
    part per row and step (choose_depth 2: the trie where it is 2 deep, else the chain)."""
    policy, updated = loaded(0), loaded(5)
    draft = tiny_draft if with_draft else None
    history = foreign_history(tiny_draft)
    cfg = SpecConfig(
        draft="model+history" if with_draft else "history",
        gamma=2,
        stop_below=None,
        random="stream",
        choose_depth=choose_depth,
    )
    eng = RolloutEngine(policy, draft, config=cfg, history=history, max_batch_size=256)
    eng.generate([PROMPT], n=G, params=T1, max_new_tokens=8, seed=99)  # rollouts of the old weights join the history
    eng.update_weights(updated.model.state_dict().items())
    outs = eng.generate([PROMPT] * (N // G), n=G, params=T1, max_new_tokens=3, seed=1, ignore_eos=True)
    seqs = np.array([o.completion_token_ids for o in outs])
    assert seqs.shape == (N, 3) and {o.weight_version for o in outs} == {1}
    result = gof(seqs, exact_sequence_probs(updated.model, PROMPT, T1))
    assert not result.rejects(LEVEL), result
    st = eng.last_stats
    assert 0 < st.accepted < st.nodes  # speculation accepted some drafts and rejected others
    if with_draft:
        by_source = eng.gen.core.proposer.accepted_by_source
        assert by_source["chain"] > 0 and by_source["branches"] > 0


@pytest.mark.slow
def test_spec_rl_reuse_rule_fails(tiny_draft):
    """SPEC-RL's rollout reuse (Liu et al. 2025): old-policy tokens accepted with probability min(1, p_new / p_old),
    a fresh draw from p_new at the first rejection instead of the residual. With the tiny draft as the old policy
    and the updated weights as the new one, the same chi-square test (N = 12 000 seeded samples, LEVEL 1e-4)
    rejects it, while the same generator with the exact verify_chain, on the same seeds, passes: the harness is
    not what fails."""
    from verispec.sampling import verify_chain
    from verispec.sampling.lossy import spec_rl_verifier

    from ..helpers.sequences import sample_sequences

    updated = loaded(5)
    probs = exact_sequence_probs(updated.model, PROMPT, T1)
    results = {}
    for name, verifier in (("exact", verify_chain), ("spec-rl", spec_rl_verifier())):
        config = SpecConfig(draft="model", gamma=2, random="stream")
        gen = SpeculativeGenerator(updated, tiny_draft, config=config, verification=Verification(chain=verifier))
        results[name] = gof(sample_sequences(gen, T1, n=N), probs)
        assert 0 < gen.last_stats.accepted < gen.last_stats.drafted, name  # drafts accepted and rejected
    assert not results["exact"].rejects(LEVEL), results["exact"]
    assert results["spec-rl"].rejects(LEVEL), results["spec-rl"]
