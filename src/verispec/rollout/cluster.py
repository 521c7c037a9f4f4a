"""Rollouts on several replicas: `RolloutCluster` runs N `RolloutEngine`s as Ray actors, one process each.

    import ray
    from verispec.rollout.cluster import EngineSpec, RolloutCluster

    ray.init()                                   # or ray.init(address="auto") on a running Ray cluster
    spec = EngineSpec("Qwen/Qwen2.5-1.5B-Instruct", config="draft=self,quant=int4,gamma=4")  # or engine_kwargs=...
    with RolloutCluster(spec, num_replicas=4, threads_per_replica=8) as cluster:
        outs = cluster.generate(prompt_token_ids, n=8, params=SamplingParams(temperature=1.0), seed=0)
        ... trainer step ...
        cluster.update_weights(policy.named_parameters())      # one object-store broadcast to every replica

Design (the driver is the process that holds the `RolloutCluster`; each replica is a `_Replica` actor that
builds its engine with `factory()`, after `torch.set_num_threads(threads_per_replica)`, and asks Ray for
`num_cpus=threads_per_replica`):

generate(prompts, n, ...)  P prompts -> list[Rollout] of P * n, ordered (prompt_index, sample_index).
    Requests are checked on the driver first (n, params, seed, limits, token ids against the vocabulary; text and
    chat prompts are tokenized by one replica) so a bad request raises ValueError before any shard runs.
    The P prompts are cut into S contiguous shards of whole groups (a prompt's n samples stay on one replica:
    its prefill is shared), S = min(P, shards_per_replica * R) for R replicas (1 when R = 1: one batch is
    fastest on one engine). Each shard is `engine.generate(its prompts, n, ..., seed=seed,
    prompt_indices=its global indices)`; every idle replica takes the next shard, and `ray.wait` hands the
    following one to whichever replica finishes first. One request seed (drawn on the driver when None) is
    shared by all shards, so sample j of prompt i always has seed `sample_seed(seed, i, j)`: the result equals
    one engine's `generate(prompts, n, seed=seed)` whenever the engine's samples do not depend on the batch they
    run in — a fixed integer gamma with history=False, or coupling="gumbel". With history=True each replica keeps
    its own `RolloutHistory` (a group's running siblings are always on its replica): samples stay exact under
    the current weights, but are not the same draws as one engine's.

update_weights(named_tensors)  one `ray.put` of {"arrays": {name: contiguous CPU numpy array}, "dtypes":
    {name: torch dtype}} (dtypes numpy lacks, e.g. bfloat16 and the float8s, travel as same-width integers and
    are viewed back), the same ObjectRef passed to every replica: each node's object store fetches the object
    once and the replicas on that node read it zero-copy (torch.from_numpy) into `RolloutEngine.update_weights`.
    The cluster owns the weight version: every replica's `weight_version` is set to the cluster's after each
    update. update_weights_from_path(path) has every replica read a safetensors checkpoint itself: the path
    must exist, with the same contents, on every node (a shared file system).

Recovery  A replica whose process dies (killed, `os._exit`, OOM, its node lost: Ray's RayActorError family,
    OutOfMemoryError, WorkerCrashedError, NodeDiedError) is replaced by a fresh actor (`max_restarts=0`: the
    driver restarts it, not Ray), and its unfinished shard is queued again; a dead shard's partial results are
    never merged — only whole returned shards are. Before the new incarnation gets work it replays the weight
    updates that define the current weights (the driver keeps the ObjectRefs / paths of the updates not yet
    fully overwritten by later ones, normally just the latest) and takes the cluster's weight version. A shard
    that loses its replica more than `max_shard_retries` times raises RuntimeError naming the shard; so does a
    replica that cannot be restarted `max_shard_retries` times in a row, or whose factory fails. An exception
    raised by the engine itself (ValueError and the like) is re-raised to the caller, not retried; the other
    running shards of that request are aborted (`RolloutEngine.abort`) and awaited first, so the replicas are
    idle again.

Requirements: Ray initialized before the cluster is made (or `address=` given, passed to `ray.init`); verispec
importable on every node; `factory` picklable (a module-level class or function, e.g. `EngineSpec`) and
building the same engine, with the same initial weights, on every replica. Not thread-safe: one driver thread
calls a cluster at a time.

Code: `_Replica` is the actor; `_ReplicaSet` holds the replicas (their actors, restarts with the weights replayed,
the cluster's lifetime); `_ShardRun` runs one request's shards over them; `_WeightLog` is the weight version and
the updates a new replica replays; `RolloutCluster` checks requests, merges shards and broadcasts updates (their
payloads: `verispec.model.payload`).
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

from ..drafting.history import RolloutHistory
from ..engine.config import SpecConfig
from ..engine.stats import SpecStats
from ..model.payload import from_payload, tensors_payload
from ..sampling import SamplingParams
from .engine import SPEC_KEYWORDS, Rollout, RolloutEngine, WeightUpdate, check_request, engine_config
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


def _lost_errors() -> tuple[type[BaseException], ...]:
    """The exceptions that mean a replica's process is gone (as opposed to an exception its engine raised)."""
    from ray import exceptions as rex

    return (rex.RayActorError, rex.OutOfMemoryError, rex.WorkerCrashedError, rex.NodeDiedError)


