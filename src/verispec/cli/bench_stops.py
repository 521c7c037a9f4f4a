"""`verispec bench stops`: the engine with no stop strings, with many that never match (and one that does), and
with the loops the automaton replaced, side by side; and the stop-string matcher alone."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..strict_json import dumps
from .options import int_range


def add_parser(sub) -> None:
    from ..bench.stops import StopsConfig

    d = StopsConfig()
    p = sub.add_parser("stops", help="what many stop strings cost per step (tiny random model, no download)")
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
    import torch

    from ..bench import stops

    torch.set_num_threads(args.threads)
    cfg = stops.StopsConfig(
        num_stops=args.num_stops,
        num_prompts=args.num_prompts,
        max_new_tokens=args.max_new_tokens,
        repeats=args.repeats,
        gamma=args.gamma,
        reference=not args.no_reference,
        seed=args.seed,
    )
    result = stops.run(cfg)
    print(f"stop strings on cpu, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(stops.to_markdown(result))
    if args.json:
        Path(args.json).write_text(dumps(result, indent=2))
        print(f"wrote {args.json}")
    return 0
