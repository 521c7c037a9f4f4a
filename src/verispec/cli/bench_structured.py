"""`verispec bench structured`: JSON-schema extraction decoded plain and speculatively, side by side in one run."""

from __future__ import annotations

import argparse

from .bench_e2e import _temperatures
from .options import (
    UsageError,
    add_bench_model_args,
    add_counts,
    bench_model_options,
    load,
    log_stderr,
    model_errors,
    pick,
    user_errors,
    write_bench_report,
)


def add_parser(sub) -> None:
    from ..bench.structured import METHODS, StructuredConfig

    d = StructuredConfig()
    p = sub.add_parser(
        "structured", help="constrained decoding (JSON schemas): plain vs speculation with and without jump-forward"
    )
    p.add_argument("--target", help="target model (default: the built-in default model)")
    p.add_argument("--draft", help="draft model for the 'draft' method (omit: that method is skipped)")
    p.add_argument(
        "--prompts",
        metavar="FILE",
        help="JSONL prompt set, lines {'category', 'prompt', 'schema'} (default: the extraction set shipped with "
        "verispec, verispec/bench/data/extract.jsonl)",
    )
    add_counts(
        p,
        ("--max-new-tokens", 1, d.max_new_tokens, "default %(default)s"),
        ("--repeats", 1, d.repeats, "runs of the whole set, each with its own seeds (default %(default)s)"),
        ("--num-prompts", 1, None, "prompts per category (default: all)"),
    )
    p.add_argument(
        "--temperatures", type=_temperatures, default=d.temperatures, help="comma-separated (default 1; e.g. 0,1)"
    )
    p.add_argument(
        "--methods",
        default=",".join(d.methods),
        help=f"comma-separated, from {', '.join(METHODS)}, or verispec:SPEC with ';' between its items "
        "(default %(default)s; plain is the baseline and must be there; draft runs only with --draft)",
    )
    p.add_argument(
        "--jump", type=int, default=d.jump, help="jump-forward tokens per step of the methods that jump (default 16)"
    )
    p.add_argument(
        "--random",
        choices=("auto", "stream", "position", "gumbel"),
        default=d.random,
        help="SpecConfig's random key of every method (default auto: seeded requests Gumbel-coupled, so every "
        "method emits plain decoding's text for a seed)",
    )
    add_bench_model_args(
        p, "structured", "quantize the draft model (method draft)", "quantization of the self-draft (method self)"
    )
    p.set_defaults(func=run)


def _config(args: argparse.Namespace):
    from ..bench.structured import StructuredConfig

    methods = tuple(m.replace(";", ",") for m in args.methods.split(",") if m)
    options = pick(args, "max_new_tokens", "temperatures", "repeats", "num_prompts", "jump", "random")
    with user_errors():
        return StructuredConfig(**options, **bench_model_options(args), methods=methods)


def run(args: argparse.Namespace) -> int:
    from ..bench import structured

    cfg = _config(args)
    try:
        prompts = structured.load_extract_prompts(args.prompts)
    except OSError as e:
        raise UsageError(f"cannot read prompts from {args.prompts}: {e.strerror or e}") from None
    except ValueError as e:
        raise UsageError(f"--prompts: {e}") from None
    with model_errors():
        target = load(args.target, args)
        draft = load(args.draft, args, threads=False) if args.draft else None
        result = structured.run_structured(target, draft, prompts, cfg, log=log_stderr)
    write_bench_report(args.out, "structured", result, structured.to_markdown(result), structured.plot)
    return 0
