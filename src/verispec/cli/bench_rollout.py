"""`verispec bench rollout`: RL rollout throughput (groups, epochs, weight updates), every drafting method side by
side in one run."""

from __future__ import annotations

import argparse

from .options import UsageError, add_bench_inputs, add_bench_model_args, bench_config, flag, run_model_bench

_COUNTS = {  # the integer options of the rollout benchmarks (bench rollout, bench replicas): field -> help
    "group": "samples per prompt, G (default %(default)s)",
    "num_prompts": "prompts per category (default %(default)s)",
    "max_new_tokens": "per sample (default %(default)s)",
    "epochs": "passes over the same prompts, weights perturbed between them (default %(default)s)",
    "gamma": "draft chain length (default %(default)s)",
    "shards_per_replica": "shards per replica and request (default %(default)s)",
}


def _methods(text: str) -> tuple[str, ...]:
    from ..bench.rollout import METHODS

    names = tuple(m.strip() for m in text.split(",") if m.strip())
    unknown = [m for m in names if m not in METHODS]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"choose from {', '.join(METHODS)}, got {text!r}")
    return names


def add_rollout_inputs(p: argparse.ArgumentParser, defaults, target_help: str, *counts: str) -> None:
    """--target, --draft, --prompts and the integer options `counts` (config fields, defaults from the config
    `defaults`) of a rollout benchmark."""
    draft_help = "draft model for the draft and history+draft methods"
    add_bench_inputs(p, target_help, draft_help, *((flag(c), 1, getattr(defaults, c), _COUNTS[c]) for c in counts))


def add_methods_arg(p: argparse.ArgumentParser, defaults) -> None:
    p.add_argument(
        "--methods",
        type=_methods,
        default=defaults.methods,
        help=f"comma-separated (default {','.join(defaults.methods)})",
    )


def add_rollout_model_args(p: argparse.ArgumentParser, name: str) -> None:
    """add_bench_model_args for rollout engines: torch models only (their weights are updated, or sharded)."""
    draft_quant = "quantize the draft model (default: not quantized)"
    add_bench_model_args(p, name, draft_quant, "quantization of the self-draft (default int4)", torch_only=True)


def check_methods(args: argparse.Namespace) -> None:
    from ..bench.rollout import METHODS

    if args.draft is None and any(METHODS[m][0] == "model" for m in args.methods):
        raise UsageError("methods draft, history+draft and history/draft need --draft PATH")


def add_parser(sub) -> None:
    from ..bench.rollout import RolloutBenchConfig

    d = RolloutBenchConfig()
    p = sub.add_parser("rollout", help="RL rollout tokens/s: groups of samples over epochs with weight updates")
    target_help = "the policy (default: the built-in default model)"
    add_rollout_inputs(p, d, target_help, "group", "num_prompts", "max_new_tokens", "epochs", "gamma")
    p.add_argument("--noise", type=float, default=d.noise, help="update noise, times each matrix's RMS (default 1e-3)")
    add_methods_arg(p, d)
    p.add_argument(
        "--history-tree",
        default=d.history_tree,
        help="history trie per row: dynamic-DEPTH-CHILDREN-NODES (default %(default)s)",
    )
    p.add_argument(
        "--history-min-share",
        type=float,
        default=d.history_min_share,
        help="least share of the matched continuations a history trie node needs (default %(default)s)",
    )
    p.add_argument(
        "--choose-depth",
        type=int,
        default=d.choose_depth,
        help="history/draft, history/self: the trie alone where it is this deep, else the chain (default %(default)s)",
    )
    add_rollout_model_args(p, "rollout")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..bench import rollout

    if not (0 <= args.noise < 1):
        raise UsageError(f"--noise must be in [0, 1), got {args.noise}")
    check_methods(args)
    names = ("group", "num_prompts", "max_new_tokens", "epochs", "noise", "gamma")
    names += ("history_tree", "history_min_share", "choose_depth")
    cfg = bench_config(rollout.RolloutBenchConfig, args, *names, methods=args.methods)
    return run_model_bench(args, "rollout", cfg, rollout.run_rollout_bench, rollout)
