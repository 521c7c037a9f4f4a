"""`verispec <command>`: the single command-line entry point.

One module per subcommand, each with its parser (`add_parser`) next to its handler (`run`, whose docstring, where
it has one, is the command's description in --help); the option groups they share, and the checks that run before
any model loads, are in `options`. Errors in user input print one line (`verispec: error: ...`, or argparse's usage
line and its error) and exit with status 2; never a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys

from . import (
    bench_acceptance,
    bench_e2e,
    bench_kernel,
    bench_replicas,
    bench_rollout,
    bench_runner,
    bench_stops,
    bench_structured,
    certify_generate,
    certify_kernel,
    certify_known_bugs,
    certify_study,
    explain,
    generate,
    serve,
    train_draft,
)
from .options import UsageError

__all__ = ["UsageError", "build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="verispec", description="Lossless speculative decoding.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in (explain, generate, serve, train_draft):
        command.add_parser(sub)
    bench = sub.add_parser("bench", help="benchmarks, side by side in one run")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True, metavar="BENCH")
    for command in (
        bench_kernel,
        bench_e2e,
        bench_runner,
        bench_rollout,
        bench_replicas,
        bench_acceptance,
        bench_stops,
        bench_structured,
    ):
        command.add_parser(bench_sub)
    certify = sub.add_parser("certify", help="statistical certificate that a sampler / generator is lossless")
    certify_sub = certify.add_subparsers(dest="certify_command", required=True, metavar="CERTIFY")
    for command in (certify_kernel, certify_known_bugs, certify_generate, certify_study):
        command.add_parser(certify_sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except UsageError as e:
        print(f"verispec: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # the reader went away (`verispec ... | head`): no traceback, and none at exit either
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
