"""draft=online on a RolloutCluster (a local Ray instance, one replica): the head travels with the replica's state.
The driver keeps the training state the replica last reported; a replica that died comes back with it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import ray

from verispec.engine.drafters import load_draft
from verispec.rollout import RolloutCluster
from verispec.sampling import SamplingParams

from ..helpers.online_engines import OnlineTinyEngine

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [[1, 5, 6, 7, 8], [1, 9, 9, 3], [1, 4, 20, 21, 4, 20], [1, 11, 12, 11, 12]]
BATCH = dict(n=4, params=SamplingParams(temperature=1.0), max_new_tokens=40, ignore_eos=True)
pytestmark = pytest.mark.xdist_group("ray")  # one local Ray instance per worker (tests/distributed/test_ray.py)


@pytest.fixture(scope="module")
def ray_local():
    env = {"PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "src")]), "OMP_NUM_THREADS": "1"}
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": env})
    yield
    ray.shutdown()


@pytest.mark.slow  # a Ray instance and two replica starts: ~20 s on 2 cores
def test_a_restarted_replica_continues_the_online_head(ray_local, tmp_path):
    crash = tmp_path / "crash"
    crash.mkdir()
    with RolloutCluster(OnlineTinyEngine(crash_dir=str(crash)), num_replicas=1, threads_per_replica=1) as cluster:
        assert cluster.replica_info()[0]["head_version"] == 0
        for seed in range(2):  # one version per batch: 1, 2 (reported to the driver with each shard)
            cluster.generate(PROMPTS, seed=seed, **BATCH)
        assert cluster.replica_info()[0]["head_version"] == 2
        (crash / "armed").touch()  # the next shard trains the head to version 3, then its process dies
        outs = cluster.generate(PROMPTS, seed=2, **BATCH)
        assert (crash / "crashed").exists() and cluster.restarts == 1 and len(outs) == 16
        info = cluster.replica_info()[0]
        assert info["incarnation"] == 1
        assert info["head_version"] == 3  # version 2 from the driver, + the rerun shard's (a fresh head: 1)
        folder = cluster.save_draft(tmp_path / "head")
    assert load_draft(folder).kind == "eagle3"
