"""Rollouts on several replicas: `RolloutCluster` runs N `RolloutEngine`s as Ray actors, one process each (the guide,
docs/guides/ray.md, says how a batch is sharded, what crosses the network and how failures are handled).

Code: `_Replica` is the actor; `RolloutCluster` checks requests, broadcasts updates (their payloads:
`verispec.model.payload`) and keeps the replicas (restarting one whose process died, with the updates that define
the current weights replayed); `_ShardRun` runs one request's shards over them.

draft=online: every replica trains its own head on the shards it verifies (one learner per replica). A shard's
result carries its replica's training state when the head has a new version (`OnlineLearner.state`: the trained
head and its optimizer, about 3 x the head's parameters); the driver keeps each replica's latest, and a restarted
replica starts from it (its replay buffer starts empty).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace

import torch

from ..engine.config import SpecConfig
from ..engine.stats import SpecStats
from ..model.loading import load_model
from ..model.payload import from_payload, tensors_payload
from ..model.threads import set_threads
from ..model.weights import load_safetensors_dir
from ..sampling import SamplingParams
from .engine import Rollout, RolloutEngine, RolloutRequest, WeightUpdate, check_count
from .engine import draw_seed as _draw_seed  # (module-level: tests replace it)

__all__ = ["EngineSpec", "ReplicaLostError", "RolloutCluster"]

_SETTLE_SECONDS = 60.0  # how long an error path waits for aborted shards before replacing their replicas


class ReplicaLostError(RuntimeError):
    """A shard or a replica ran out of retries (see `RolloutCluster`'s max_shard_retries)."""


def _ray():
    try:
        import ray
    except ImportError:
        raise ImportError("RolloutCluster needs Ray: pip install 'verispec[distributed]' (ray>=2.40)") from None
    return ray


def _lost(e: BaseException) -> bool:
    """Whether an error means a replica's process is gone (not an exception its engine raised); RuntimeError when its
    factory raised (restarting cannot help)."""
    from ray import exceptions as rex

    if getattr(e, "actor_init_failed", False):
        raise RuntimeError(f"a replica failed to start: {e}") from e
    return isinstance(e, (rex.RayActorError, rex.OutOfMemoryError, rex.WorkerCrashedError, rex.NodeDiedError))


def _reraise(e: BaseException):
    """An engine's exception from a replica: raise the original (ValueError, ...), the remote trace as its cause."""
    cause = getattr(e, "cause", None)
    if isinstance(cause, Exception):
        raise cause from e
    raise e


@dataclass(frozen=True)
class EngineSpec:
    """A picklable factory of rollout engines, for `RolloutCluster`: inside each replica, `EngineSpec(...)()` loads
    the target with `verispec.model.load_model` and returns `RolloutEngine(target, config=config, **engine_kwargs)`
    (a draft named in the config, `model=PATH`, is loaded by the engine's drafter factory).

    Attributes:
        target: A hub id, local directory or .gguf file (as `load_model`; it must be reachable from every node).
        config: The engines' SpecConfig or its string form (None: `RL_DEFAULTS`); a draft model is named by its
            path (draft=model[+history],model=PATH), reachable from every node.
        engine_kwargs: RolloutEngine's other arguments (max_batch_size, strict_on_policy, history).
        load_kwargs: `load_model`'s arguments (dtype, device, ...; on a GPU replica, `actor_options={"num_gpus": 1}`,
            device="cuda" is the GPU Ray assigned it). Leave `threads` out: the cluster sets each replica's.

    Raises:
        ValueError: The config is not a SpecConfig or its string form, or names no draft model its drafter needs.
    """

    target: str
    config: SpecConfig | str | None = None
    engine_kwargs: dict = field(default_factory=dict)
    load_kwargs: dict = field(default_factory=dict)

    def __post_init__(self):
        config = SpecConfig.parse(self.config) if isinstance(self.config, str) else self.config
        if config is not None and not isinstance(config, SpecConfig):
            raise ValueError(f"config must be a SpecConfig or its string form, got {config!r}")
        if config is not None and config.drafter.model and config.model is None:
            raise ValueError(f"draft={config.draft}: every replica loads the draft model: name it (model=PATH)")
        object.__setattr__(self, "config", config)

    def __call__(self) -> RolloutEngine:
        return RolloutEngine(load_model(self.target, **self.load_kwargs), config=self.config, **self.engine_kwargs)


class _Replica:
    """One rollout engine in its own process (a Ray actor with two threads: a running generate can be aborted). The
    driver sends it at most one piece of work at a time."""

    def __init__(self, factory: Callable[[], RolloutEngine], threads: int, index: int, incarnation: int):
        set_threads(threads)  # torch's and llama.cpp's, before the factory loads the model (`load_model` keeps it)
        self.threads, self.index, self.incarnation = threads, index, incarnation
        self.engine = factory()
        if not isinstance(self.engine, RolloutEngine):
            raise TypeError(f"the factory must return a RolloutEngine, got {type(self.engine).__name__}")
        self._running: int | None = None  # the token of the shard now in engine.generate
        self._guard = threading.Lock()
        self._reported = 0  # draft=online: the head version last sent to the driver

    def info(self) -> dict:
        import ray

        eng, node = self.engine, ray.util.get_node_ip_address()
        mine = dict(index=self.index, incarnation=self.incarnation, pid=os.getpid(), node=node, threads=self.threads)
        limits = dict(max_batch_size=eng.max_batch_size, strict_on_policy=eng.strict_on_policy)
        engine = dict(weight_version=eng.weight_version, vocab_size=eng.gen.core.vocab_size)
        return mine | limits | engine | dict(head_version=None if eng.learner is None else eng.learner.version)

    def encode(self, prompts: list, chat: bool) -> list[list[int]]:
        """Every prompt as token ids, checked (ValueError naming the prompt)."""
        out = []
        for k, p in enumerate(prompts):
            try:
                out.append(self.engine.gen.core.encode(p, chat))
            except ValueError as e:
                raise ValueError(f"prompt {k}: {e}") from None
        return out

    def generate(self, token: int, req: RolloutRequest) -> tuple[list[Rollout], SpecStats, dict | None]:
        """The shard's rollouts, their stats, and draft=online's training state when the head has a new version."""
        torch.set_num_threads(self.threads)  # this thread's OpenMP setting (actor methods run on a pool thread)
        with self._guard:
            self._running = token
        try:
            outs = self.engine.generate(req.prompts, req.n, req.params, **req.options)
        finally:
            with self._guard:
                self._running = None
        learner, head = self.engine.learner, None
        if learner is not None and learner.version != self._reported:
            head, self._reported = learner.state(), learner.version
        return outs, self.engine.last_stats, head

    def abort(self, token: int) -> bool:
        with self._guard:
            if self._running != token:
                return False
            self.engine.abort()
            return True

    def update(self, update, version: int | None) -> tuple[WeightUpdate, tuple[str, ...]]:
        """Apply one update (a payload dict — the ObjectRef resolved by Ray — or a checkpoint path); take the
        cluster's weight version unless it is None."""
        items = list(load_safetensors_dir(update)) if isinstance(update, str) else from_payload(update)
        rep = self.engine.update_weights(items)
        if version is not None:
            self.engine.weight_version = version
        return replace(rep, version=version), tuple(name for name, _ in items)

    def restore(self, version: int | None, *updates, head: dict | None = None) -> dict:
        """A new incarnation: replay the updates that define the current weights, take the cluster's version, and
        continue the online head from `head` (the training state its predecessor last reported)."""
        self.engine.weight_version = -1  # until every update is replayed: a partial replay never looks current
        done = [self.update(u, None)[0] for u in updates]
        if head is not None and self.engine.learner is not None:
            self._reported = self.engine.learner.load_state(head)
        self.engine.weight_version = version if version is not None else 0
        return self.info() | {"replayed": [replace(d, version=self.engine.weight_version) for d in done]}

    def save_draft(self, folder: str) -> str:
        """draft=online: this replica's head, written on its node (`RolloutEngine.save_draft`)."""
        return str(self.engine.save_draft(folder))


@dataclass
class _Slot:
    index: int
    actor: object
    incarnation: int = 0
    failed_restarts: int = 0  # in a row
    info: dict = field(default_factory=dict)
    head: dict | None = None  # draft=online: the training state its replica last reported (a restart resumes it)


def _split(count: int, parts: int) -> list[range]:
    """0..count-1 in `parts` contiguous, near-equal ranges (the larger first)."""
    size, extra = divmod(count, parts)
    bounds = itertools.accumulate((size + (k < extra) for k in range(parts)), initial=0)
    return [range(a, b) for a, b in itertools.pairwise(bounds)]


class _ShardRun:
    """One request's shards over the replicas: the next shard to the first replica free; a shard whose replica
    died is queued again (at most max_shard_retries times) while a restore brings a new replica to the current
    weights. `inflight` maps each future to (slot, shard index or None for a restore, abort token)."""

    def __init__(self, cluster: RolloutCluster, shards: list[RolloutRequest]):
        self.cluster, self.shards = cluster, shards
        self.pending = deque(range(len(shards)))
        self.losses = [0] * len(shards)
        self.results: list = [None] * len(shards)
        self.idle = deque(cluster._slots)
        self.inflight: dict = {}

    def run(self) -> list[tuple[list[Rollout], SpecStats]]:
        """Every shard's (rollouts, stats), in shard order."""
        try:
            while self.pending or any(k is not None for _, k, _ in self.inflight.values()):
                while self.idle and self.pending:
                    slot, k, token = self.idle.popleft(), self.pending.popleft(), next(self.cluster._tokens)
                    self.inflight[slot.actor.generate.remote(token, self.shards[k])] = (slot, k, token)
                (ref,), _ = _ray().wait(list(self.inflight), num_returns=1)
                self._collect(ref)
            for ref, (slot, _, _) in self.inflight.copy().items():  # restores still running
                del self.inflight[ref]
                while ref is not None:
                    ref = self.cluster._took(slot, ref)
        except BaseException:
            self._settle()
            raise
        return self.results

    def _collect(self, ref) -> None:
        slot, k, _ = self.inflight.pop(ref)
        if k is None:  # a restore
            again = self.cluster._took(slot, ref)
            if again is None:
                self.idle.append(slot)
            else:
                self.inflight[again] = (slot, None, None)
            return
        try:
            out = _ray().get(ref)
        except Exception as e:
            if not _lost(e):
                _reraise(e)  # the engine's own error
            self.losses[k] += 1
            if self.losses[k] > self.cluster.max_shard_retries:
                first, last = self.shards[k].prompt_indices[0], self.shards[k].prompt_indices[-1]
                raise ReplicaLostError(
                    f"shard {k} (prompts {first}..{last}) lost its replica {self.losses[k]} times "
                    f"(max_shard_retries={self.cluster.max_shard_retries}); last: {e}"
                ) from e
            self.pending.appendleft(k)
            self.inflight[self.cluster._restart(slot, e)] = (slot, None, None)
            return
        expected = len(self.shards[k].prompts) * self.shards[k].n
        if len(out[0]) != expected:
            raise RuntimeError(f"shard {k} returned {len(out[0])} rollouts, expected {expected}")
        self.results[k] = out[:2]
        if out[2] is not None:
            slot.head = out[2]
        self.idle.append(slot)

    def _settle(self) -> None:
        """After an error: abort the running shards, wait for them and for restores (a replica that died restarted);
        replace replicas that did not stop within _SETTLE_SECONDS. Leaves every replica idle."""
        cluster, inflight = self.cluster, self.inflight
        deadline = time.monotonic() + _SETTLE_SECONDS
        with contextlib.suppress(Exception):  # never hide the error being raised
            while inflight and time.monotonic() < deadline and not cluster._closed:
                for slot, k, token in inflight.values():  # repeated: an abort can land before its shard starts
                    if k is not None:
                        slot.actor.abort.remote(token)
                done, _ = _ray().wait(list(inflight), num_returns=len(inflight), timeout=1.0)
                for ref in done:
                    slot, k, _ = inflight.pop(ref)
                    with contextlib.suppress(Exception):  # an aborted shard's result or error: nothing to keep
                        again = cluster._took(slot, ref) if k is None else cluster._restart_if_lost(slot, ref)
                        if again is not None:
                            inflight[again] = (slot, None, None)
            for slot, _, _ in inflight.values():  # still busy: replace
                cluster._replace(slot)


def _init_ray(address: str | None, replicas: int, cpus: float, startup_timeout: float | None):
    """Ray, initialized (`ray.init(address=address)` when it is not yet; RuntimeError without an address), with a
    warning where it has fewer CPUs than the replicas ask for."""
    ray = _ray()
    if not ray.is_initialized():
        if address is None:
            raise RuntimeError(
                "Ray is not initialized: call ray.init() (a local instance; e.g. ray.init(num_cpus=8)) or "
                'ray.init(address="auto") (a running Ray cluster) first, or pass RolloutCluster(address=...)'
            )
        ray.init(address=address)
    total = ray.cluster_resources().get("CPU", 0.0)
    if total < replicas * cpus:
        warnings.warn(
            f"the Ray cluster has {total:g} CPUs and {replicas} replicas need {replicas * cpus:g}: they wait for an "
            f"autoscaler to add nodes, up to startup_timeout={startup_timeout}s",
            stacklevel=3,  # RolloutCluster's caller
        )
    return ray


class RolloutCluster(contextlib.AbstractContextManager):
    """N rollout replicas as Ray actors, behind one `generate` and one `update_weights` (a context manager: `with`
    shuts it down; not thread-safe: one driver thread calls it at a time).

    ```python
    with RolloutCluster(EngineSpec(path, config="draft=self,quant=int4,gamma=4"), num_replicas=4) as cluster:
        outs = cluster.generate(prompt_ids, n=8, params=SamplingParams(temperature=1.0), seed=step)
        cluster.update_weights(policy.named_parameters())
    ```

    Args:
        factory: A picklable zero-argument callable returning a RolloutEngine, called inside each replica
            (`EngineSpec` for models on disk or the hub); every replica must get the same engine and weights.
        num_replicas: Replicas (Ray actors, one process each).
        threads_per_replica: Torch threads and Ray `num_cpus` per replica.
        address: When Ray is not initialized, `ray.init(address=address)` is called ("auto": a running cluster;
            "local": a new local instance).
        shards_per_replica: Shards per replica and request (more balance the load and lose less to a failure;
            fewer give larger batches).
        max_shard_retries: How often one shard may lose its replica, and a replica fail to restart in a row.
        actor_options: More `ray.remote` options for the replicas (num_gpus, resources, scheduling_strategy, e.g.
            "SPREAD" to place replicas on different nodes, runtime_env, ...).
        startup_timeout: Seconds to wait for the replicas to start (a replica that cannot be placed, e.g. too few
            CPUs, would wait forever).

    Raises:
        ValueError: A count out of range, or a factory that is not callable.
        RuntimeError: Ray is not initialized and no address is given, or the replicas do not start in time.
    """

    def __init__(
        self,
        factory: Callable[[], RolloutEngine],
        num_replicas: int = 2,
        threads_per_replica: int = 1,
        *,
        address: str | None = None,
        shards_per_replica: int = 2,
        max_shard_retries: int = 3,
        actor_options: dict | None = None,
        startup_timeout: float | None = 600.0,
    ):
        self.num_replicas = check_count("num_replicas", num_replicas)
        self.threads_per_replica = check_count("threads_per_replica", threads_per_replica)
        self.shards_per_replica = check_count("shards_per_replica", shards_per_replica)
        self.max_shard_retries = check_count("max_shard_retries", max_shard_retries, low=0)
        if not callable(factory):
            raise ValueError(f"factory must be a zero-argument callable returning a RolloutEngine, got {factory!r}")
        options = dict(num_cpus=threads_per_replica, max_restarts=0, max_concurrency=2) | (actor_options or {})
        ray = _init_ray(address, num_replicas, options["num_cpus"], startup_timeout)
        self.last_stats = SpecStats()  # the last generate's pooled speculation figures (wall_time: the driver's)
        self._tokens = itertools.count(1)  # abort tokens, one per shard run
        self._version, self._records = 0, []  # the weight version; the updates that define the current weights
        self._restarts, self._closed, self._broken = 0, False, None  # broken: why the cluster shut itself down
        self._remote, self._factory = ray.remote(_Replica).options(**options), ray.put(factory)
        self._slots = [
            _Slot(i, self._remote.remote(self._factory, threads_per_replica, i, 0)) for i in range(num_replicas)
        ]
        self._start(startup_timeout)

    @property
    def restarts(self) -> int:
        """Replicas replaced so far."""
        return self._restarts

    @property
    def weight_version(self) -> int:
        """The version of the current weights: every replica's `weight_version` (and its rollouts')."""
        return self._version

    def replica_info(self) -> list[dict]:
        """Per replica: index, incarnation, pid, node, threads, weight_version, head_version (draft=online; else
        None), max_batch_size, ..."""
        self._check_open()
        return [self._call(slot, "info") for slot in self._slots]

    def save_draft(self, folder: str | os.PathLike, replica: int = 0) -> str:
        """draft=online: one replica's head in the published layout (`RolloutEngine.save_draft`), written by that
        replica on its node (every replica trains its own head on its shards).

        Args:
            folder: The directory to write, as that replica's node sees it.
            replica: Which replica's head.

        Returns:
            The folder.

        Raises:
            ValueError: The engines are not draft=online, or the head has no version yet.
        """
        self._check_open()
        try:
            return self._call(self._slots[replica], "save_draft", os.fspath(folder))
        except _ray().exceptions.RayTaskError as e:
            _reraise(e)

    def generate(
        self,
        prompts: Sequence[Sequence[int]] | Sequence[str] | Sequence[Sequence[dict]],
        n: int = 1,
        params: SamplingParams = SamplingParams(),
        **options,
    ) -> list[Rollout]:
        """`RolloutEngine.generate` over the replicas: n samples of every prompt. Sets `last_stats`.

        Args:
            prompts: Token id lists, texts or chat messages (templated when chat=True).
            n: Samples per prompt.
            params: How to sample.
            **options (Any): As `RolloutEngine.generate`'s: max_new_tokens, seed (None: one is drawn here, shared
                by every shard), stop, chat, ignore_eos, prompt_indices.

        Returns:
            n Rollouts per prompt, in prompt order then sample order.

        Raises:
            ValueError: A bad prompt, n, option or parameter (checked before any shard runs).
            ReplicaLostError: A shard ran out of retries.
        """
        self._check_open()
        req = RolloutRequest(prompts, n, params, **options)
        req.check(self._slots[0].info["max_batch_size"], self._slots[0].info["strict_on_policy"])
        try:  # every prompt checked (token ids against the vocabulary) and tokenized by one replica
            ids = self._call(self._slots[0], "encode", list(prompts), req.chat)
        except _ray().exceptions.RayTaskError as e:
            _reraise(e)
        indices, seed = req.indices(), _draw_seed() if req.seed is None else req.seed
        parts = 1 if self.num_replicas == 1 else min(len(ids), self.shards_per_replica * self.num_replicas)
        shards = [
            replace(
                req, prompts=[ids[i] for i in part], prompt_indices=[indices[i] for i in part], seed=seed, chat=False
            )
            for part in _split(len(ids), parts)
        ]
        t0 = time.perf_counter()
        results = _ShardRun(self, shards).run()
        outs = [o for shard_outs, _ in results for o in shard_outs]
        stale = {o.weight_version for o in outs} - {self._version}
        if stale:  # a guard: every replica takes each update (or the cluster breaks) before it samples again
            self._fail(f"rollouts came back under weight version(s) {sorted(stale)}, not {self._version}")
            raise RuntimeError(f"{self._broken}; the cluster was shut down")
        self.last_stats = SpecStats()
        for _, shard_stats in results:
            self.last_stats.merge(shard_stats)
        self.last_stats.wall_time = time.perf_counter() - t0
        return outs

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[WeightUpdate]:
        """Send new target weights to every replica: one `ray.put`, the same ObjectRef to each (one fetch per node).

        Args:
            named_tensors: (name, tensor) pairs, e.g. `policy.named_parameters()`; send them in the dtype the
                replicas run in.

        Returns:
            Each replica's WeightUpdate; all end at `weight_version` + 1.

        Raises:
            WeightUpdateError: The update was refused (nothing was written).
        """
        self._check_open()
        payload, names = tensors_payload(named_tensors)
        return self._broadcast(_ray().put(payload), frozenset(names))

    def update_weights_from_path(self, path: str | os.PathLike) -> list[WeightUpdate]:
        """Every replica reads a safetensors checkpoint itself.

        Args:
            path: A directory of *.safetensors files, or one file. It must exist, with the same contents, on every
                node, and stay so while later updates have not replaced every tensor it wrote (a restarted replica
                reads it again).

        Returns:
            Each replica's WeightUpdate.

        Raises:
            WeightUpdateError: The update was refused (nothing was written).
        """
        self._check_open()
        return self._broadcast(os.fspath(path), None)

    def _broadcast(self, value, names: frozenset[str] | None) -> list[WeightUpdate]:
        """One update on every replica at once; a replica that died meanwhile is replaced (with the update replayed
        when the others took it). Refused by all: re-raised; refused by some: the cluster breaks."""
        ray, version = _ray(), self._version + 1
        done, dead, refused = {}, [], []
        for slot, fut in [(s, s.actor.update.remote(value, version)) for s in self._slots]:
            try:
                done[slot.index] = ray.get(fut)
            except Exception as e:
                (dead if _lost(e) else refused).append((slot, e))
        if refused and done:  # identical replicas cannot disagree; if they did, the weights now differ
            self._fail(f"replicas disagree on weight update {version}")
            raise RuntimeError(
                f"{len(done)} replica(s) took weight update {version} and {len(refused)} refused it: the replicas' "
                f"weights differ; make a new cluster. First refusal: {refused[0][1]}"
            ) from refused[0][1]
        if not refused:
            self._version = version
            if names is None and done:  # a checkpoint's: the names a replica read
                names = frozenset(next(iter(done.values()))[1])
            self._keep((value, names))
        for slot, e in dead:  # (refused: the live replicas kept their weights; the dead come back at those)
            self._replace(slot, e)
            done[slot.index] = (slot.info["replayed"][-1], ())
        if refused:
            _reraise(refused[0][1])
        return [done[s.index][0] for s in self._slots]

    def _keep(self, record: tuple[object, frozenset[str] | None]) -> None:
        """Add an update (a payload ObjectRef or a checkpoint path, and its names) to those a new replica replays;
        drop the ones later updates overwrite entirely."""
        kept, covered = [], set()
        for r in reversed([*self._records, record]):
            if r is record or r[1] is None or not r[1] <= covered:
                kept.append(r)
            covered |= r[1] or set()
        self._records = kept[::-1]

    # --- the replicas: start, restart, lifetime ----------------------------------------------------------------
    def _start(self, timeout: float | None) -> None:
        """Wait for every replica's engine (its first restore); the weight version is theirs, which must agree."""
        ray = _ray()
        try:
            infos = ray.get([s.actor.restore.remote(None) for s in self._slots], timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            self.shutdown()
            raise RuntimeError(
                f"the replicas did not start within {timeout:g}s: does the Ray cluster have "
                f"{len(self._slots)} x {self.threads_per_replica} CPUs (and the actor_options' resources) free?"
            ) from None
        except Exception as e:
            self.shutdown()
            raise RuntimeError(f"a replica failed to start: {e}") from e
        for slot, info in zip(self._slots, infos):
            slot.info = info
        versions = {info["weight_version"] for info in infos}
        if len(versions) != 1:
            self.shutdown()
            raise RuntimeError(f"the factory built engines at different weight versions: {sorted(versions)}")
        self._version = versions.pop()

    def _restart(self, slot: _Slot, cause: BaseException | None = None):
        """Replace a slot's replica with a fresh actor; returns the future of its restore (replaying the current
        weights). ReplicaLostError after max_shard_retries failed restarts in a row."""
        self._check_open()  # never start replicas a shut-down cluster would not kill
        if slot.failed_restarts > self.max_shard_retries:
            raise ReplicaLostError(
                f"replica {slot.index} could not be restarted ({slot.failed_restarts} attempts in a row failed)"
            ) from cause
        with contextlib.suppress(Exception):  # already gone
            _ray().kill(slot.actor, no_restart=True)
        slot.incarnation += 1
        self._restarts += 1
        slot.actor = self._remote.remote(self._factory, self.threads_per_replica, slot.index, slot.incarnation)
        return slot.actor.restore.remote(self._version, *[value for value, _ in self._records], head=slot.head)

    def _took(self, slot: _Slot, ref):
        """A restore's future, waited for: None once the replica holds the current weights; the future of a new
        restart where it died. A replay that failed (a checkpoint path gone, OOM) shuts the cluster down."""
        try:
            slot.info, slot.failed_restarts = _ray().get(ref), 0
            return None
        except Exception as e:
            if not _lost(e):
                self._fail(f"replica {slot.index} could not take the current weights back: {e}")
                _reraise(e)
            slot.failed_restarts += 1
            return self._restart(slot, e)

    def _replace(self, slot: _Slot, cause: BaseException | None = None) -> None:
        """Restart a slot's replica and wait until it holds the current weights."""
        ref = self._restart(slot, cause)
        while ref is not None:
            ref = self._took(slot, ref)

    def _restart_if_lost(self, slot: _Slot, ref):
        """A shard's future, waited for: the future of its replica's restart where the replica died, else None."""
        try:
            _ray().get(ref)
        except Exception as e:
            if _lost(e):
                return self._restart(slot, e)
        return None

    def _call(self, slot: _Slot, method: str, *args):
        """method(*args) on a slot's replica, replacing it and calling again when it dies."""
        for _ in range(self.max_shard_retries + 1):
            try:
                return _ray().get(getattr(slot.actor, method).remote(*args))
            except Exception as e:
                if not _lost(e):
                    raise
                self._replace(slot, e)
        raise ReplicaLostError(f"replica {slot.index}: {method} failed {self.max_shard_retries + 1} times")

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"this RolloutCluster was shut down{': ' + self._broken if self._broken else ''}")

    def _fail(self, why: str) -> None:
        """The replicas' weights may differ: shut the cluster down, so no rollout can mix them."""
        self._broken = why
        self.shutdown()

    def shutdown(self) -> None:
        """Kill the replicas (Ray itself keeps running). Idempotent."""
        if not self._closed:
            self._closed, self._records = True, []
            for slot in self._slots:
                with contextlib.suppress(Exception):
                    _ray().kill(slot.actor, no_restart=True)

    def __exit__(self, *exc) -> None:
        self.shutdown()
