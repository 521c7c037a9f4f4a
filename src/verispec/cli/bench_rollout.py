"""`verispec bench rollout`: RL rollout throughput (groups, epochs, weight updates), every drafting method side by
side in one run; and the options `bench replicas` shares with it."""

from __future__ import annotations

import argparse

from .bench_common import add_fields, run_on_models
from .options import UsageError, add_bench_inputs, add_bench_model_args, bench_config, flag

_COUNTS = {  # the integer options of the rollout benchmarks (bench rollout, bench replicas): field -> help
    "group": "samples per prompt, G (default %(default)s)",
    "num_prompts": "prompts per category (default %(default)s)",
    "max_new_tokens": "per sample (default %(default)s)",
    "epochs": "passes over the same prompts, weights perturbed between them (default %(default)s)",
    "gamma": "draft chain length (default %(default)s)",
    "shards_per_replica": "shards per replica and request (default %(default)s)",
}
_OPTIONS = (  # bench rollout's own: (flag, type, help)
    ("--noise", float, "update noise, times each matrix's RMS (default 1e-3)"),
    ("--history-tree", str, "history trie per row: dynamic-DEPTH-CHILDREN-NODES (default %(default)s)"),
    ("--history-min-share", float, "least share of the matched continuations a trie node needs (default %(default)s)"),
    ("--choose-depth", int, "history/*: the trie alone where it is this deep, else the chain (default %(default)s)"),
)

HELP = "RL rollout tokens/s: groups of samples over epochs with weight updates"


def _methods(text: str) -> tuple[str, ...]:
    from ..bench.rollout import METHODS

    names = tuple(m.strip() for m in text.split(",") if m.strip())
    if not names or any(m not in METHODS for m in names):
        raise argparse.ArgumentTypeError(f"choose from {', '.join(METHODS)}, got {text!r}")
    return names


def add_rollout_args(p: argparse.ArgumentParser, d, name: str, target_help: str, *counts: str) -> None:
    """A rollout benchmark's --target, --draft, --prompts, integer options `counts` (config fields, defaults from the
    config `d`), --methods and model options (torch models only: their weights are updated, or sharded)."""
    draft_help = "draft model for the draft and history+draft methods"
    add_bench_inputs(p, target_help, draft_help, *((flag(c), 1, getattr(d, c), _COUNTS[c]) for c in counts))
    methods_help = f"comma-separated (default {','.join(d.methods)})"
    p.add_argument("--methods", type=_methods, default=d.methods, help=methods_help)
    draft_quant = "quantize the draft model (default: not quantized)"
    add_bench_model_args(p, name, draft_quant, "quantization of the self-draft (default int4)", torch_only=True)


def check_methods(args: argparse.Namespace) -> None:
    from ..bench.rollout import METHODS

    if args.draft is None and any(METHODS[m].startswith("model") for m in args.methods):
        raise UsageError("methods draft, history+draft and history/draft need --draft PATH")


def add_parser(sub) -> None:
    from ..bench.rollout import RolloutBenchConfig

    p = sub.add_parser("rollout", help=HELP)
    d, counts = RolloutBenchConfig(), ("group", "num_prompts", "max_new_tokens", "epochs", "gamma")
    add_rollout_args(p, d, "rollout", "the policy (default: the built-in default model)", *counts)
    add_fields(p, d, *_OPTIONS)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..bench import rollout

    if not (0 <= args.noise < 1):
        raise UsageError(f"--noise must be in [0, 1), got {args.noise}")
    check_methods(args)
    names = ("group", "num_prompts", "max_new_tokens", "epochs", "noise", "gamma", "history_tree", "history_min_share")
    cfg = bench_config(rollout.RolloutBenchConfig, args, *names, "choose_depth", methods=args.methods)
    return run_on_models(args, "rollout", rollout, cfg, rollout.run_rollout_bench)
