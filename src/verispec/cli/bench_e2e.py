"""`verispec bench e2e`: end-to-end tokens/s of every method side by side, in one run."""

from __future__ import annotations

import argparse
import sys

from .options import (
    UsageError,
    add_bench_inputs,
    add_bench_model_args,
    bench_model_options,
    gamma_type,
    int_range,
    load,
    model_errors,
    pick,
    read_bench_prompts,
    write_bench_report,
)

METHODS_HELP = (
    "comma-separated methods (default: the six standard ones); also verispec-draft@G, verispec-tree@SHAPE[/RULE], "
    "verispec-ngram-tree@SHAPE, llamacpp-plain and llamacpp-lookup (llama-cpp-python's own decoding of a .gguf target)"
)


def _temperatures(text: str) -> tuple[float, ...]:
    from ..sampling import ParamError, SamplingParams

    try:
        values = tuple(float(t) for t in text.split(","))
        for t in values:
            SamplingParams(temperature=t)
    except ParamError as e:
        raise argparse.ArgumentTypeError(f"each temperature {e.message}") from None
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be comma-separated numbers, e.g. 0,1, got {text!r}") from None
    return values


def _batches(text: str) -> tuple[int, ...]:
    check = int_range(1)
    return tuple(sorted({check(b) for b in text.split(",")}))


def add_parser(sub) -> None:
    p = sub.add_parser("e2e", help="end-to-end tokens/s: verispec (plain, draft, ngram) vs HF generate")
    add_bench_inputs(
        p,
        "target model (default: the built-in default model)",
        "draft model for verispec-draft and hf-assisted (omit: those are skipped)",
        ("--num-prompts", 1, 2, "prompts per category at batch 1 (default %(default)s)"),
        ("--max-new-tokens", 1, 64, "default %(default)s"),
    )
    p.add_argument(
        "--batch",
        type=_batches,
        default=(4,),
        help="batch sizes of the batched verispec runs, comma-separated, e.g. 4,8,16 (default 4)",
    )
    p.add_argument("--temperatures", type=_temperatures, default="0,1", help="comma-separated (default 0,1)")
    p.add_argument("--gamma", type=gamma_type(), default=4, help="drafts per step for verispec, or auto (default 4)")
    p.add_argument("--methods", help=METHODS_HELP)
    add_bench_model_args(
        p,
        "e2e",
        "quantize the draft model (verispec-draft)",
        "quantization of the self-draft (verispec-self; default int4)",
    )
    p.set_defaults(func=run)


def _config(args: argparse.Namespace):
    """The run's E2EConfig, every option checked (no model loaded yet)."""
    from ..bench import e2e

    if args.draft == "self":
        raise UsageError(
            "--draft takes a draft model; the target's own quantized weights run as method "
            "verispec-self (see --self-quant)"
        )
    if args.draft_quant is not None and args.draft in (None, "none", "ngram"):
        raise UsageError("--draft-quant quantizes the --draft model: give --draft PATH")
    methods = tuple(args.methods.split(",")) if args.methods else e2e.E2EConfig.methods
    try:
        for m in methods:
            e2e.check_method(m)
    except ValueError as e:
        raise UsageError(f"--methods: {e}") from None
    options = pick(args, "max_new_tokens", "temperatures", "num_prompts", "batch", "gamma")
    return e2e.E2EConfig(**options, methods=methods, **bench_model_options(args))


def run(args: argparse.Namespace) -> int:
    from ..bench import e2e

    cfg = _config(args)
    prompts = read_bench_prompts(args.prompts)
    with model_errors():
        target = load(args.target, args)
        # prompt lookup always runs; a draft model is optional
        draft = load(args.draft, args, threads=False) if args.draft not in (None, "none", "ngram") else None
        result = e2e.run_e2e(target, draft, prompts, cfg, log=lambda m: print(m, file=sys.stderr, flush=True))
    write_bench_report(args.out, "e2e", result, e2e.to_markdown(result), e2e.plot)
    return 0
