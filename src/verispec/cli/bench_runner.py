"""`verispec bench runner`: decode(1) / verify(k) cost curves of the model forwards."""

from __future__ import annotations

import argparse

from .bench_common import report
from .options import UsageError, add_counts, add_device_args, check_model_path, load, log_stderr, model_errors

HELP = "decode(1) / verify(k) cost curves: transformers vs fast runner vs quantized self-drafts"


def add_parser(sub) -> None:
    from ..bench.runner import PATHS, TORCH_PATHS

    p = sub.add_parser("runner", help=HELP)
    p.add_argument("--model", help="model (hub id, directory, .gguf; default: the built-in default model)")
    paths_help = f"comma-separated subset of {', '.join(PATHS)} (default: {', '.join(TORCH_PATHS)}; llamacpp needs a "
    p.add_argument("--paths", default=",".join(TORCH_PATHS), help=paths_help + ".gguf model and the llamacpp extra)")
    add_counts(
        p,
        ("--max-k", 1, 16, "largest verify length (default %(default)s)"),
        ("--context", 1, 64, "cached tokens before each step (default %(default)s)"),
        ("--repeats", 1, 7, "timed repeats per k and path (default %(default)s)"),
    )
    add_device_args(p)
    p.add_argument("--json", metavar="FILE", help="also write the raw timings as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..bench import runner as bench_runner
    from ..model.loading import shared_vocab_size

    paths = tuple(args.paths.split(","))
    unknown, choose = set(paths) - set(bench_runner.PATHS), ", ".join(bench_runner.PATHS)
    if unknown:
        raise UsageError(f"--paths: unknown path(s) {', '.join(sorted(unknown))}; choose from {choose}")
    llamacpp = argparse.Namespace(**vars(args) | {"runner": "llamacpp"})  # its backend: llama.cpp
    torch_paths = [n for n in paths if n in bench_runner.TORCH_PATHS]
    check_model_path(f"--model {args.model}", args.model)
    with model_errors():  # each backend loads the file itself: torch for the torch paths, llama.cpp for its own
        lc = load(args.model, llamacpp) if "llamacpp" in paths else None
        loaded = load(args.model, args) if torch_paths else lc
        options = dict(max_k=args.max_k, context=args.context, repeats=args.repeats, paths=paths, log=log_stderr)
        lc_model, model = lc.model if lc else None, loaded.model if torch_paths else None
        res = bench_runner.run(model, shared_vocab_size(loaded, None), llamacpp_model=lc_model, **options)
    print(f"Model: {loaded.name}\n")
    return report(args, "runner", bench_runner, res | {"model": loaded.name})
