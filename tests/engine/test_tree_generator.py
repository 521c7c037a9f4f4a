"""Tree speculation through the engine on tiny random models: greedy trees reproduce plain greedy decoding token
for token (every tree shape and drafter, batch > 1 with different trees per row), seeded rows stay independent
of the batch, penalties and logprobs work, and bad tree options are clear errors. The distributional tests are in
tests/certify (tree kernel certificate; generator certificate with trees)."""

from __future__ import annotations

import pytest
import torch

from verispec.drafting import TreeSpec
from verispec.engine.config import SpecConfig
from verispec.engine.generator import SpeculativeGenerator
from verispec.sampling import SamplingParams

from ..helpers.tiny import greedy_reference

PROMPTS = [[3, 4, 5, 3, 4, 5, 3, 4], [9, 10], [20, 21, 22, 23, 24, 25, 20, 21, 22, 23, 24], [7]]
GREEDY = SamplingParams(temperature=0)
TREES = ["3-2-1", "dynamic-3-3-8", "2-2-2-2"]


@pytest.mark.parametrize(
    "tree, rule",
    [
        (t, r)
        for t in TREES
        for r in ("deterministic", "iid", "without_replacement")
        if r == "deterministic" or not t.startswith("dynamic")
    ],
)
def test_greedy_tree_equals_plain_greedy(tree, rule, tiny_target, tiny_noisy):
    gen = SpeculativeGenerator(tiny_target, tiny_noisy, config=SpecConfig(draft="model", tree=tree, verify=rule))
    outs = gen.generate(PROMPTS, GREEDY, max_new_tokens=20)
    for prompt, out in zip(PROMPTS, outs):
        assert out.token_ids == greedy_reference(tiny_target.model, prompt, 20)
    st = gen.last_stats
    assert st.nodes > st.target_passes  # trees were drafted
    assert st.tau > 1.3  # and the noisy draft's trees were accepted beyond the first level


def test_greedy_ngram_tree_equals_plain_greedy(tiny_target):
    gen = SpeculativeGenerator(tiny_target, config=SpecConfig(draft="ngram", tree="3-1-1-1"))
    outs = gen.generate(PROMPTS, GREEDY, max_new_tokens=20)
    for prompt, out in zip(PROMPTS, outs):
        assert out.token_ids == greedy_reference(tiny_target.model, prompt, 20)


@pytest.mark.parametrize("rule", ["deterministic", "without_replacement"])
def test_seeded_rows_are_batch_invariant_with_trees(rule, tiny_target, tiny_noisy):
    gen = SpeculativeGenerator(
        tiny_target, tiny_noisy, config=SpecConfig(draft="model", tree="3-2-1", verify=rule, random="stream")
    )
    params = [SamplingParams(temperature=1.0, top_p=0.95, seed=s) for s in (11, 12, 13, 14)]
    batch = gen.generate(PROMPTS, params, max_new_tokens=16, ignore_eos=True)
    alone = [gen.generate([p], [sp], max_new_tokens=16, ignore_eos=True)[0] for p, sp in zip(PROMPTS, params)]
    for a, b in zip(batch, alone):
        assert a.token_ids == b.token_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)


def test_logprobs_are_the_targets_at_the_emitted_positions(tiny_target, tiny_noisy):
    gen = SpeculativeGenerator(tiny_target, tiny_noisy, config=SpecConfig(draft="model", tree="3-2-1", verify="iid"))
    out = gen.generate([PROMPTS[0]], SamplingParams(temperature=0.8, seed=3), max_new_tokens=12, ignore_eos=True)[0]
    seq = PROMPTS[0] + out.token_ids
    with torch.no_grad():
        logits = tiny_target.model(torch.tensor([seq])).logits[0, len(PROMPTS[0]) - 1 : -1]
    raw = logits.log_softmax(-1).gather(1, torch.tensor(out.token_ids).unsqueeze(1)).squeeze(1)
    assert out.raw_logprobs == pytest.approx(raw.tolist(), abs=1e-4)
    proc = (logits / 0.8).log_softmax(-1).gather(1, torch.tensor(out.token_ids).unsqueeze(1)).squeeze(1)
    assert out.logprobs == pytest.approx(proc.tolist(), abs=1e-4)


