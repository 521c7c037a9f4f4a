"""`verispec bench rollout`: RL rollout throughput (groups, epochs, weight updates), every drafting method side by
side in one run."""

from __future__ import annotations

import argparse
import sys

from .options import (
    UsageError,
    add_bench_inputs,
    add_bench_model_args,
    bench_model_options,
    load,
    model_errors,
    pick,
    read_bench_prompts,
    write_bench_report,
)


def _methods(text: str) -> tuple[str, ...]:
    from ..bench.rollout import METHODS

    names = tuple(m.strip() for m in text.split(",") if m.strip())
    unknown = [m for m in names if m not in METHODS]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"choose from {', '.join(METHODS)}, got {text!r}")
    return names


def add_parser(sub) -> None:
    from ..bench.rollout import RolloutBenchConfig

    d = RolloutBenchConfig()
    p = sub.add_parser("rollout", help="RL rollout tokens/s: groups of samples over epochs with weight updates")
    add_bench_inputs(
        p,
        "the policy (default: the built-in default model)",
        "draft model for the draft and history+draft methods",
        ("--group", 1, d.group, "samples per prompt, G (default %(default)s)"),
        ("--num-prompts", 1, d.num_prompts, "prompts per category (default %(default)s)"),
        ("--max-new-tokens", 1, d.max_new_tokens, "per sample (default %(default)s)"),
        ("--epochs", 1, d.epochs, "passes over the same prompts, weights perturbed between them (default %(default)s)"),
        ("--gamma", 1, d.gamma, "draft chain length (default %(default)s)"),
    )
    p.add_argument("--noise", type=float, default=d.noise, help="update noise, times each matrix's RMS (default 1e-3)")
    p.add_argument(
        "--methods", type=_methods, default=d.methods, help=f"comma-separated (default {','.join(d.methods)})"
    )
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
    add_bench_model_args(
        p,
        "rollout",
        "quantize the draft model (default: not quantized)",
        "quantization of the self-draft (default int4)",
        torch_only=True,  # weight updates: the models must be torch models
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..bench import rollout

    if not (0 <= args.noise < 1):
        raise UsageError(f"--noise must be in [0, 1), got {args.noise}")
    if args.draft is None and any(rollout.METHODS[m][0] == "model" for m in args.methods):
        raise UsageError("methods draft, history+draft and history/draft need --draft PATH")
    try:
        options = pick(
            args,
            "group",
            "num_prompts",
            "max_new_tokens",
            "epochs",
            "noise",
            "gamma",
            "history_tree",
            "history_min_share",
            "choose_depth",
        )
        cfg = rollout.RolloutBenchConfig(**options, methods=args.methods, **bench_model_options(args))
    except ValueError as e:
        raise UsageError(str(e)) from None
    prompts = read_bench_prompts(args.prompts)
    with model_errors():
        target = load(args.target, args)
        draft = load(args.draft, args, threads=False) if args.draft else None
        result = rollout.run_rollout_bench(
            target, draft, prompts, cfg, log=lambda m: print(m, file=sys.stderr, flush=True)
        )
    write_bench_report(args.out, "rollout", result, rollout.to_markdown(result), rollout.plot)
    return 0
