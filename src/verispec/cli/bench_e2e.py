"""`verispec bench e2e`: end-to-end tokens/s of every method side by side, in one run."""

from __future__ import annotations

import argparse
from dataclasses import replace

from .bench_common import TARGET_HELP, run_on_models, temperatures
from .generate import check_heads
from .options import UsageError, add_bench_inputs, add_bench_model_args, bench_model_options, gamma_type, int_range

METHODS_HELP = (
    "comma-separated methods (default: the six standard ones, verispec-plain/draft/ngram/self and hf-plain/assisted); "
    "verispec:SPEC runs a speculation configuration in its string form, e.g. verispec:draft=model,tree=4-2,gamma=auto "
    "(its key=value items run up to the next method name); also llamacpp-plain and llamacpp-lookup (llama-cpp-python's "
    "own decoding of a .gguf target)"
)
SPEC_HELP = (
    "speculation keys every verispec method takes unless it names them (SpecConfig's string form), e.g. "
    "random=gumbel,max_gamma=16; gamma and runner here are --gamma and --runner (a disagreement is an error); the "
    "methods name their drafters and trees, --draft-quant and --self-quant their quantizations"
)

ORACLE_HELP = (
    "also run every verispec method with gamma auto (that drafts chains) at these fixed gammas, comma-separated "
    "(bare --oracle: 1,2,4,8), and report per cell the best fixed choice (plain or a gamma) and auto's ratios to it "
    "and to plain (default: off)"
)

HELP = "end-to-end tokens/s: verispec (plain, draft, ngram) vs HF generate"


def _batches(text: str) -> tuple[int, ...]:
    check = int_range(1)
    return tuple(sorted({check(b) for b in text.split(",")}))


def _gammas(text: str) -> tuple[int, ...]:
    check = gamma_type(auto=False)
    return tuple(sorted({check(g) for g in text.split(",")}))


def add_parser(sub) -> None:
    from ..bench import e2e

    p = sub.add_parser("e2e", help=HELP)
    draft_help = "draft model for verispec-draft and hf-assisted (omit: those are skipped)"
    counts = [("--num-prompts", 1, 2, "prompts per category at batch 1 (default %(default)s)")]
    add_bench_inputs(p, TARGET_HELP, draft_help, *counts, ("--max-new-tokens", 1, 64, "default %(default)s"))
    batch_help = "batch sizes of the batched verispec runs, comma-separated, e.g. 4,8,16 (default 4)"
    p.add_argument("--batch", type=_batches, default=(4,), help=batch_help)
    p.add_argument("--temperatures", type=temperatures, default="0,1", help="comma-separated (default 0,1)")
    gamma_help = f"drafts per step of the verispec methods that name none, or auto (default {e2e.E2EConfig.gamma})"
    p.add_argument("--gamma", type=gamma_type(), help=gamma_help)
    p.add_argument("--methods", help=METHODS_HELP)
    p.add_argument(
        "--oracle", nargs="?", type=_gammas, const=e2e.ORACLE, default=(), metavar="GAMMAS", help=ORACLE_HELP
    )
    p.add_argument("--spec", metavar="SPEC", help=SPEC_HELP)
    self_quant = "quantization of the self-draft (verispec-self; default int4)"
    add_bench_model_args(p, "e2e", "quantize the draft model (verispec-draft)", self_quant)
    p.set_defaults(func=run, runner=None)  # given or not: --spec's runner key may set it (E2EConfig's default: auto)


def _config(args: argparse.Namespace):
    """The run's E2EConfig, every option checked (no model loaded yet)."""
    from ..bench import e2e

    if args.draft == "self":
        raise UsageError("--draft takes a draft model; the target's own quantized weights run as method verispec-self")
    if args.draft_quant is not None and args.draft in (None, "none", "ngram"):
        raise UsageError("--draft-quant quantizes the --draft model: give --draft PATH")
    methods = _methods(args.methods) if args.methods else e2e.E2EConfig.methods
    model = {k: v for k, v in bench_model_options(args).items() if k != "runner"}  # runner: in _spec_options
    options = {k: getattr(args, k) for k in ("max_new_tokens", "temperatures", "num_prompts", "batch", "oracle")}
    options |= _spec_options(args)
    try:
        cfg = e2e.E2EConfig(**options, **model, methods=())  # the run's own keys first: --spec's errors are its own
    except ValueError as e:
        raise UsageError(f"--spec {args.spec}: {e}") from None
    try:
        for m in methods:
            e2e.method_config(m, cfg)
    except ValueError as e:
        raise UsageError(f"--methods: {e}") from None
    cfg = replace(cfg, methods=methods)
    if cfg.oracle and not e2e.oracle_variants(cfg.methods, cfg):
        why = "give --gamma auto, or a method with gamma=auto, e.g. verispec:draft=ngram,gamma=auto"
        raise UsageError(f"--oracle compares gamma auto with fixed gammas, and no method drafts chains with it: {why}")
    return cfg


def _methods(text: str) -> tuple[str, ...]:
    """--methods: comma-separated names, where a verispec:SPEC takes the key=value items after it (no method name
    holds '='): verispec-plain,verispec:draft=model,gamma=2,hf-plain is three methods."""
    methods: list[str] = []
    for part in text.split(","):
        if "=" in part and not part.startswith("verispec:") and methods and methods[-1].startswith("verispec:"):
            methods[-1] += "," + part
        else:
            methods.append(part)
    return tuple(methods)


def _spec_options(args: argparse.Namespace) -> dict:
    """E2EConfig's gamma, runner and spec from --spec, --gamma and --runner (the spec's gamma and runner keys are
    the flags'; a flag and --spec that disagree is an error)."""
    from ..engine.config import SpecError, canonical, format_value, parse_items

    try:
        items = parse_items(args.spec or "")
    except SpecError as e:
        raise UsageError(f"--spec {args.spec}: {e}") from None
    out = {}
    for key, value in (("gamma", args.gamma), ("runner", args.runner)):
        if key in items and value is not None and canonical(key, items[key]) != value:
            raise UsageError(f"--{key} {value} disagrees with --spec {key}={format_value(items[key])}: give it once")
        given = items.pop(key, value)
        out |= {key: given} if given is not None else {}
    rest = ",".join(f"{k}={format_value(v)}" for k, v in items.items())
    return out | ({"spec": rest} if rest else {})


def run(args: argparse.Namespace) -> int:
    from ..bench import e2e

    cfg = _config(args)
    args.runner = cfg.runner  # the run's runner (--runner, or --spec's runner key): what `load` picks a backend by
    args.draft = None if args.draft in ("none", "ngram") else args.draft  # prompt lookup always runs
    models = e2e.method_models(cfg.methods, cfg)
    check_heads(args, [args.draft, *models], cfg.runner)
    return run_on_models(args, "e2e", e2e, cfg, e2e.run_e2e, heads=True, drafts=models)
