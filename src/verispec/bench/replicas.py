"""`verispec bench replicas`: one GRPO-shaped rollout workload on 1, 2, ... replicas (`RolloutCluster`), side by
side in one run.

Per category: the first `num_prompts` prompts, G samples each, temperature 1, `max_new_tokens` per sample (EOS
ignored, so every layout produces the same number of tokens), one `RolloutCluster.generate` call. Layouts are
(replicas, torch threads per replica) pairs, e.g. 1x1, 2x1, 1x2; each gets a fresh cluster of `EngineSpec`
replicas (models loaded in every replica: the startup is timed apart, as is a short warm-up generate on every
replica, and neither counts in tokens/s). Methods are `verispec bench rollout`'s (plain, history, draft, self,
...), one engine per replica, built from the same options (gamma, quantizations, the history trie).

Reported per method, category and layout: rollout tokens/s (tokens over the generate call's wall time, driver
side), the ratio to the 1-replica layout with the benchmark's threads per replica (same method and category),
wall seconds, tau (tokens per verification pass of a row, pooled over the rows) and whether the rollouts' tokens
equal the 1-replica layout's (they do for batch-invariant methods — plain, or a draft model without history —;
with history each replica drafts from its own rollouts, so samples stay exact but are other draws). The
machine's core count and load average are recorded with the results.
"""

from __future__ import annotations

import os
import platform
import time
from dataclasses import asdict, dataclass

from ..sampling import SamplingParams
from ._provenance import provenance, provenance_lines
from .rollout import METHODS, RolloutBenchConfig, RolloutWorkloadConfig, engine_options, timed_generate

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
    """The `EngineSpec` of a method (as `verispec bench rollout` builds its engines)."""
    from ..rollout.cluster import EngineSpec

    model, engine_kwargs = engine_options(method, draft, cfg, RolloutBenchConfig())  # the history trie's defaults
    return EngineSpec(target, model, engine_kwargs, dict(dtype=cfg.dtype, device=cfg.device))


def machine() -> dict:
    """What the numbers were measured on."""
    import ray
    import torch

    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        usable = os.cpu_count()
    return dict(
        cpu_count=os.cpu_count(),
        usable_cores=usable,
        processor=platform.processor() or platform.machine(),
        platform=platform.platform(),
        python=platform.python_version(),
        torch=torch.__version__,
        ray=ray.__version__,
        load_average_start=list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    )


def run_replicas_bench(
    target: str,
    target_name: str,
    draft: str | None,
    prompts: dict[str, list[str]],
    cfg: ReplicasBenchConfig,
    log=print,
) -> dict:
    """Every method on every layout (Ray must be initialized, with CPUs for the largest layout)."""
    from ..rollout.cluster import RolloutCluster

    origin = provenance()  # the code, date and command at the start of the run
    info = machine()
    options = dict(params=SamplingParams(temperature=cfg.temperature), seed=cfg.seed, chat=cfg.chat, ignore_eos=True)
    cats = {c: ps[: cfg.num_prompts] for c, ps in prompts.items()}
    records, startups = [], []
    for method in cfg.methods:
        spec = engine_spec(method, target, draft, cfg)
        for replicas, threads in cfg.layouts:
            t0 = time.perf_counter()
            with RolloutCluster(spec, replicas, threads, shards_per_replica=cfg.shards_per_replica) as cluster:
                started = time.perf_counter() - t0
                warmup = [WARMUP_PROMPT] * replicas  # one shard per replica
                warm = timed_generate(cluster, warmup, n=1, max_new_tokens=cfg.warmup_tokens, **options)[1]["seconds"]
                startups.append(
                    dict(
                        method=method, replicas=replicas, threads=threads, startup_seconds=started, warmup_seconds=warm
                    )
                )
                log(f"{method} {replicas}x{threads}: started in {started:.1f}s, warm-up {warm:.1f}s")
                for cat, texts in cats.items():
                    key = dict(method=method, category=cat, replicas=replicas, threads=threads)
                    records.append(_measure(cluster, key, texts, options, cfg))
                    r = records[-1]
                    log(
                        f"{method:14s} {cat:5s} {replicas}x{threads}: {r['tokens_per_s']:7.2f} tok/s  "
                        f"{r['seconds']:6.1f}s  tau {r['tau']:.2f}"
                    )
    _compare(records, cfg.threads)
    info["load_average_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    return dict(
        **origin,  # commit, dirty, date, command, verispec, python, torch, threads (the driver's)
        config=asdict(cfg),
        target=target_name,
        draft=draft,
        machine=info,
        records=records,
        totals=_totals(records, cfg.threads),
        startups=startups,
    )


def _measure(cluster, key: dict, texts, options: dict, cfg) -> dict:
    """One category's record: `key` (method, category, replicas, threads), then the generate call's figures."""
    outs, timed = timed_generate(cluster, texts, n=cfg.group, max_new_tokens=cfg.max_new_tokens, **options)
    st = cluster.last_stats
    tokens = [o.completion_token_ids for o in outs]
    return key | timed | dict(target_passes=st.target_passes, accepted=st.accepted, token_ids=tokens)


