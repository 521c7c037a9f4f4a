"""`verispec bench replicas`: `bench rollout`'s workload on layouts of (replicas, threads per replica) of a
`RolloutCluster`, side by side in one run; what it measures: docs/benchmarks.md, "What each benchmark measures"."""

from __future__ import annotations

import operator
import os
import platform
import time
from dataclasses import asdict, dataclass, replace

import torch

from ..rollout.cluster import EngineSpec, RolloutCluster
from ..sampling import SamplingParams
from .harness import bars, ratio_to, report_head, side_by_side, started, table
from .rollout import METHODS, RolloutBenchConfig, RolloutWorkloadConfig, method_config, timed_generate

__all__ = ["ReplicasBenchConfig", "engine_spec", "machine", "plot", "run_replicas_bench", "to_markdown"]

WARMUP_PROMPT = "Say hello."


@dataclass(frozen=True)
class ReplicasBenchConfig(RolloutWorkloadConfig):
    group: int = 4
    num_prompts: int = 2
    max_new_tokens: int = 64
    methods: tuple[str, ...] = ("plain", "history")
    layouts: tuple[tuple[int, int], ...] = ((1, 1), (2, 1))  # (replicas, threads per replica)
    threads: int = 1  # threads per replica of the layouts given as a replica count alone (and of the baseline)
    shards_per_replica: int = 2
    warmup_tokens: int = 4
    dtype: str = "float32"
    device: str = "cpu"

    def __post_init__(self):
        unknown = [m for m in self.methods if m not in METHODS]
        if not self.methods or unknown:
            raise ValueError(f"unknown method(s) {', '.join(unknown)}; choose from {', '.join(METHODS)}")
        if not self.layouts or any(r < 1 or t < 1 for r, t in self.layouts):
            raise ValueError(f"layouts must be (replicas >= 1, threads >= 1) pairs, got {self.layouts!r}")


def engine_spec(method: str, target: str, draft: str | None, cfg: ReplicasBenchConfig):
    """The `EngineSpec` of a method (as `verispec bench rollout` builds its engines; the draft model by its path)."""
    config = method_config(method, cfg, RolloutBenchConfig())  # the history trie's defaults
    if config.drafter.model:
        if draft is None:
            raise ValueError(f"method {method!r} needs --draft")
        config = replace(config, model=draft)
    load = dict(dtype=cfg.dtype, device=cfg.device)
    return EngineSpec(target, config, dict(max_batch_size=cfg.group * cfg.num_prompts), load)


def machine() -> dict:
    """What the numbers were measured on."""
    import ray

    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()  # Linux or not
    found = dict(cpu_count=os.cpu_count(), usable_cores=usable, processor=platform.processor() or platform.machine())
    found |= dict(platform=platform.platform(), python=platform.python_version(), torch=torch.__version__)
    return found | dict(ray=ray.__version__, load_average_start=_load())


def _load() -> list[float] | None:
    return list(os.getloadavg()) if hasattr(os, "getloadavg") else None


def run_replicas_bench(target: str, target_name: str, draft, prompts: dict, cfg: ReplicasBenchConfig, log=print):
    """Every method on every layout (Ray must be initialized, with CPUs for the largest layout)."""
    result, info = started(), machine()  # the code, date and command at the start of the run
    options = dict(params=SamplingParams(temperature=cfg.temperature), seed=cfg.seed, chat=cfg.chat, ignore_eos=True)
    texts = {c: ps[: cfg.num_prompts] for c, ps in prompts.items()}
    records, startups = [], []
    for method in cfg.methods:
        spec = engine_spec(method, target, draft, cfg)
        for replicas, threads in cfg.layouts:
            t0 = time.perf_counter()
            with RolloutCluster(spec, replicas, threads, shards_per_replica=cfg.shards_per_replica) as cluster:
                started_s = time.perf_counter() - t0
                layout = dict(method=method, replicas=replicas, threads=threads, startup_seconds=started_s)
                warmup = [WARMUP_PROMPT] * replicas  # one shard per replica
                warm = timed_generate(cluster, warmup, n=1, max_new_tokens=cfg.warmup_tokens, **options)[1]["seconds"]
                startups.append(layout | {"warmup_seconds": warm})
                log(f"{method} {replicas}x{threads}: started in {layout['startup_seconds']:.1f}s, warm-up {warm:.1f}s")
                measure = lambda m, case: _measure(cluster, texts[case["category"]], options, cfg)  # noqa: E731
                cases = [dict(category=c, replicas=replicas, threads=threads) for c in texts]
                records += side_by_side(cases, [method], measure, log)
    base = {"replicas": 1, "threads": cfg.threads}
    ratio_to(records, base, "tokens_per_s", ("method", "category"), "ratio_to_1_replica")
    ratio_to(records, base, "token_ids", ("method", "category"), "same_tokens_as_1_replica", op=operator.eq)
    for r in records:
        del r["token_ids"]
    info["load_average_end"] = _load()
    extra = dict(config=asdict(cfg), target=target_name, draft=draft, machine=info)
    return result | extra | dict(records=records, totals=_totals(records, cfg.threads), startups=startups)


