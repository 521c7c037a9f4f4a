"""`verispec bench replicas`: RL rollout tokens/s on 1, 2, ... replicas (Ray actors, `verispec.rollout.cluster`),
the same workload side by side in one run."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from .bench_common import report
from .bench_rollout import add_rollout_args, check_methods
from .options import UsageError, bench_config, log_stderr, model_errors, read_bench_prompts

REPLICAS_HELP = (
    "layouts: replica counts, each optionally xTHREADS per replica (else --threads), e.g. 1,2,1x2 (default 1,2)"
)

HELP = "rollout tokens/s on 1, 2, ... Ray replicas, side by side"
RAY_HELP = "a running Ray cluster ('auto', or HEAD:6379); default: a local Ray instance with the CPUs the largest "
RAY_HELP += "layout needs (at least this machine's)"


def _layouts(text: str) -> tuple[tuple[int, int | None], ...]:
    """'1,2,1x2' -> ((1, None), (2, None), (1, 2)): replicas, and threads each where given (else --threads)."""
    out = []
    for part in (p.strip() for p in text.split(",")):
        reps, _, threads = part.partition("x")
        try:
            layout = (int(reps), int(threads) if threads else None)
        except ValueError:
            layout = (0, None)
        if layout[0] < 1 or (layout[1] is not None and layout[1] < 1):
            raise argparse.ArgumentTypeError(
                f"must be comma-separated replica counts, each optionally xTHREADS, e.g. 1,2,1x2, got {text!r}"
            )
        out.append(layout)
    return tuple(out)


def add_parser(sub) -> None:
    from ..bench.replicas import ReplicasBenchConfig

    p = sub.add_parser("replicas", help=HELP)
    target_help = "the policy (default: the built-in default model); every replica loads it"
    counts = ("group", "num_prompts", "max_new_tokens", "gamma", "shards_per_replica")
    add_rollout_args(p, ReplicasBenchConfig(), "replicas", target_help, *counts)
    p.add_argument("--replicas", type=_layouts, default=_layouts("1,2"), help=REPLICAS_HELP)
    p.add_argument("--ray-address", help=RAY_HELP)
    for action in p._actions:
        if "--threads" in action.option_strings:
            action.help = "torch threads per replica of the layouts given without xTHREADS (default 1)"
    p.set_defaults(func=run)


def _check_model(spec: str | None, flag: str) -> None:
    looks_local = spec and (spec.endswith(".gguf") or spec.startswith((".", "~", "/")) or spec.count("/") > 1)
    if looks_local and not Path(spec).expanduser().exists():
        raise UsageError(f"{flag} {spec}: no such file or directory")


def run(args: argparse.Namespace) -> int:
    import ray

    from ..bench import replicas
    from ..model.loading import DEFAULT_MODEL_NAME, default_model_path

    check_methods(args)
    if args.device != "cpu":
        raise UsageError("bench replicas runs CPU replicas (--device cpu)")
    threads = args.threads or 1
    extra = dict(methods=args.methods, layouts=tuple((r, t or threads) for r, t in args.replicas), threads=threads)
    names = ("group", "num_prompts", "max_new_tokens", "gamma", "shards_per_replica", "dtype")
    cfg = bench_config(replicas.ReplicasBenchConfig, args, *names, **extra)
    _check_model(args.target, "--target")
    _check_model(args.draft, "--draft")
    prompts = read_bench_prompts(args.prompts)
    with model_errors():
        target = args.target or str(default_model_path())  # fetched here once, not by every replica
    started = not ray.is_initialized()
    if started and args.ray_address:
        ray.init(address=args.ray_address, log_to_driver=False)
    elif started:
        cpus = max(os.cpu_count() or 1, *(r * t for r, t in cfg.layouts))
        ray.init(address="local", num_cpus=cpus, include_dashboard=False, log_to_driver=False)
    try:
        with model_errors():
            name = args.target or DEFAULT_MODEL_NAME
            result = replicas.run_replicas_bench(target, name, args.draft, prompts, cfg, log=log_stderr)
    finally:
        if started:
            ray.shutdown()
    return report(args, "replicas", replicas, result)