def _baseline(records: list[dict], method: str, cat: str, threads: int) -> dict | None:
    for r in records:
        if r["method"] == method and r["category"] == cat and r["replicas"] == 1 and r["threads"] == threads:
            return r
    return None


def _compare(records: list[dict], threads: int) -> None:
    """ratio_to_1_replica and same_tokens_as_1_replica per record; the token ids are dropped afterwards."""
    for r in records:
        base = _baseline(records, r["method"], r["category"], threads)
        r["ratio_to_1_replica"] = r["tokens_per_s"] / base["tokens_per_s"] if base else None
        r["same_tokens_as_1_replica"] = r["token_ids"] == base["token_ids"] if base else None
    for r in records:
        del r["token_ids"]


def _totals(records: list[dict], threads: int) -> list[dict]:
    """Per method and layout, over every category: tokens / seconds."""
    out: dict[tuple, dict] = {}
    for r in records:
        t = out.setdefault(
            (r["method"], r["replicas"], r["threads"]),
            dict(method=r["method"], replicas=r["replicas"], threads=r["threads"], tokens=0, seconds=0.0, passes=0),
        )
        t["tokens"] += r["tokens"]
        t["seconds"] += r["seconds"]
        t["passes"] += r["target_passes"]
    rows = list(out.values())
    for t in rows:
        t["tokens_per_s"] = t["tokens"] / t["seconds"]
        t["tau"] = t["tokens"] / max(t.pop("passes"), 1)
    for t in rows:
        base = out.get((t["method"], 1, threads))
        t["ratio_to_1_replica"] = t["tokens_per_s"] / base["tokens_per_s"] if base else None
    return rows


def _fmt(x, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def to_markdown(result: dict) -> str:
    cfg, m = result["config"], result["machine"]
    load = m.get("load_average_start")
    lines = [
        *provenance_lines(result),
        f"bench replicas: target {result['target']}, draft {result['draft']}, G = {cfg['group']} x "
        f"{cfg['num_prompts']} prompt(s) per category, {cfg['max_new_tokens']} new tokens (EOS ignored), "
        f"temperature {cfg['temperature']:g}, gamma {cfg['gamma']}, {cfg['shards_per_replica']} shards per replica",
        "",
        f"machine: {m['usable_cores']} usable cores ({m['cpu_count']} logical), {m['processor']}, torch {m['torch']}, "
        f"ray {m['ray']}" + (f", load average at start {load[0]:.2f}" if load else ""),
        "",
        "| method | category | replicas | threads each | tokens/s | x 1 replica | wall s | tau | same tokens as 1 replica |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["records"]:
        same = "-" if r["same_tokens_as_1_replica"] is None else "yes" if r["same_tokens_as_1_replica"] else "no"
        lines.append(
            f"| {r['method']} | {r['category']} | {r['replicas']} | {r['threads']} | {r['tokens_per_s']:.2f} "
            f"| {_fmt(r['ratio_to_1_replica'])} | {r['seconds']:.1f} | {r['tau']:.2f} | {same} |"
        )
    lines += ["", "| method | all categories | replicas | threads each | tokens/s | x 1 replica | wall s | tau |"]
    lines += ["|---|---|---|---|---|---|---|---|"]
    for t in result["totals"]:
        lines.append(
            f"| {t['method']} | all | {t['replicas']} | {t['threads']} | {t['tokens_per_s']:.2f} "
            f"| {_fmt(t['ratio_to_1_replica'])} | {t['seconds']:.1f} | {_fmt(t['tau'])} |"
        )
    lines += ["", "| method | replicas | threads each | startup s (model loads) | warm-up s |", "|---|---|---|---|---|"]
    for s in result["startups"]:
        lines.append(
            f"| {s['method']} | {s['replicas']} | {s['threads']} | {s['startup_seconds']:.1f} | {s['warmup_seconds']:.1f} |"
        )
    return "\n".join(lines)


def plot(result: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = result["records"]
    methods = list(dict.fromkeys(r["method"] for r in recs))
    cats = list(dict.fromkeys(r["category"] for r in recs))
    layouts = list(dict.fromkeys((r["replicas"], r["threads"]) for r in recs))
    fig, axes = plt.subplots(1, len(methods), figsize=(5 * len(methods), 4), squeeze=False)
    width = 0.8 / len(layouts)
    for ax, method in zip(axes[0], methods):
        for k, (rep, thr) in enumerate(layouts):
            vals = [
                next(
                    (
                        r["tokens_per_s"]
                        for r in recs
                        if (r["method"], r["category"], r["replicas"], r["threads"]) == (method, c, rep, thr)
                    ),
                    0.0,
                )
                for c in cats
            ]
            ax.bar([i + k * width for i in range(len(cats))], vals, width, label=f"{rep} replica(s) x {thr} thread(s)")
        ax.set_xticks([i + width * (len(layouts) - 1) / 2 for i in range(len(cats))], cats)
        top = max((r["tokens_per_s"] for r in recs if r["method"] == method), default=1.0)
        ax.set_ylim(0, 1.3 * top)  # room for the legend
        ax.set_title(f"{method}: rollout tokens/s")
        ax.set_ylabel("tokens/s")
    axes[0][0].legend(fontsize=8, loc="upper left", ncol=len(layouts))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
