"""`verispec certify known-bugs`: distribution bugs public engines shipped, each reproduced and shown to FAIL."""

from __future__ import annotations

import argparse
import sys

from .options import add_counts, add_level_arg, add_seed_arg, pick, user_errors

HELP = "reproduce distribution bugs that public engines shipped: each must FAIL, verispec's own samplers PASS"


def add_parser(sub) -> None:
    p = sub.add_parser("known-bugs", help=HELP, description=run.__doc__)
    samples = "speculative steps per case for every chain entry, overriding each entry's own size"
    tail = "races of the tail test (default: its powered size, 53000)"
    add_counts(p, ("--samples", 100, None, samples), ("--tail-draws", 1, None, tail))
    p.add_argument("--only", help="comma-separated subset of the entries (bugs and controls, by name)")
    add_level_arg(p)
    add_seed_arg(p)
    p.add_argument("--full", action="store_true", help="the slow tier's sizes (chain entries on every default case)")
    p.add_argument("--out", default="certify-out", help="folder for known-bugs.{md,json}")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run the known-bugs suite: small samplers that each reproduce a distribution bug a public engine shipped (the
    bonus token without temperature, q before temperature or before top-k, a p = 0 draft accepted, the residual
    taken from p, SPEC-RL's reuse rule, block verification's residual, float32 exponential-race noise) through
    verispec's kernel certificate or an exact tail test, next to verispec's own samplers. Exit status 0 iff every
    bug FAILED and every control PASSED."""
    from rich.console import Console

    from ..certify.known_bugs import run_known_bugs, select_entries, write_report

    with user_errors():
        select_entries(args.only)  # unknown names are a usage error before anything runs
        with Console(stderr=True).status("known bugs") as status:
            options = pick(args, "samples", "tail_draws", "level", "seed", "only", "full")
            report = run_known_bugs(**options, progress=lambda what: status.update(f"known bugs: {what}"))
    md, js = write_report(report, args.out)
    _print_table(report)
    print(f"report: {md}, {js}", file=sys.stderr)
    return 0 if report.ok else 1


def _print_table(report) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"verispec certify known-bugs: {'ok' if report.ok else 'MISMATCH'} ({report.seconds:.1f} s)")
    for col in ("entry", "engine", "expected", "verdict", "p-value", "samples", "s"):
        table.add_column(col, justify="right" if col in ("p-value", "samples", "s") else "left")
    from ..certify.known_bugs import pvalue_cell

    for r in report.rows:
        verdict = r.verdict if r.ok else f"[bold red]{r.verdict}[/] (expected {r.expected})"
        table.add_row(r.name, r.engine, r.expected, verdict, pvalue_cell(r), str(r.samples), f"{r.seconds:.1f}")
    console = Console(width=max(100, Console().width))
    console.print(table)
    for r in report.mismatches:
        console.print(f"mismatch: {r.name} gave {r.verdict}, expected {r.expected}")