def _measure(cluster, texts, options: dict, cfg) -> dict:
    """One category's generate call: its figures, and its token ids (compared across layouts, then dropped)."""
    outs, timed = timed_generate(cluster, texts, n=cfg.group, max_new_tokens=cfg.max_new_tokens, **options)
    st = cluster.last_stats
    tokens = [o.completion_token_ids for o in outs]
    return timed | dict(target_passes=st.target_passes, accepted=st.accepted, token_ids=tokens)


def _totals(records: list[dict], threads: int) -> list[dict]:
    """Per method and layout, over every category: tokens / seconds."""
    out: dict[tuple, dict] = {}
    for r in records:
        key = (r["method"], r["replicas"], r["threads"])
        t = out.setdefault(key, dict(method=key[0], replicas=key[1], threads=key[2], tokens=0, seconds=0.0, passes=0))
        t["tokens"] += r["tokens"]
        t["seconds"] += r["seconds"]
        t["passes"] += r["target_passes"]
    rows = list(out.values())
    for t in rows:
        t["tokens_per_s"] = t["tokens"] / t["seconds"]
        t["tau"] = t["tokens"] / max(t.pop("passes"), 1)
    ratio_to(rows, {"replicas": 1, "threads": threads}, "tokens_per_s", ("method",), "ratio_to_1_replica")
    return rows


LAYOUT = ["method", "replicas", ("threads each", "threads")]
FIGURES = [("tokens/s", "tokens_per_s", ".2f"), ("x 1 replica", "ratio_to_1_replica", ".2f")]
FIGURES += [("wall s", "seconds", ".1f"), ("tau", "tau", ".2f")]
SAME = ("same tokens as 1 replica", lambda r: {None: None, True: "yes", False: "no"}[r["same_tokens_as_1_replica"]])


def to_markdown(result: dict) -> str:
    cfg, m = result["config"], result["machine"]
    load = m.get("load_average_start")
    lines = report_head(
        result,
        f"bench replicas: target {result['target']}, draft {result['draft']}, G = {cfg['group']} x "
        f"{cfg['num_prompts']} prompt(s) per category, {cfg['max_new_tokens']} new tokens (EOS ignored), "
        f"temperature {cfg['temperature']:g}, gamma {cfg['gamma']}, {cfg['shards_per_replica']} shards per replica",
        "",
        f"machine: {m['usable_cores']} usable cores ({m['cpu_count']} logical), {m['processor']}, torch {m['torch']}, "
        f"ray {m['ray']}" + (f", load average at start {load[0]:.2f}" if load else ""),
    )
    lines += table(result["records"], [LAYOUT[0], "category", *LAYOUT[1:], *FIGURES, SAME])
    lines += ["", *table(result["totals"], [LAYOUT[0], ("all categories", lambda t: "all"), *LAYOUT[1:], *FIGURES]), ""]
    startup = [("startup s (model loads)", "startup_seconds", ".1f"), ("warm-up s", "warmup_seconds", ".1f")]
    return "\n".join(lines + table(result["startups"], [*LAYOUT, *startup]))


def plot(result: dict, path) -> None:
    recs = result["records"]
    top = 1.3 * max((r["tokens_per_s"] for r in recs), default=1.0)  # room for the legend
    layout = lambda r: f"{r['replicas']} replica(s) x {r['threads']} thread(s)"  # noqa: E731
    title = lambda m: f"{m}: rollout tokens/s"  # noqa: E731
    bars(path, recs, "method", "category", layout, "tokens_per_s", title=title, ylabel="tokens/s", one=False, top=top)
