"""`verispec bench structured`: JSON-schema extraction decoded plain and speculatively, side by side in one run."""

from __future__ import annotations

import argparse

from .bench_common import TARGET_HELP, run_on_models, temperatures
from .options import UsageError, add_bench_model_args, add_counts, bench_model_options, pick, user_errors

HELP = "constrained decoding (JSON schemas): plain vs speculation with and without jump-forward"

PROMPTS_HELP = "JSONL prompt set, lines {'category', 'prompt', 'schema'} (default: the extraction set shipped with "
PROMPTS_HELP += "verispec, verispec/bench/data/extract.jsonl)"
RANDOM_HELP = "SpecConfig's random key of every method (default auto: seeded requests Gumbel-coupled, so every method "
RANDOM_HELP += "emits plain decoding's text for a seed)"


def add_parser(sub) -> None:
    from ..bench.structured import METHODS, StructuredConfig

    d = StructuredConfig()
    p = sub.add_parser("structured", help=HELP)
    p.add_argument("--target", help=TARGET_HELP)
    p.add_argument("--draft", help="draft model for the 'draft' method (omit: that method is skipped)")
    p.add_argument("--prompts", metavar="FILE", help=PROMPTS_HELP)
    add_counts(
        p,
        ("--max-new-tokens", 1, d.max_new_tokens, "default %(default)s"),
        ("--repeats", 1, d.repeats, "runs of the whole set, each with its own seeds (default %(default)s)"),
        ("--num-prompts", 1, None, "prompts per category (default: all)"),
    )
    temps_help = "comma-separated (default 1; e.g. 0,1)"
    p.add_argument("--temperatures", type=temperatures, default=d.temperatures, help=temps_help)
    methods_help = f"comma-separated, from {', '.join(METHODS)}, or verispec:SPEC with ';' between its items (default "
    methods_help += "%(default)s; plain is the baseline and must be there; draft runs only with --draft)"
    p.add_argument("--methods", default=",".join(d.methods), help=methods_help)
    jump_help = "jump-forward tokens per step of the methods that jump (default 16)"
    p.add_argument("--jump", type=int, default=d.jump, help=jump_help)
    p.add_argument("--random", choices=("auto", "stream", "position", "gumbel"), default=d.random, help=RANDOM_HELP)
    self_quant = "quantization of the self-draft (method self)"
    add_bench_model_args(p, "structured", "quantize the draft model (method draft)", self_quant)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..bench import structured

    methods = tuple(m.replace(";", ",") for m in args.methods.split(",") if m)
    options = pick(args, "max_new_tokens", "temperatures", "repeats", "num_prompts", "jump", "random")
    with user_errors():
        cfg = structured.StructuredConfig(**options, **bench_model_options(args), methods=methods)
    try:
        prompts = structured.load_extract_prompts(args.prompts)
    except OSError as e:
        raise UsageError(f"cannot read prompts from {args.prompts}: {e.strerror or e}") from None
    except ValueError as e:
        raise UsageError(f"--prompts: {e}") from None
    return run_on_models(args, "structured", structured, cfg, structured.run_structured, prompts=prompts)