def _check_init(e: BaseException) -> None:
    if getattr(e, "actor_init_failed", False):  # the factory raised: restarting cannot help
        raise RuntimeError(f"a replica failed to start: {e}") from e


def _reraise(e: BaseException):
    """An engine's exception from a replica: raise the original (ValueError, ...), the remote trace as its cause."""
    cause = getattr(e, "cause", None)
    if isinstance(cause, Exception):
        raise cause from e
    raise e


# --- factories ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EngineSpec:
    """A picklable factory of rollout engines, for `RolloutCluster`: `EngineSpec(...)()` loads the models with
    `verispec.model.load_model` and returns `RolloutEngine(target, draft model, config=config, **engine_kwargs)`,
    inside each replica.

    ```python
    spec = EngineSpec("Qwen/Qwen2.5-1.5B-Instruct", config="draft=self,quant=int4,gamma=4")
    ```

    Attributes:
        target: A hub id, local directory or .gguf file (as `load_model`; it must be reachable from every node).
        draft: Older spelling, with the speculation keywords among engine_kwargs (`SPEC_KEYWORDS`: draft_quant,
            history, gamma, ...): None, "self" or a draft model's path. The spec then holds the config built from
            them instead.
        engine_kwargs: RolloutEngine's other arguments (max_batch_size, strict_on_policy).
        load_kwargs: Arguments of both `load_model` calls (dtype, device, ...; on a GPU replica,
            `actor_options={"num_gpus": 1}`, device="cuda" is the GPU Ray assigned it). Leave `threads` out: the
            cluster sets each replica's thread count.
        config: The engines' SpecConfig (or its string form), a draft model named by its path
            (draft=model[+history],model=PATH) and loaded like the target.

    Raises:
        ValueError: The speculation is given twice (config and the older spelling), or a draft model is not named.
    """

    target: str
    draft: str | None = None
    engine_kwargs: dict = field(default_factory=dict)
    load_kwargs: dict = field(default_factory=dict)
    config: SpecConfig | None = None

    def __post_init__(self):
        spelled = {k: v for k, v in self.engine_kwargs.items() if k in SPEC_KEYWORDS}
        if self.config is None:
            config = engine_config(self.draft, spelled)
        elif self.draft is not None or spelled:
            raise ValueError(
                f"give the speculation once: config, or draft and {', '.join(spelled) or 'the keywords'} "
                "(a draft model in the config is model=PATH)"
            )
        else:
            config = SpecConfig.parse(self.config) if isinstance(self.config, str) else self.config
        if not isinstance(config, SpecConfig):
            raise ValueError(f"config must be a SpecConfig or its string form, got {config!r}")
        if config.drafter.model and config.model is None:
            raise ValueError(f"draft={config.draft}: every replica loads the draft model: name it (model=PATH)")
        history = self.engine_kwargs.get("history")
        rest = {k: v for k, v in self.engine_kwargs.items() if k not in SPEC_KEYWORDS}
        rest |= {"history": history} if isinstance(history, RolloutHistory) else {}  # a history to start from
        object.__setattr__(self, "config", config)
        object.__setattr__(self, "draft", None)
        object.__setattr__(self, "engine_kwargs", rest)

    def __call__(self) -> RolloutEngine:
        from ..model.loading import load_model

        target = load_model(self.target, **self.load_kwargs)
        model = load_model(self.config.model, **self.load_kwargs) if self.config.drafter.model else None
        return RolloutEngine(target, model, config=self.config, **self.engine_kwargs)


