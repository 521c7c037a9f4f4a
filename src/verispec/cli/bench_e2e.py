"""`verispec bench e2e`: end-to-end tokens/s of every method side by side, in one run."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..strict_json import dumps
from .options import (
    UsageError,
    add_counts,
    add_device_args,
    add_quant_arg,
    add_runner_arg,
    add_seed_arg,
    gamma_type,
    load,
    model_errors,
)

METHODS_HELP = (
    "comma-separated methods (default: the six standard ones); also verispec-draft@G, verispec-tree@SHAPE[/RULE], "
    "verispec-ngram-tree@SHAPE"
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


def add_parser(sub) -> None:
    p = sub.add_parser("e2e", help="end-to-end tokens/s: verispec (plain, draft, ngram) vs HF generate")
    p.add_argument("--target", help="target model (default: the built-in default model)")
    p.add_argument("--draft", help="draft model for verispec-draft and hf-assisted (omit: those are skipped)")
    p.add_argument("--prompts", nargs="+", required=True, help="JSONL prompt files ({'prompt', 'category'})")
    add_counts(
        p,
        ("--num-prompts", 1, 2, "prompts per category at batch 1 (default %(default)s)"),
        ("--batch", 1, 4, "batch size of the batched verispec runs (default %(default)s)"),
        ("--max-new-tokens", 1, 64, "default %(default)s"),
    )
    p.add_argument("--temperatures", type=_temperatures, default="0,1", help="comma-separated (default 0,1)")
    p.add_argument("--gamma", type=gamma_type(), default=4, help="drafts per step for verispec, or auto (default 4)")
    p.add_argument("--methods", help=METHODS_HELP)
    add_seed_arg(p)
    p.add_argument("--no-chat", action="store_true", help="feed prompts raw instead of through the chat template")
    add_runner_arg(p, "verispec's model forward (default auto)")
    add_quant_arg(p, "--draft-quant", "quantize the draft model (verispec-draft)")
    add_quant_arg(p, "--self-quant", "quantization of the self-draft (verispec-self; default int4)", default="int4")
    add_device_args(p)
    p.add_argument("--out", default="bench-out", help="folder for e2e.json, e2e.md and e2e.png")
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
    return e2e.E2EConfig(
        max_new_tokens=args.max_new_tokens,
        temperatures=args.temperatures,
        num_prompts=args.num_prompts,
        batch=args.batch,
        gamma=args.gamma,
        seed=args.seed,
        chat=not args.no_chat,
        methods=methods,
        runner=args.runner,
        draft_quant=args.draft_quant,
        self_quant=args.self_quant,
    )


def run(args: argparse.Namespace) -> int:
    from ..bench import e2e

    cfg = _config(args)
    try:
        prompts = e2e.load_prompts(args.prompts)
    except OSError as e:
        raise UsageError(f"cannot read prompts from {e.filename}: {e.strerror}") from None
    except ValueError as e:
        raise UsageError(f"--prompts: {e}") from None
    with model_errors():
        target = load(args.target, args)
        # prompt lookup always runs; a draft model is optional
        draft = load(args.draft, args, threads=False) if args.draft not in (None, "none", "ngram") else None
        result = e2e.run_e2e(target, draft, prompts, cfg, log=lambda m: print(m, file=sys.stderr, flush=True))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "e2e.json").write_text(dumps(result, indent=2))
    md = e2e.to_markdown(result)
    (out / "e2e.md").write_text(md + "\n")
    e2e.plot(result, out / "e2e.png")
    print(md)
    print(f"wrote {out / 'e2e.json'}, {out / 'e2e.md'}, {out / 'e2e.png'}")
    return 0
