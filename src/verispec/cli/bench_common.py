"""What the `verispec bench` commands share: the result written through the bench harness (`write_report`: into
--out, or the JSON alone into --json), a model benchmark's loading, options from tables, and --temperatures."""

from __future__ import annotations

import argparse

from .options import check_model_path, load, log_stderr, model_errors, read_bench_prompts

TARGET_HELP = "target model (default: the built-in default model)"


def report(args: argparse.Namespace, name: str, module, result: dict) -> int:
    """Write a bench kind's result (`module`: its bench module, with to_markdown and, for --out, plot)."""
    from ..bench.harness import write_report

    files = dict(out=getattr(args, "out", None), json_file=getattr(args, "json", None))
    write_report(result, name, module.to_markdown(result), plot=getattr(module, "plot", None), **files)
    return 0


def run_on_models(args: argparse.Namespace, name: str, module, cfg, run, prompts=None, heads=False, drafts=None):
    """Load --target (and --draft, when given; `heads`: it may be a hidden-state head), `run(target, draft, prompts,
    cfg, log=...)` (prompts: the --prompts files by category unless given; `drafts`: more draft models' paths, passed
    loaded as drafts=), and report."""
    prompts = read_bench_prompts(args.prompts) if prompts is None else prompts
    for model in ("target", "draft"):  # a missing file is reported before anything loads
        check_model_path(f"--{model} {getattr(args, model)}", getattr(args, model))
    with model_errors():
        target = load(args.target, args)
        draft = load(args.draft, args, threads=False, draft=heads) if args.draft else None
        more = {} if drafts is None else {"drafts": {p: load(p, args, threads=False, draft=True) for p in drafts}}
        result = run(target, draft, prompts, cfg, log=log_stderr, **more)
    return report(args, name, module, result)


def add_fields(p: argparse.ArgumentParser, defaults, *options: tuple) -> None:
    """Options from a table, each (flag, type, help): its default the `defaults` config's field of the flag's name."""
    for name, kind, text in options:
        p.add_argument(name, type=kind, default=getattr(defaults, name[2:].replace("-", "_")), help=text)


def temperatures(text: str) -> tuple[float, ...]:
    """--temperatures: comma-separated temperatures, each a valid SamplingParams temperature."""
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
