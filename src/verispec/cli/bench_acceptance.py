"""`verispec bench acceptance`: exact expected kept drafts per step under token-wise and block verification on the
same drafts, TV(p, q), and the Gumbel coupling's acceptance against its bound, per prompt category."""

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


def add_parser(sub) -> None:
    from ..bench.acceptance import AcceptanceConfig

    d = AcceptanceConfig()
    p = sub.add_parser(
        "acceptance", help="what token-wise, block and coupled verification keep, without sampling noise"
    )
    add_bench_inputs(
        p,
        "target model (default: the built-in default model)",
        "draft model (required)",
        ("--num-prompts", 1, d.num_prompts, "prompts per category (default %(default)s)"),
        ("--max-new-tokens", 1, d.max_new_tokens, "per prompt (default %(default)s)"),
        ("--gamma", 1, d.gamma, "drafts per step, full chains (default %(default)s)"),
    )
    p.add_argument("--temperature", type=float, default=d.temperature, help="> 0 (default %(default)s)")
    add_bench_model_args(
        p, "acceptance", "quantize the draft model (default: not quantized)", "unused here", torch_only=True
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..bench import acceptance

    if args.draft is None:
        raise UsageError("bench acceptance needs --draft PATH: a draft model")
    try:
        options = pick(args, "num_prompts", "max_new_tokens", "gamma", "temperature")
        model = {k: v for k, v in bench_model_options(args).items() if k != "self_quant"}
        cfg = acceptance.AcceptanceConfig(**options, **model)
    except ValueError as e:
        raise UsageError(str(e)) from None
    prompts = read_bench_prompts(args.prompts)
    with model_errors():
        target = load(args.target, args)
        draft = load(args.draft, args, threads=False)
        result = acceptance.run_acceptance(
            target, draft, prompts, cfg, log=lambda m: print(m, file=sys.stderr, flush=True)
        )
    write_bench_report(args.out, "acceptance", result, acceptance.to_markdown(result), acceptance.plot)
    return 0
