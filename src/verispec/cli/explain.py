"""`verispec explain`: one speculative step in exact arithmetic."""

from __future__ import annotations

import argparse
import json

from .options import user_errors

HELP = "walk one speculative step through exact arithmetic"


def add_parser(sub) -> None:
    p = sub.add_parser("explain", help=HELP, description=run.__doc__)
    p.add_argument("--p", required=True, help="target distribution, e.g. 0.6,0.3,0.1")
    p.add_argument("--q", required=True, help="draft distribution, e.g. 0.4,0.5,0.1")
    p.add_argument("--labels", help="token names, e.g. cat,dog,fish")
    p.add_argument("--wrong", action="store_true", help="also show two classic wrong resampling rules")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Show, token by token, why accept-with-min(1, p/q) plus resampling from (p - q)+ emits exactly p. Decimal
    inputs are computed exactly."""
    from ..explain import explain, parse_distribution, to_json

    with user_errors():
        p = parse_distribution(args.p, "p")
        q = parse_distribution(args.q, "q")
        labels = [s.strip() for s in args.labels.split(",")] if args.labels else None
        result = explain(p, q, labels, wrong=args.wrong)
    if args.json:
        print(json.dumps(to_json(result), indent=2))
    else:
        _print_tables(result)
    return 0


def _print_tables(result) -> None:
    from rich.console import Console
    from rich.table import Table

    from ..explain import format_fraction as f

    table = Table(title="One speculative step: accept t ~ q when u * q(t) < p(t), else draw from (p - q)+ / Z")
    for col in ("token", "p", "q", "a = min(1, p/q)", "accept mass min(p,q)", "residual (p-q)+", "P(output)", "= p?"):
        table.add_column(col, justify="left" if col == "token" else "right")
    for r in result.tokens:
        table.add_row(
            r.label,
            f(r.p),
            f(r.q),
            "-" if r.accept_prob is None else f(r.accept_prob),
            f(r.accept_mass),
            f(r.residual_mass),
            f(r.output_prob),
            "yes" if r.output_prob == r.p else "NO",
        )
    console = Console(width=max(100, Console().width))
    console.print(table)
    console.print(
        f"P(accept) = sum min(p, q) = {f(result.p_accept)}    "
        f"Z = sum (p - q)+ = {f(result.z)}    (P(reject) = 1 - P(accept) = Z)"
    )
    if result.wrong:
        wrong = Table(title="Classic mistakes: what the output distribution becomes")
        wrong.add_column("token")
        for col in ("p (correct)", "resample from p", "resample from |p - q|"):
            wrong.add_column(col, justify="right")
        for r in result.tokens:
            wrong.add_row(
                r.label,
                f(r.p),
                f(result.wrong["resample_from_p"][r.label]),
                f(result.wrong["resample_from_abs_diff"][r.label]),
            )
        console.print(wrong)