# --- the actor --------------------------------------------------------------------------------------------------


class _Replica:
    """One rollout engine in its own process (made a Ray actor by `RolloutCluster`; two threads: a running
    generate can be aborted). The driver sends it at most one piece of work at a time."""

    def __init__(self, factory: Callable[[], RolloutEngine], threads: int, index: int, incarnation: int):
        torch.set_num_threads(threads)
        self.threads, self.index, self.incarnation = threads, index, incarnation
        engine = factory()
        if not isinstance(engine, RolloutEngine):
            raise TypeError(f"the factory must return a RolloutEngine, got {type(engine).__name__}")
        self.engine = engine
        self._running: int | None = None  # the token of the shard now in engine.generate
        self._guard = threading.Lock()

    def info(self) -> dict:
        import ray

        eng = self.engine
        return dict(
            index=self.index,
            incarnation=self.incarnation,
            pid=os.getpid(),
            node=ray.util.get_node_ip_address(),
            threads=self.threads,
            weight_version=eng.weight_version,
            max_batch_size=eng.max_batch_size,
            strict_on_policy=eng.strict_on_policy,
            vocab_size=eng.gen.vocab_size,
        )

    def encode(self, prompts: list, chat: bool) -> list[list[int]]:
        return [self.engine.gen.encode(p, chat) for p in prompts]

    def generate(self, token: int, prompts: list[list[int]], indices: list[int], kwargs: dict):
        torch.set_num_threads(self.threads)  # this thread's OpenMP setting (actor methods run on a pool thread)
        with self._guard:
            self._running = token
        try:
            outs = self.engine.generate(prompts, prompt_indices=indices, **kwargs)
            return outs, self.engine.last_stats
        finally:
            with self._guard:
                self._running = None

    def abort(self, token: int) -> bool:
        with self._guard:
            if self._running != token:
                return False
            self.engine.abort()
            return True

    def _apply(self, update, version: int | None) -> tuple[WeightUpdate, tuple[str, ...]]:
        if isinstance(update, str):
            from ..model.weights import load_safetensors_dir

            items = list(load_safetensors_dir(update))
        else:
            items = from_payload(update)
        rep = self.engine.update_weights(items)
        if version is not None:
            self._set_version(version)
        return replace(rep, version=version), tuple(name for name, _ in items)

    def _set_version(self, version: int) -> None:
        """Take the cluster's weight version (the engine counts its own updates; its generator's core holds it)."""
        self.engine.gen.core.weight_version = version

    def update(self, update, version: int) -> tuple[WeightUpdate, tuple[str, ...]]:
        """Apply one update (a payload dict — the ObjectRef resolved by Ray — or a checkpoint path)."""
        return self._apply(update, version)

    def restore(self, version: int | None, *updates) -> dict:
        """A new incarnation: replay the updates that define the current weights, take the cluster's version."""
        self._set_version(-1)  # until every update is replayed: a partial replay never looks current
        done = [self._apply(u, None)[0] for u in updates]
        self._set_version(version if version is not None else 0)
        done = [replace(d, version=self.engine.weight_version) for d in done]
        return self.info() | {"replayed": done}


# --- the weights ---------------------------------------------------------------------------------------------


@dataclass
class _Record:
    """An update the current weights depend on: a payload ObjectRef or a checkpoint path, and its names."""

    value: object
    names: frozenset[str] | None


class _WeightLog:
    """The cluster's weight version and the updates that define the current weights (a new replica replays them)."""

    def __init__(self):
        self.version = 0
        self.records: list[_Record] = []

    def keep(self, record: _Record) -> None:
        """Add the update to those a new replica replays; drop the ones later updates overwrite entirely."""
        records = [*self.records, record]
        kept: list[_Record] = []
        covered: set[str] = set()
        for r in reversed(records):
            if r is record or r.names is None or not r.names <= covered:
                kept.append(r)
            if r.names is not None:
                covered |= r.names
        self.records = kept[::-1]


