"""draft=online in a RolloutEngine: the head trains between rollout batches on what they verified (never inside a
batch, never during a weight update), keeps its versions across weight updates and sleep / wake, and `save_draft`
writes a head `--draft DIR` drafts with. An 8-layer tiny target (EAGLE-3's default aux layers 2, 4, 5)."""

from __future__ import annotations

import pytest
import torch

from verispec.engine import SpecConfig, SpeculativeGenerator
from verispec.engine.drafters import load_draft
from verispec.rollout import RolloutEngine
from verispec.sampling import SamplingParams

from ..helpers.tiny import loaded

ONLINE = SpecConfig.parse("draft=online,gamma=3,stop_below=none,random=stream")
PROMPTS = [[1, 5, 6, 7, 8], [1, 9, 9, 3], [1, 4, 20, 21, 4, 20], [1, 11, 12, 11, 12]]
T1 = SamplingParams(temperature=1.0)
BATCH = dict(n=4, params=T1, max_new_tokens=40, ignore_eos=True)  # 16 x 40 = 640 tokens: past min_tokens (512)


@pytest.fixture
def policy():
    """An 8-layer target of its own (tests replace its weights)."""
    return loaded(0, layers=8)


def _head(learner) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in learner.head.state_dict().items()}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_head_trains_between_batches_only(policy):
    eng = RolloutEngine(policy, config=ONLINE)
    learner = eng.learner
    assert learner is eng.gen.learner and not learner.inline
    calls = []
    between = learner.train_between

    def spy(seconds):  # when the engine trains: under its lock, after the batch, with the batch's time
        calls.append((learner.steps, eng._lock.locked(), seconds))
        return between(seconds)

    learner.train_between = spy
    versions, steps = [], []
    for seed in range(3):
        steps.append(learner.steps)
        eng.generate(PROMPTS, seed=seed, **BATCH)
        versions.append(learner.version)
        assert calls[-1] == (steps[-1], True, eng.last_stats.wall_time)  # nothing trained inside the batch
        assert eng.last_train_seconds > 0
    assert versions == [1, 2, 3]  # one version per batch (a batch holds enough tokens for the first head)
    assert learner.stats()["tokens_seen"] == 3 * 16 * 40
    assert RolloutEngine(policy).learner is None  # other drafters: none


def test_the_head_survives_weight_updates_and_trains_on_the_new_policy(policy):
    eng = RolloutEngine(policy, config=ONLINE)
    eng.generate(PROMPTS, seed=0, **BATCH)
    version, head, seen = eng.learner.version, _head(eng.learner), eng.learner.buffer.generated
    assert version >= 1
    new = {k: v.clone() for k, v in loaded(5, layers=8).model.state_dict().items()}
    eng.update_weights(new.items())
    assert eng.learner.version == version and _same(_head(eng.learner), head)  # untouched by the update
    outs = eng.generate(PROMPTS, seed=1, **BATCH)
    assert all(o.weight_version == 1 for o in outs)
    assert eng.learner.version == version + 1 and not _same(_head(eng.learner), head)  # trained on the new policy
    assert eng.learner.buffer.generated == seen + 16 * 40


def test_sleep_frees_the_caches_and_keeps_the_head(policy):
    eng = RolloutEngine(policy, config=ONLINE)
    eng.sleep()  # nothing allocated yet: a no-op
    eng.wake_up()
    for seed in range(2):  # the first head (version 1), then a batch it drafts in
        eng.generate(PROMPTS, seed=seed, **BATCH)
    online = eng.gen.core.proposer.parts[1]
    assert eng.gen.core.runner.cache is not None and online._inner.runner.cache is not None
    version, head, kept = eng.learner.version, _head(eng.learner), eng.gen.core.proposer.kept[1]
    state = eng.learner.state()
    eng.sleep()
    eng.sleep()
    assert eng.gen.core.runner.cache is None and online._inner is None  # the target's cache and the head's drafter
    with pytest.raises(RuntimeError, match="wake_up"):
        eng.generate(PROMPTS, seed=2, **BATCH)
    eng.wake_up()
    assert eng.learner.version == version and _same(_head(eng.learner), head)
    assert _same(eng.learner.state()["head"], state["head"]) and eng.learner.steps == state["steps"]
    eng.generate(PROMPTS, seed=2, **BATCH)
    assert eng.gen.core.proposer.kept[1] > kept  # the head drafts on, and its drafts are kept
    assert eng.learner.version == version + 1


def test_save_draft_writes_a_head_that_drafts_exactly(policy, tmp_path):
    eng = RolloutEngine(policy, config=ONLINE)
    with pytest.raises(ValueError, match="no version yet"):
        eng.save_draft(tmp_path / "none")
    for seed in range(2):
        eng.generate(PROMPTS, seed=seed, **BATCH)
    folder = eng.save_draft(tmp_path / "head")
    assert {p.name for p in folder.iterdir()} == {"config.json", "model.safetensors", "online_state.pt"}
    head = load_draft(str(folder))
    assert head.kind == "eagle3"
    spec = SpeculativeGenerator(policy, head, config=SpecConfig(draft="model", gamma=3))
    plain = SpeculativeGenerator(policy, config=SpecConfig(draft="none"))
    greedy = SamplingParams(temperature=0.0)
    a = spec.generate(PROMPTS, greedy, max_new_tokens=24, ignore_eos=True)
    b = plain.generate(PROMPTS, greedy, max_new_tokens=24, ignore_eos=True)
    assert [x.token_ids for x in a] == [x.token_ids for x in b]
    assert sum(x.stats.accepted for x in a) > 0  # the saved head's drafts were kept
    again = RolloutEngine(policy, config=SpecConfig.parse(f"draft=online,model={folder},gamma=3,random=stream"))
    assert again.learner.version == eng.learner.version and again.learner.steps == eng.learner.steps
    with pytest.raises(ValueError, match="draft=history trains none"):
        RolloutEngine(policy).save_draft(tmp_path / "x")


def test_a_learner_state_moves_to_a_fresh_learner(policy):
    """`state()` / `load_state` (how a restarted Ray replica gets its head back): a learner with no head yet takes
    the head, its optimizer and its version."""
    eng = RolloutEngine(policy, config=ONLINE)
    eng.generate(PROMPTS, seed=0, **BATCH)
    other = RolloutEngine(policy, config=ONLINE)
    assert other.learner.state() is None
    assert other.learner.load_state(eng.learner.state()) == eng.learner.version
    assert _same(_head(other.learner), _head(eng.learner))
    a, b = eng.learner.state(), other.learner.state()
    assert _same(a["opt"]["state"][0], b["opt"]["state"][0]) and a["steps"] == b["steps"]
    other.generate(PROMPTS, seed=1, **BATCH)
    assert other.learner.version == eng.learner.version + 1
