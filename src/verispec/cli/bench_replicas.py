"""`verispec bench replicas`: RL rollout tokens/s on 1, 2, ... replicas (Ray actors, `verispec.rollout.cluster`),
the same workload side by side in one run."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from .bench_rollout import add_methods_arg, add_rollout_inputs, add_rollout_model_args, check_methods
from .options import UsageError, bench_config, log_stderr, model_errors, read_bench_prompts, write_bench_report


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

    d = ReplicasBenchConfig()
    p = sub.add_parser("replicas", help="rollout tokens/s on 1, 2, ... Ray replicas, side by side")
    target_help = "the policy (default: the built-in default model); every replica loads it"
    add_rollout_inputs(p, d, target_help, "group", "num_prompts", "max_new_tokens", "gamma", "shards_per_replica")
    add_methods_arg(p, d)
    p.add_argument(
        "--replicas",
        type=_layouts,
        default=_layouts("1,2"),
        help="layouts: replica counts, each optionally xTHREADS per replica, e.g. 1,2,1x2 (default 1,2; "
        "threads per replica: --threads, default 1)",
    )
    p.add_argument(
        "--ray-address",
        help="a running Ray cluster ('auto', or HEAD:6379); default: start a local Ray instance with the CPUs the "
        "largest layout needs (at least this machine's)",
    )
    add_rollout_model_args(p, "replicas")
    for action in p._actions:
        if "--threads" in action.option_strings:
            action.help = "torch threads per replica of the layouts given without xTHREADS (default 1)"
    p.set_defaults(func=run)


def _check_model(spec: str | None, flag: str) -> None:
    if spec is None:
        return
    path = Path(spec).expanduser()
    looks_local = spec.endswith(".gguf") or spec.startswith((".", "~", "/")) or spec.count("/") > 1
    if looks_local and not path.exists():
        raise UsageError(f"{flag} {spec}: no such file or directory")


def run(args: argparse.Namespace) -> int:
    import ray

    from ..bench import replicas
    from ..model.loading import DEFAULT_MODEL_NAME, default_model_path

    check_methods(args)
    if args.device != "cpu":
        raise UsageError("bench replicas runs CPU replicas (--device cpu)")
    threads = args.threads or 1
    layouts = tuple((r, t or threads) for r, t in args.replicas)
    names = ("group", "num_prompts", "max_new_tokens", "gamma", "shards_per_replica", "dtype")
    extra = dict(methods=args.methods, layouts=layouts, threads=threads)
    cfg = bench_config(replicas.ReplicasBenchConfig, args, *names, **extra)
    _check_model(args.target, "--target")
    _check_model(args.draft, "--draft")
    prompts = read_bench_prompts(args.prompts)
    with model_errors():
        target = args.target or str(default_model_path())  # fetched here once, not by every replica
    started = False
    if not ray.is_initialized():
        if args.ray_address:
            ray.init(address=args.ray_address, log_to_driver=False)
        else:
            cpus = max(os.cpu_count() or 1, *(r * t for r, t in layouts))
            ray.init(address="local", num_cpus=cpus, include_dashboard=False, log_to_driver=False)
        started = True
    try:
        with model_errors():
            result = replicas.run_replicas_bench(
                target,
                args.target or DEFAULT_MODEL_NAME,
                args.draft,
                prompts,
                cfg,
                log=log_stderr,
            )
    finally:
        if started:
            ray.shutdown()
    write_bench_report(args.out, "replicas", result, replicas.to_markdown(result), replicas.plot)
    return 0