# --- the replicas --------------------------------------------------------------------------------------------


@dataclass
class _Slot:
    index: int
    actor: object
    incarnation: int = 0
    failed_restarts: int = 0  # in a row
    info: dict = field(default_factory=dict)


class _ReplicaSet:
    """The replicas: one slot each, its actor replaced when its process dies (at most `max_retries` failed
    restarts in a row), the weights of `weights` replayed into every new one; and the cluster's lifetime (closed:
    the actors are killed and no new one starts; broken: why it shut itself down)."""

    def __init__(self, factory, count: int, threads: int, options: dict, max_retries: int, weights: _WeightLog):
        ray = _ray()
        self.threads, self.max_retries, self.weights = threads, max_retries, weights
        self.restarts = 0  # replicas replaced so far
        self.closed = False
        self.broken: str | None = None  # why the cluster shut itself down (replicas whose weights may differ)
        self._options = options
        self._remote = ray.remote(_Replica)
        self._factory = ray.put(factory)
        self.slots: list[_Slot] = [_Slot(i, self._new_actor(i, 0)) for i in range(count)]

    def start(self, timeout: float | None) -> None:
        """Wait for every replica's engine (its first restore); the weight version is theirs, which must agree."""
        ray = _ray()
        try:
            infos = ray.get([s.actor.restore.remote(None) for s in self.slots], timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            self.shutdown()
            raise RuntimeError(
                f"the replicas did not start within {timeout:g}s: does the Ray cluster have "
                f"{len(self.slots)} x {self.threads} CPUs (and the actor_options' resources) free?"
            ) from None
        except Exception as e:
            self.shutdown()
            raise RuntimeError(f"a replica failed to start: {e}") from e
        for slot, info in zip(self.slots, infos):
            slot.info = info
        versions = {info["weight_version"] for info in infos}
        if len(versions) != 1:
            self.shutdown()
            raise RuntimeError(f"the factory built engines at different weight versions: {sorted(versions)}")
        self.weights.version = versions.pop()

    def _new_actor(self, index: int, incarnation: int):
        return self._remote.options(**self._options).remote(self._factory, self.threads, index, incarnation)

    def restart(self, slot: _Slot, cause: BaseException | None = None):
        """Replace a slot's replica with a fresh actor; returns the future of its restore (replaying the current
        weights). ReplicaLostError after max_retries failed restarts in a row."""
        ray = _ray()
        self.check_open()  # never start replicas a shut-down cluster would not kill
        if slot.failed_restarts > self.max_retries:
            raise ReplicaLostError(
                f"replica {slot.index} could not be restarted ({slot.failed_restarts} attempts in a row failed)"
            ) from cause
        with contextlib.suppress(Exception):  # already gone
            ray.kill(slot.actor, no_restart=True)
        slot.incarnation += 1
        self.restarts += 1
        slot.actor = self._new_actor(slot.index, slot.incarnation)
        return slot.actor.restore.remote(self.weights.version, *[r.value for r in self.weights.records])

    def restored(self, slot: _Slot, ref) -> None:
        """Wait for a restart's restore; on a lost replica, restart again (bounded)."""
        ray = _ray()
        while True:
            try:
                slot.info = ray.get(ref)
                slot.failed_restarts = 0
                return
            except _lost_errors() as e:
                _check_init(e)
                slot.failed_restarts += 1
                ref = self.restart(slot, e)
            except Exception as e:  # the replay itself failed (a checkpoint path gone, OOM): its weights are wrong
                self.fail(f"replica {slot.index} could not take the current weights back after a restart: {e}")
                raise

    def replace(self, slot: _Slot, cause: BaseException | None = None) -> None:
        """Restart a slot's replica and wait until it holds the current weights."""
        self.restored(slot, self.restart(slot, cause))

    def call(self, slot: _Slot, method: str, *args):
        """method(*args) on a slot's replica, replacing it and calling again when it dies."""
        ray = _ray()
        for _ in range(self.max_retries + 1):
            try:
                return ray.get(getattr(slot.actor, method).remote(*args))
            except _lost_errors() as e:
                _check_init(e)
                self.replace(slot, e)
        raise ReplicaLostError(f"replica {slot.index}: {method} failed {self.max_retries + 1} times")

    def update_all(self, value, version: int) -> tuple[dict, list, list]:
        """`update(value, version)` on every replica at once: ({index: (WeightUpdate, names)} of those that took
        it, [(slot, error)] of those that died, [error] of the refusals)."""
        ray = _ray()
        futures = [s.actor.update.remote(value, version) for s in self.slots]
        done: dict[int, tuple[WeightUpdate, tuple[str, ...]]] = {}
        dead: list[tuple[_Slot, BaseException]] = []
        refused: list[BaseException] = []
        for slot, fut in zip(self.slots, futures):
            try:
                done[slot.index] = ray.get(fut)
            except _lost_errors() as e:
                _check_init(e)
                dead.append((slot, e))
            except ray.exceptions.RayTaskError as e:
                refused.append(e)
        return done, dead, refused

    # --- lifetime -------------------------------------------------------------------------------------------------
    def check_open(self) -> None:
        if self.closed:
            raise RuntimeError(f"this RolloutCluster was shut down{': ' + self.broken if self.broken else ''}")

    def fail(self, why: str) -> None:
        """The replicas' weights may differ: shut the cluster down, so no rollout can mix them."""
        self.broken = why
        self.shutdown()

    def shutdown(self) -> None:
        if self.closed:
            return
        self.closed = True
        ray = _ray()
        for slot in self.slots:
            with contextlib.suppress(Exception):
                ray.kill(slot.actor, no_restart=True)
        self.weights.records = []


# --- sharding --------------------------------------------------------------------------------------------------


def _split(count: int, parts: int) -> list[range]:
    """0..count-1 in `parts` contiguous, near-equal ranges (the larger first)."""
    size, extra = divmod(count, parts)
    out, start = [], 0
    for k in range(parts):
        stop = start + size + (k < extra)
        out.append(range(start, stop))
        start = stop
    return out


def _is_token_ids(p) -> bool:
    return isinstance(p, Sequence) and not isinstance(p, str) and all(isinstance(t, int) for t in p)


class _ShardRun:
    """One request's shards over the replicas: the next shard to the first replica free; a shard whose replica
    died is queued again (at most max_retries times) while a restore brings a new replica to the current weights.
    `inflight` maps each future to (slot, shard index or None for a restore, abort token)."""

    def __init__(self, replicas: _ReplicaSet, tokens, ids: list[list[int]], shards: list[range], n: int, kwargs):
        self.replicas, self.tokens = replicas, tokens
        self.ids, self.shards, self.n, self.kwargs = ids, shards, n, kwargs
        self.pending = deque(range(len(shards)))
        self.losses = [0] * len(shards)
        self.results: list = [None] * len(shards)
        self.idle = deque(replicas.slots)
        self.inflight: dict = {}

    def run(self) -> list:
        """Every shard's (rollouts, stats), in shard order."""
        ray = _ray()
        try:
            while self.pending or any(k is not None for _, k, _ in self.inflight.values()):
                self._dispatch()
                (ref,), _ = ray.wait(list(self.inflight), num_returns=1)
                self._collect(ref)
            for ref, (slot, _, _) in list(self.inflight.items()):  # restores still running: a replica works in order
                self.inflight.pop(ref)
                self.replicas.restored(slot, ref)
        except BaseException:
            self._settle()
            raise
        return self.results

    def _dispatch(self) -> None:
        while self.idle and self.pending:
            slot, k = self.idle.popleft(), self.pending.popleft()
            token = next(self.tokens)
            shard = self.shards[k]
            ref = slot.actor.generate.remote(token, [self.ids[i] for i in shard], list(shard), self.kwargs)
            self.inflight[ref] = (slot, k, token)

    def _collect(self, ref) -> None:
        ray = _ray()
        slot, k, _ = self.inflight.pop(ref)
        try:
            out = ray.get(ref)
        except _lost_errors() as e:
            self._lost(slot, k, e)
            return
        except ray.exceptions.RayTaskError as e:
            if k is None:  # a restarted replica could not take the current weights back
                self.replicas.fail(f"replica {slot.index} could not take the current weights back: {e}")
            _reraise(e)
        if k is None:
            slot.info, slot.failed_restarts = out, 0
        else:
            expected = len(self.shards[k]) * self.n
            if len(out[0]) != expected:
                raise RuntimeError(f"shard {k} returned {len(out[0])} rollouts, expected {expected}")
            self.results[k] = out
        self.idle.append(slot)

    def _lost(self, slot: _Slot, k: int | None, e: BaseException) -> None:
        """A replica died under a shard (queued again) or a restore (counted against the slot): restart it."""
        _check_init(e)
        if k is None:
            slot.failed_restarts += 1
        else:
            self.losses[k] += 1
            if self.losses[k] > self.replicas.max_retries:
                first, last = self.shards[k][0], self.shards[k][-1]
                raise ReplicaLostError(
                    f"shard {k} (prompts {first}..{last}) lost its replica {self.losses[k]} times "
                    f"(max_shard_retries={self.replicas.max_retries}); last: {e}"
                ) from e
            self.pending.appendleft(k)
        self.inflight[self.replicas.restart(slot, e)] = (slot, None, None)

    def _settle(self) -> None:
        """After an error: abort the running shards, wait for them and for restores; replace replicas that died or
        did not stop within _SETTLE_SECONDS. Leaves every replica idle."""
        ray = _ray()
        replicas, inflight = self.replicas, self.inflight
        deadline = time.monotonic() + _SETTLE_SECONDS
        try:
            while inflight and time.monotonic() < deadline and not replicas.closed:
                for slot, k, token in inflight.values():  # repeated: an abort can land before its shard starts
                    if k is not None:
                        slot.actor.abort.remote(token)
                done, _ = ray.wait(list(inflight), num_returns=len(inflight), timeout=1.0)
                for ref in done:
                    self._settled(ref)
            if replicas.closed:
                return
            for slot, _, _ in inflight.values():  # still busy: replace
                replicas.replace(slot)
        except Exception:  # never hide the error being raised
            pass

    def _settled(self, ref) -> None:
        """One future done while settling: keep a restore's info, restart a replica that died."""
        ray = _ray()
        slot, k, _ = self.inflight.pop(ref)
        try:
            out = ray.get(ref)
            if k is None:
                slot.info, slot.failed_restarts = out, 0
        except _lost_errors() as e:
            if not getattr(e, "actor_init_failed", False):
                slot.failed_restarts += k is None
                self.inflight[self.replicas.restart(slot, e)] = (slot, None, None)
        except Exception as e:  # the engine's own error, or an aborted shard's: nothing to keep
            if k is None:  # but a failed weight replay leaves a replica with wrong weights
                self.replicas.fail(f"replica {slot.index} could not take the current weights back: {e}")


# --- the cluster -------------------------------------------------------------------------------------------------


def _check_counts(**counts: tuple[int, int]) -> None:
    for name, (value, low) in counts.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")


def _init_ray(address: str | None):
    """Ray, initialized: `ray.init(address=address)` when it is not yet, RuntimeError without an address."""
    ray = _ray()
    if not ray.is_initialized():
        if address is None:
            raise RuntimeError(
                "Ray is not initialized: call ray.init() (a local instance; e.g. ray.init(num_cpus=8)) or "
                'ray.init(address="auto") (a running Ray cluster) first, or pass RolloutCluster(address=...)'
            )
        ray.init(address=address)
    return ray


def _warn_capacity(ray, num_replicas: int, cpus: float, startup_timeout: float | None) -> None:
    need = num_replicas * cpus
    total = ray.cluster_resources().get("CPU", 0.0)
    if total < need:
        warnings.warn(
            f"the Ray cluster has {total:g} CPUs and {num_replicas} replicas need {need:g}: they wait for an "
            f"autoscaler to add nodes, up to startup_timeout={startup_timeout}s",
            stacklevel=3,  # RolloutCluster's caller
        )


class RolloutCluster(contextlib.AbstractContextManager):
    """N rollout replicas as Ray actors, behind one `generate` and one `update_weights`.

    A batch of prompts is sharded over the replicas by whole groups (a prompt's n samples stay on one replica);
    every shard carries its prompts' global indices, so the results are one engine's for the same seed whenever
    samples do not depend on their batch. A replica that dies is replaced, gets the current weights back, and its
    shard runs again. A context manager: `with` shuts it down. See the module docstring for what crosses the
    network.

    ```python
    with RolloutCluster(EngineSpec(path, config="draft=self,quant=int4,gamma=4"), num_replicas=4) as cluster:
        outs = cluster.generate(prompt_ids, n=8, params=SamplingParams(temperature=1.0), seed=step)
        cluster.update_weights(policy.named_parameters())
    ```

    Args:
        factory: A picklable zero-argument callable returning a RolloutEngine, called inside each replica
            (`EngineSpec` for models on disk or the hub).
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
        _check_counts(
            num_replicas=(num_replicas, 1),
            threads_per_replica=(threads_per_replica, 1),
            shards_per_replica=(shards_per_replica, 1),
            max_shard_retries=(max_shard_retries, 0),
        )
        if not callable(factory):
            raise ValueError(f"factory must be a zero-argument callable returning a RolloutEngine, got {factory!r}")
        ray = _init_ray(address)
        self.num_replicas, self.threads_per_replica = num_replicas, threads_per_replica
        self.shards_per_replica, self.max_shard_retries = shards_per_replica, max_shard_retries
        self.last_stats = SpecStats()  # the last generate's pooled speculation figures (wall_time: the driver's)
        self._tokens = itertools.count(1)
        self._weights = _WeightLog()
        options = dict(num_cpus=threads_per_replica, max_restarts=0, max_concurrency=2) | (actor_options or {})
        _warn_capacity(ray, num_replicas, options["num_cpus"], startup_timeout)
        self._replicas = _ReplicaSet(
            factory, num_replicas, threads_per_replica, options, max_shard_retries, self._weights
        )
        self._replicas.start(startup_timeout)

    # --- replicas -----------------------------------------------------------------------------------------------
    @property
    def restarts(self) -> int:
        """Replicas replaced so far."""
        return self._replicas.restarts

    def replica_info(self) -> list[dict]:
        """Per replica: index, incarnation, pid, node, threads, weight_version, max_batch_size, ..."""
        self._replicas.check_open()
        return [self._replicas.call(slot, "info") for slot in self._replicas.slots]

    @property
    def weight_version(self) -> int:
        """The version of the current weights: every replica's `weight_version` (and its rollouts')."""
        return self._weights.version

    # --- rollouts -------------------------------------------------------------------------------------------------
    def generate(
        self,
        prompts: Sequence[Sequence[int]] | Sequence[str] | Sequence[Sequence[dict]],
        n: int = 1,
        params: SamplingParams = SamplingParams(),
        *,
        max_new_tokens: int = 256,
        seed: int | None = None,
        stop: str | Sequence[str] | None = (),
        chat: bool = False,
        ignore_eos: bool = False,
    ) -> list[Rollout]:
        """`RolloutEngine.generate` over the replicas: n samples of every prompt. Sets `last_stats`.

        Args:
            prompts: Token id lists, texts or chat messages (templated when chat=True).
            n: Samples per prompt.
            params: How to sample.
            max_new_tokens: Each sample's budget.
            seed: The request seed every sample's seed derives from; None: one is drawn here, shared by every
                shard.
            stop: Stop strings.
            chat: Apply the chat template to text prompts.
            ignore_eos: Generate past EOS.

        Returns:
            n Rollouts per prompt, in prompt order then sample order (`Rollout.prompt_index` is the prompt's
            position in `prompts`).

        Raises:
            ValueError: A bad prompt, n, option or parameter (checked before any shard runs).
            ReplicaLostError: A shard ran out of retries.
        """
        self._replicas.check_open()
        info = self._replicas.slots[0].info
        check_request(prompts, n, params, max_new_tokens, stop, info["max_batch_size"], info["strict_on_policy"], seed)
        if seed is None:
            seed = _draw_seed()
        ids = self._token_ids(list(prompts), chat)
        parts = 1 if self.num_replicas == 1 else min(len(ids), self.shards_per_replica * self.num_replicas)
        kwargs = dict(n=n, params=params, max_new_tokens=max_new_tokens, seed=seed, stop=stop, ignore_eos=ignore_eos)
        t0 = time.perf_counter()
        results = _ShardRun(self._replicas, self._tokens, ids, _split(len(ids), parts), n, kwargs).run()
        stats = SpecStats()
        outs: list[Rollout] = []
        for shard_outs, shard_stats in results:
            outs += shard_outs
            stats.merge(shard_stats)
        version = self._weights.version
        stale = {o.weight_version for o in outs} - {version}
        if stale:  # a guard: every replica takes each update (or the cluster breaks) before it samples again
            self._replicas.fail(f"rollouts came back under weight version(s) {sorted(stale)}, not {version}")
            raise RuntimeError(f"{self._replicas.broken}; the cluster was shut down")
        stats.wall_time = time.perf_counter() - t0
        self.last_stats = stats
        return outs

    def _token_ids(self, prompts: list, chat: bool) -> list[list[int]]:
        """Every prompt as token ids, all checked before any shard runs: token ids here, against the vocabulary;
        text and chat messages tokenized (and checked) by one replica."""
        if not all(_is_token_ids(p) for p in prompts):
            ray = _ray()
            try:
                return self._replicas.call(self._replicas.slots[0], "encode", prompts, chat)
            except ray.exceptions.RayTaskError as e:
                _reraise(e)
        vocab = self._replicas.slots[0].info["vocab_size"]
        for k, p in enumerate(prompts):
            if not len(p):
                raise ValueError(f"prompt {k} is empty")
            if any(isinstance(t, bool) for t in p):
                raise ValueError(f"prompt {k}: token ids must be integers, got a bool")
            if any(not 0 <= t < vocab for t in p):
                raise ValueError(f"prompt {k}: prompt token ids must lie in [0, {vocab})")
        return [[int(t) for t in p] for p in prompts]

    # --- weight updates -------------------------------------------------------------------------------------------
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[WeightUpdate]:
        """Send new target weights to every replica through the object store.

        One `ray.put`, the same ObjectRef to each replica (each node fetches it once); each replica validates and
        copies in place (`RolloutEngine.update_weights`).

        Args:
            named_tensors: (name, tensor) pairs, e.g. `policy.named_parameters()`; send them in the dtype the
                replicas run in.

        Returns:
            Each replica's WeightUpdate; all end at `weight_version` + 1.

        Raises:
            WeightUpdateError: The update was refused (nothing was written).
        """
        self._replicas.check_open()
        payload, names = tensors_payload(named_tensors)
        return self._broadcast(_Record(_ray().put(payload), frozenset(names)))

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
        self._replicas.check_open()
        return self._broadcast(_Record(os.fspath(path), None))

    def _broadcast(self, record: _Record) -> list[WeightUpdate]:
        replicas, version = self._replicas, self._weights.version + 1
        done, dead, refused = replicas.update_all(record.value, version)
        if refused and done:  # identical replicas cannot disagree; if they did, the weights now differ
            replicas.fail(f"replicas disagree on weight update {version}")
            raise RuntimeError(
                f"{len(done)} replica(s) took weight update {version} and {len(refused)} refused it: the replicas' "
                f"weights differ; make a new cluster. First refusal: {refused[0]}"
            ) from refused[0]
        if refused:
            for slot, e in dead:  # nothing changed on the live ones: bring the dead back at the old weights
                replicas.replace(slot, e)
            _reraise(refused[0])
        self._weights.version = version
        if record.names is None and done:
            record.names = frozenset(next(iter(done.values()))[1])
        self._weights.keep(record)
        out: dict[int, WeightUpdate] = {i: rep for i, (rep, _) in done.items()}
        for slot, e in dead:
            replicas.replace(slot, e)
            out[slot.index] = slot.info["replayed"][-1]
        return [out[s.index] for s in replicas.slots]

    # --- lifetime -------------------------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Kill the replicas (Ray itself keeps running). Idempotent."""
        self._replicas.shutdown()

    def __exit__(self, *exc) -> None:
        self.shutdown()