def test_penalties_with_trees_match_plain_greedy(tiny_target, tiny_noisy):
    params = SamplingParams(temperature=0, repetition_penalty=1.3, frequency_penalty=0.5)
    plain = SpeculativeGenerator(tiny_target, config=SpecConfig(draft="none")).generate(
        PROMPTS, params, max_new_tokens=16
    )
    tree = SpeculativeGenerator(tiny_target, tiny_noisy, config=SpecConfig(draft="model", tree="3-2-1")).generate(
        PROMPTS, params, max_new_tokens=16
    )
    assert [o.token_ids for o in plain] == [o.token_ids for o in tree]


def test_per_request_speculation_off_and_budget_caps(tiny_target, tiny_noisy):
    gen = SpeculativeGenerator(tiny_target, tiny_noisy, config=SpecConfig(draft="model", tree="2-2-2-2"))
    sess = gen.session()
    sess.add(PROMPTS[0], GREEDY, max_new_tokens=3, gamma=0, key="off")
    sess.add(PROMPTS[1], GREEDY, max_new_tokens=5, key="on")
    done = {}
    while sess.num_active:
        for ev in sess.step():
            if ev.completion is not None:
                done[ev.key] = ev.completion
    assert done["off"].token_ids == greedy_reference(tiny_target.model, PROMPTS[0], 3)
    assert done["on"].token_ids == greedy_reference(tiny_target.model, PROMPTS[1], 5)
    assert done["off"].stats.nodes == 0


def test_bad_tree_options(tiny_target, tiny_noisy):
    with pytest.raises(ValueError, match="tree spec must look like"):
        SpeculativeGenerator(tiny_target, tiny_noisy, config=SpecConfig(draft="model", tree="4-x"))
    with pytest.raises(ValueError, match="biases sampled children"):
        SpeculativeGenerator(
            tiny_target, tiny_noisy, config=SpecConfig(draft="model", tree="dynamic-3-3-8", verify="iid")
        )
    with pytest.raises(ValueError, match="rule must be one of"):
        TreeSpec.parse("2-2", "greedy")
    with pytest.raises(ValueError, match="needs a drafter"):
        SpeculativeGenerator(tiny_target, config=SpecConfig(draft="none", tree="2-2"))
    with pytest.raises(ValueError, match="deterministic"):
        SpeculativeGenerator(tiny_target, config=SpecConfig(draft="ngram", tree="2-2", verify="iid"))
    with pytest.raises(ValueError, match="at most 256"):
        TreeSpec.parse("8-8-8")


@pytest.mark.parametrize("draft, tree", [("noisy", "dynamic-6-10-10"), ("ngram", "dynamic-8-4-4")])
def test_wide_trees_fit_their_caches_to_the_end(draft, tree, tiny_target, tiny_noisy):
    """A dynamic draft computes up to topk nodes per depth before the budget prunes them, and prompt-lookup tries
    obey the node budget: both fit the KV caches through a whole generation (review finding)."""
    if draft == "noisy":
        gen = SpeculativeGenerator(tiny_target, tiny_noisy, config=SpecConfig(draft="model", tree=tree))
    else:
        gen = SpeculativeGenerator(tiny_target, config=SpecConfig(draft="ngram", tree=tree))
    prompt = list(range(3, 19))
    out = gen.generate([prompt], SamplingParams(temperature=1.0, seed=0), max_new_tokens=40, ignore_eos=True)[0]
    assert len(out.token_ids) == 40


@pytest.mark.parametrize("rule", ["iid", "without_replacement"])
def test_single_branch_tree_is_the_chain_token_for_token(rule, tiny_target, tiny_noisy):
    """A 1-1-...-1 tree draws the same uniforms in the same order as a chain of the same length (drafts level by
    level, then num_nodes + 1 for verification), so seeded sampling gives the chain's tokens exactly: the tree
    drafter's cache, masks and positions reproduce the chain's draft distributions, not only losslessness."""
    params = [SamplingParams(temperature=1.0, seed=s) for s in (1, 2)]
    # random=stream: the uniforms in draw order (auto would couple these seeded rows)
    chain = SpeculativeGenerator(
        tiny_target, tiny_noisy, config=SpecConfig(draft="model", stop_below=None, gamma=6, random="stream")
    )
    tree = SpeculativeGenerator(
        tiny_target, tiny_noisy, config=SpecConfig(draft="model", tree="1-1-1-1-1-1", verify=rule, random="stream")
    )
    a = chain.generate(PROMPTS[:2], params, max_new_tokens=40, ignore_eos=True)
    b = tree.generate(PROMPTS[:2], params, max_new_tokens=40, ignore_eos=True)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert chain.last_stats.tau == pytest.approx(tree.last_stats.tau)
