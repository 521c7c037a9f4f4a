"""`verispec bench runner`: decode(1) / verify(k) cost curves of the model forwards."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..strict_json import dumps
from .options import UsageError, add_counts, add_device_args, load, model_errors


def add_parser(sub) -> None:
    from ..bench.runner import PATHS, TORCH_PATHS

    p = sub.add_parser(
        "runner", help="decode(1) / verify(k) cost curves: transformers vs fast runner vs quantized self-drafts"
    )
    p.add_argument("--model", help="model (hub id, directory, .gguf; default: the built-in default model)")
    p.add_argument(
        "--paths",
        default=",".join(TORCH_PATHS),
        help=f"comma-separated subset of {', '.join(PATHS)} (default: {', '.join(TORCH_PATHS)}; llamacpp needs a "
        ".gguf model and the llamacpp extra)",
    )
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
    unknown = set(paths) - set(bench_runner.PATHS)
    if unknown:
        raise UsageError(
            f"--paths: unknown path(s) {', '.join(sorted(unknown))}; choose from {', '.join(bench_runner.PATHS)}"
        )
    torch_paths = [n for n in paths if n in bench_runner.TORCH_PATHS]
    with model_errors():  # each backend loads the file itself: torch for the torch paths, llama.cpp for its own
        lc = (
            load(args.model, argparse.Namespace(**{**vars(args), "runner": "llamacpp"}))
            if "llamacpp" in paths
            else None
        )
        loaded = load(args.model, args) if torch_paths else lc
        res = bench_runner.run(
            loaded.model if torch_paths else None,
            shared_vocab_size(loaded, None),
            llamacpp_model=lc.model if lc else None,
            max_k=args.max_k,
            context=args.context,
            repeats=args.repeats,
            paths=paths,
            log=lambda m: print(m, file=sys.stderr, flush=True),
        )
    res["model"] = loaded.name
    print(f"Model: {loaded.name}\n\n{bench_runner.to_markdown(res)}")
    if args.json:
        Path(args.json).write_text(dumps(res, indent=2))
    return 0
