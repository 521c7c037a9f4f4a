"""`verispec bench acceptance`: exact expected kept drafts per step under token-wise and block verification on the
same drafts, TV(p, q), and the Gumbel coupling's acceptance against its bound, per prompt category."""

from __future__ import annotations

import argparse

from .bench_common import TARGET_HELP, run_on_models
from .options import UsageError, add_bench_inputs, add_bench_model_args, bench_config

HELP = "what token-wise, block and coupled verification keep, without sampling noise"


def add_parser(sub) -> None:
    from ..bench.acceptance import AcceptanceConfig

    d = AcceptanceConfig()
    p = sub.add_parser("acceptance", help=HELP)
    counts = [("--num-prompts", 1, d.num_prompts, "prompts per category (default %(default)s)")]
    counts += [("--max-new-tokens", 1, d.max_new_tokens, "per prompt (default %(default)s)")]
    counts += [("--gamma", 1, d.gamma, "drafts per step, full chains (default %(default)s)")]
    add_bench_inputs(p, TARGET_HELP, "draft model (required)", *counts)
    p.add_argument("--temperature", type=float, default=d.temperature, help="> 0 (default %(default)s)")
    draft_quant = "quantize the draft model (default: not quantized)"
    add_bench_model_args(p, "acceptance", draft_quant, "unused here", torch_only=True)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..bench import acceptance

    if args.draft is None:
        raise UsageError("bench acceptance needs --draft PATH: a draft model")
    cfg = bench_config(acceptance.AcceptanceConfig, args, "num_prompts", "max_new_tokens", "gamma", "temperature")
    return run_on_models(args, "acceptance", acceptance, cfg, acceptance.run_acceptance)
