"""`verispec bench stops`: the engine with no stop strings and with many that never match (and one that does),
side by side; and the stop-string matcher alone, next to the loops it replaced."""

from __future__ import annotations

import argparse

from .bench_common import report
from .options import int_range

HELP = "what many stop strings cost per step (tiny random model, no download)"


def add_parser(sub) -> None:
    from ..bench.stops import StopsConfig

    d = StopsConfig()
    p = sub.add_parser("stops", help=HELP)
    p.add_argument("--num-stops", type=int_range(1), default=d.num_stops, help="per request (default %(default)s)")
    p.add_argument("--num-prompts", type=int_range(1), default=d.num_prompts, help="batch (default %(default)s)")
    p.add_argument("--max-new-tokens", type=int_range(1), default=d.max_new_tokens, help="(default %(default)s)")
    p.add_argument("--repeats", type=int_range(1), default=d.repeats, help="timed runs per case (default %(default)s)")
    p.add_argument("--gamma", type=int_range(1), default=d.gamma, help="prompt-lookup drafts (default %(default)s)")
    p.add_argument("--seed", type=int, default=d.seed, help="model, prompts and stop strings (default %(default)s)")
    p.add_argument("--threads", type=int_range(1), default=1, help="torch threads (default 1: steady on a shared host)")
    p.add_argument("--no-reference", action="store_true", help="skip the slow loops over every string")
    p.add_argument("--json", metavar="FILE", help="also write the raw timings as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..bench import stops
    from ..model.threads import set_threads

    set_threads(args.threads)
    names = ("num_stops", "num_prompts", "max_new_tokens", "repeats", "gamma", "seed")
    cfg = stops.StopsConfig(**{n: getattr(args, n) for n in names}, reference=not args.no_reference)
    return report(args, "stops", stops, stops.run(cfg))
