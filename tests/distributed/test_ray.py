"""RolloutCluster on a local Ray instance (2 CPUs, 2 one-thread replicas of a tiny model): request order, equality
with one engine, weight broadcasts, recovery from a killed replica, errors on the driver."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import ray
import torch
from safetensors.torch import save_file

from verispec.cli import main
from verispec.model.payload import from_payload, tensors_payload
from verispec.rollout import RolloutCluster, sample_seed
from verispec.rollout import cluster as rollout_cluster
from verispec.sampling import SamplingParams

from ..helpers.ray_engines import REFUSED_TOKENS, TinyEngine
from ..helpers.saved import read_strict_json, save_tiny_pair
from ..helpers.tiny import loaded

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [[3, 7, 7, 12, 3, 7], [5, 9, 11, 4], [8, 8, 9], [20, 21, 3, 4, 5], [6, 30, 6, 30], [11, 12]]
T1 = SamplingParams(temperature=1.0)
# every test of this file on one xdist worker (the slow tier runs with --dist loadgroup): one local Ray instance
pytestmark = pytest.mark.xdist_group("ray")


@pytest.fixture(scope="module")
def ray_local():
    env = {"PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "src")]), "OMP_NUM_THREADS": "1"}
    ray.init(
        address="local",  # a fresh instance, never a cluster another test or user started
        num_cpus=4,  # logical: the module's 2-replica cluster and the benchmark test's clusters at once (2 cores)
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": env},
    )
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def crash_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("crash")


@pytest.fixture(scope="module")
def cluster(ray_local, crash_dir):
    with RolloutCluster(TinyEngine(crash_dir=str(crash_dir)), num_replicas=2, threads_per_replica=1) as c:
        yield c


@pytest.fixture(scope="module")
def reference():
    """The same engine in the test process (never updated: tests that update copy it)."""
    return TinyEngine()()


def _new_weights(seed: int) -> list[tuple[str, torch.Tensor]]:
    return [(k, v.clone()) for k, v in loaded(seed).model.state_dict().items()]


def _keys(outs) -> list[tuple[int, int]]:
    return [(o.prompt_index, o.sample_index) for o in outs]


def _assert_same(outs, ref) -> None:
    assert _keys(outs) == _keys(ref)
    for a, b in zip(outs, ref):
        assert a.completion_token_ids == b.completion_token_ids
        assert a.finish_reason == b.finish_reason and a.stop_reason == b.stop_reason and a.seed == b.seed
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-6)
        assert a.raw_logprobs == pytest.approx(b.raw_logprobs, abs=1e-6)


def test_results_come_back_in_request_order(cluster):
    for n in (2, 4):  # 6 prompts -> 4 shards over 2 replicas
        outs = cluster.generate(PROMPTS, n=n, params=T1, max_new_tokens=8, seed=3)
        assert _keys(outs) == [(i, j) for i in range(len(PROMPTS)) for j in range(n)]
        assert all(o.prompt_token_ids == PROMPTS[o.prompt_index] for o in outs)
        assert [o.seed for o in outs] == [sample_seed(3, i, j) for i in range(len(PROMPTS)) for j in range(n)]
    assert cluster.last_stats.target_passes > 0 and cluster.last_stats.accepted > 0  # the draft was used


def test_equal_to_one_engine_for_the_same_seed(cluster, reference, monkeypatch):
    drawn = []
    monkeypatch.setattr(rollout_cluster, "_draw_seed", lambda: drawn.append(1234) or 1234)
    outs = cluster.generate(PROMPTS, n=3, params=T1, max_new_tokens=12, seed=11)
    ref = reference.generate(PROMPTS, n=3, params=T1, max_new_tokens=12, seed=11)
    _assert_same(outs, ref)
    assert {o.finish_reason for o in ref} == {"stop", "length"}  # both kinds compared
    text = cluster.generate(["a b c a b", "x0 d e d"], n=2, params=T1, max_new_tokens=6, seed=1)  # tokenized remotely
    _assert_same(text, reference.generate(["a b c a b", "x0 d e d"], n=2, params=T1, max_new_tokens=6, seed=1))
    part = dict(params=T1, max_new_tokens=8, seed=11, prompt_indices=[4, 1, 7])  # a shard of a larger batch
    _assert_same(cluster.generate(PROMPTS[:3], n=2, **part), reference.generate(PROMPTS[:3], n=2, **part))
    unseeded = cluster.generate(PROMPTS, n=2, params=T1, max_new_tokens=4)  # one seed, drawn here, for every shard
    assert [o.seed for o in unseeded] == [sample_seed(drawn[0], i, j) for i in range(len(PROMPTS)) for j in range(2)]


def test_bad_requests_raise_on_the_driver(cluster):
    pids = [r["pid"] for r in cluster.replica_info()]
    for kwargs, match in [
        (dict(n=0), "n must be"),
        (dict(n=17), "n must be"),
        (dict(prompts=[]), "non-empty list"),
        (dict(prompts="a b"), "non-empty list"),
        (dict(prompts=[[3, 4], []]), "prompt 1: a prompt must be a non-empty"),
        (dict(prompts=[[3, True]]), "prompt 0: token ids must be integers"),
        (dict(prompts=[[3, 99]]), r"lie in \[0, 32\)"),
        (dict(prompts=["a b", ""]), "prompt is empty"),  # text: checked by a replica's tokenizer, before any shard
        (dict(params=SamplingParams(seed=3)), "request seed"),
        (dict(params=SamplingParams(top_k=5)), "importance ratios"),
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(seed=-1), "seed must be"),
        (dict(stop=[1]), "stop must be"),
    ]:
        args = dict(prompts=PROMPTS, n=2, params=T1, max_new_tokens=4) | kwargs
        with pytest.raises(ValueError, match=match):
            cluster.generate(args.pop("prompts"), **args)
    assert [r["pid"] for r in cluster.replica_info()] == pids


def test_an_engine_error_is_raised_not_retried(cluster):
    restarts, pids = cluster.restarts, [r["pid"] for r in cluster.replica_info()]
    with pytest.raises(ValueError, match="refuses max_new_tokens"):
        cluster.generate(PROMPTS, n=2, params=T1, max_new_tokens=REFUSED_TOKENS, seed=0)
    assert cluster.restarts == restarts and [r["pid"] for r in cluster.replica_info()] == pids
    assert len(cluster.generate(PROMPTS, n=2, params=T1, max_new_tokens=4, seed=0)) == 12  # still serving


def test_a_broadcast_update_reaches_every_replica(cluster):
    before = cluster.generate(PROMPTS, n=2, params=T1, max_new_tokens=12, seed=5)
    new = _new_weights(5)
    reps = cluster.update_weights(new)
    assert [r.version for r in reps] == [1, 1] and all(r.tensors == len(new) for r in reps)
    assert cluster.weight_version == 1
    assert [r["weight_version"] for r in cluster.replica_info()] == [1, 1]
    single = TinyEngine()()
    single.update_weights(new)
    after = cluster.generate(PROMPTS, n=2, params=T1, max_new_tokens=12, seed=5)
    _assert_same(after, single.generate(PROMPTS, n=2, params=T1, max_new_tokens=12, seed=5))
    assert all(o.weight_version == 1 for o in after)
    assert [o.completion_token_ids for o in after] != [o.completion_token_ids for o in before]


def test_a_killed_replica_is_replaced_and_its_shard_rerun(cluster, crash_dir):
    new = _new_weights(7)
    cluster.update_weights(new)
    version = cluster.weight_version
    single = TinyEngine()()
    single.update_weights(new)
    ref = single.generate(PROMPTS, n=3, params=T1, max_new_tokens=12, seed=9)
    restarts = cluster.restarts
    (crash_dir / "armed").touch()  # the next shard to finish kills its replica instead of returning
    outs = cluster.generate(PROMPTS, n=3, params=T1, max_new_tokens=12, seed=9)
    assert (crash_dir / "crashed").exists() and cluster.restarts == restarts + 1
    _assert_same(outs, ref)  # nothing lost, nothing twice, the same samples under the same weights
    assert len(set(_keys(outs))) == len(outs) == 3 * len(PROMPTS)
    info = cluster.replica_info()
    assert sorted(r["incarnation"] for r in info) == [0, 1]
    assert [r["weight_version"] for r in info] == [version, version]
    assert all(o.weight_version == version for o in outs)


# A cluster of its own costs a Ray actor start per replica (seconds each on 2 cores): one replica in the default
# tier, two (the one that could not take the weights back takes its sibling down) in the slow tier.
@pytest.mark.parametrize("replicas", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_a_replica_that_cannot_take_the_weights_back_shuts_the_cluster(ray_local, tmp_path, replicas):
    """A restarted replica whose replay fails (its checkpoint path is gone) must not sample with initial weights."""
    ckpt, crash = tmp_path / "ckpt", tmp_path / "crash"
    ckpt.mkdir(), crash.mkdir()
    save_file(dict(_new_weights(7)), str(ckpt / "model.safetensors"))
    cluster = RolloutCluster(TinyEngine(crash_dir=str(crash)), num_replicas=replicas, threads_per_replica=1)
    try:
        cluster.update_weights_from_path(ckpt)
        shutil.rmtree(ckpt)
        (crash / "armed").touch()
        with pytest.raises(Exception, match="does not exist"):
            cluster.generate(PROMPTS, n=2, params=T1, max_new_tokens=8, seed=1)
        with pytest.raises(RuntimeError, match=r"shut down: replica .* could not take the current weights back"):
            cluster.generate(PROMPTS, n=2, params=T1, max_new_tokens=8, seed=1)
    finally:
        cluster.shutdown()


def test_payload_round_trip_keeps_dtypes_and_bits():
    tensors = [
        ("a", torch.randn(3, 4).to(torch.bfloat16)),
        ("b", torch.randn(5).to(torch.float16)),
        ("c", torch.arange(6, dtype=torch.int64).view(2, 3).t()),  # not contiguous
        ("d", torch.tensor(True)),
    ]
    payload, names = tensors_payload(tensors)
    assert names == ("a", "b", "c", "d") and payload["dtypes"] == {"a": "bfloat16"}
    assert all(arr.flags["C_CONTIGUOUS"] for arr in payload["arrays"].values())
    for (name, t), (name2, back) in zip(tensors, from_payload(payload)):
        assert name == name2 and back.dtype == t.dtype and torch.equal(back, t)
    for bad, match in [([], "empty"), ([("a", torch.zeros(1))] * 2, "given twice"), ([("a", [1.0])], "torch.Tensor")]:
        with pytest.raises(ValueError, match=match):
            tensors_payload(bad)


def test_ray_must_be_initialized(monkeypatch):
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    with pytest.raises(RuntimeError, match=r"ray\.init"):
        RolloutCluster(TinyEngine())


@pytest.mark.parametrize("layouts", [(1,), pytest.param((1, 2), marks=pytest.mark.slow)], ids=["1", "1,2"])
def test_bench_replicas_on_tiny_saved_models(ray_local, tmp_path, layouts):
    """`verispec bench replicas` end to end on the module's Ray instance (a smoke test of the workload and its
    report; speed is never asserted). Every layout starts a cluster (a Ray actor per replica, seconds each on 2
    cores): one replica in the default tier; 1 and 2, compared, in the slow tier."""
    save_tiny_pair(tmp_path)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        "\n".join(json.dumps({"prompt": p, "category": c}) for p, c in (("a b c a b", "code"), ("x0 d e d", "math")))
    )
    argv = ["bench", "replicas", "--target", str(tmp_path / "target"), "--prompts", str(prompts), "--no-chat"]
    argv += ["--num-prompts", "1", "--group", "2", "--max-new-tokens", "5", "--methods", "plain"]
    argv += ["--replicas", ",".join(map(str, layouts))]
    assert main([*argv, "--out", str(tmp_path / "out")]) == 0
    result = read_strict_json(tmp_path / "out" / "replicas.json")
    recs = result["records"]
    assert {(r["category"], r["replicas"], r["threads"]) for r in recs} == {
        (c, r, 1) for c in ("code", "math") for r in layouts
    }
    assert all(r["tokens"] == 2 * 5 and r["same_tokens_as_1_replica"] for r in recs)
    assert all(r["ratio_to_1_replica"] == 1.0 for r in recs if r["replicas"] == 1)
    assert result["machine"]["cpu_count"] >= 1 and len(result["totals"]) == len(layouts)
    assert f"| plain | all | {layouts[-1]} | 1 |" in (tmp_path / "out" / "replicas.md").read_text()
