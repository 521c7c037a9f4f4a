"""`verispec certify kernel`: certify a chain (or tree) verification function against exactly known laws."""

from __future__ import annotations

import argparse
import sys

from .options import UsageError, add_counts, add_level_arg, add_seed_arg, user_errors

HELP = "certify a chain (or --tree) verification function against exactly known laws"
SAMPLER_HELP = "module:function or file.py:function with verify_chain's (or, with --tree, verify_tree's) interface"


def add_parser(sub) -> None:
    from ..certify.bugs import BLOCK_BUGS, BUGS, COUPLING_BUGS, TREE_BUGS, TREE_NON_BUGS
    from ..certify.kernel import DEFAULT_SAMPLES
    from ..certify.tree_kernel import DEFAULT_TREE_SAMPLES
    from ..sampling.tree import VERIFY_RULES

    p = sub.add_parser("kernel", help=HELP, description=run.__doc__)
    p.add_argument("--sampler", help=SAMPLER_HELP)
    p.add_argument(
        "--tree",
        choices=(*VERIFY_RULES, "all"),
        help="certify trees whose children were drawn this way ('mixed': chosen and sampled children side by side)",
    )
    p.add_argument(
        "--verify",
        choices=("token", "block"),
        default="token",
        help="the chain rule: token-wise (its exact one-step laws are tested) or block verification (the laws of "
        "the completed sequence, which every lossless rule keeps, are tested; with --sampler: a block verifier)",
    )
    p.add_argument(
        "--coupling",
        choices=("gumbel",),
        help="certify Gumbel-coupled verification (the target's race winner at every position; drafts kept while "
        "they equal it) against the completed-sequence laws",
    )
    p.add_argument(
        "--seeding",
        choices=("position",),
        help="certify position-keyed verification (each row's last draft verified like the others, no bonus after "
        "it) against the completed-sequence laws",
    )
    bugs = f"chain bugs {', '.join(BUGS)}; with --verify block: {', '.join(BLOCK_BUGS)}; with --coupling gumbel: "
    bugs += f"{', '.join(COUPLING_BUGS)}; with --tree: {', '.join(TREE_BUGS)}"
    looks_wrong = f"(and {', '.join(TREE_NON_BUGS)}, which only looks wrong: it is lossless)"
    p.add_argument("--inject", help=f"certify a deliberately broken verifier instead (must FAIL): {bugs} {looks_wrong}")
    samples = f"speculative steps per case (default {DEFAULT_SAMPLES}; {DEFAULT_TREE_SAMPLES} with --tree)"
    add_counts(
        p, ("--samples", 1, None, samples), ("--vocab", 2, None, "vocabulary of the cases (default 32; 6 with --tree)")
    )
    add_level_arg(p)
    p.add_argument("--cases", help="comma-separated subset of the cases")
    add_seed_arg(p)
    p.add_argument("--out", default="certify-out", help="folder for kernel-certificate.{md,json}")
    p.add_argument("--verbose", action="store_true", help="print every test, not just the summary")
    p.set_defaults(func=run)


_OWN = {  # kind -> verispec's own verifier of that kind (the default sampler), by where it lives
    "tree": "sampling.tree:verify_tree",
    "block": "sampling.block:verify_block",
    "coupling": "sampling.coupling:gumbel_verifier",
    "positional": "sampling.positional:positional_verifier",
    "chain": "sampling:verify_chain",
}
_WHERE = {"tree": " (with --tree)", "block": " (with --verify block)", "coupling": " (with --coupling)"}


def _sampler(args: argparse.Namespace, tree: bool):
    """(the verifier to certify, its name in the report)."""
    from ..certify import bugs
    from ..certify.kernel import load_sampler

    block = args.verify == "block"
    if args.sampler and args.inject:
        raise UsageError("--sampler and --inject exclude each other (--inject replaces verispec's own verifier)")
    if block and (tree or args.coupling):
        raise UsageError("--verify block applies to chains, without --tree or --coupling")
    if tree and args.coupling:
        raise UsageError("--coupling applies to chains here (the engine couples trees too; certify them end to end)")
    if args.seeding and (tree or args.coupling or block or args.inject):
        alone = "no --tree, --coupling, --verify block or --inject"
        raise UsageError(f"--seeding position certifies the token-wise chain rule alone ({alone})")
    if args.sampler:
        return load_sampler(args.sampler), args.sampler
    chosen = (("tree", tree), ("block", block), ("coupling", args.coupling), ("positional", args.seeding))
    kind = next((k for k, on in chosen if on), "chain")
    if not args.inject:
        return load_sampler(f"verispec.{_OWN[kind]}"), f"verispec.{_OWN[kind]}"
    known, make = bugs.KINDS[kind]
    if args.inject not in known:
        raise UsageError(
            f"--inject {args.inject} is not a {kind} bug; {kind} bugs{_WHERE.get(kind, '')}: {', '.join(known)}"
        )
    return make(args.inject), f"verispec.certify.bugs:{args.inject}"


def _cases(args: argparse.Namespace, rules):
    """The cases to run: every default case (of `rules` for trees), or the --cases subset."""
    from ..certify.kernel import default_cases, select
    from ..certify.tree_kernel import default_tree_cases

    if rules:
        cases = [c for c in default_tree_cases(vocab=args.vocab or 6, seed=args.seed) if c.draw in rules]
    else:
        cases = default_cases(vocab=args.vocab or 32, seed=args.seed)
    if not args.cases:
        return cases
    try:
        wanted = select(args.cases, [c.name for c in cases], "case(s)")
    except ValueError as e:
        raise UsageError(f"--cases: {e}") from None
    return [c for c in cases if c.name in wanted]


def run(args: argparse.Namespace) -> int:
    """Run a battery of (p, q) cases through a chain verifier (verispec's, or --sampler module:function with
    verify_chain's interface) and test every emitted position's distribution. With --verify block: verispec's block
    verifier (or the --sampler) against the laws of the completed sequence; with --coupling gumbel, Gumbel-coupled
    verification against the same laws. With --tree RULE: trees drafted with that rule through a tree verifier
    (verify_tree's interface; rule 'mixed' also passes sampled=). Exit status 0 = PASS, 1 = FAIL or INCONCLUSIVE."""
    from rich.console import Console

    from ..certify.kernel import DEFAULT_SAMPLES, certify_kernel, write_report
    from ..certify.tree_kernel import DEFAULT_TREE_SAMPLES, certify_tree_kernel
    from ..sampling.tree import VERIFY_RULES

    tree = args.tree is not None
    rules = (VERIFY_RULES if args.tree == "all" else (args.tree,)) if tree else ()
    with user_errors():
        sampler, name = _sampler(args, tree)
        cases = _cases(args, rules)
        with Console(stderr=True).status("certifying") as status:
            common = dict(cases=cases, level=args.level, seed=args.seed, name=name)
            common["progress"] = lambda c: status.update(f"case {c}")
            if tree:
                report = certify_tree_kernel(
                    sampler, rules=rules, samples=args.samples or DEFAULT_TREE_SAMPLES, **common
                )
            else:
                laws = "sequence" if args.verify == "block" or args.coupling or args.seeding else "step"
                report = certify_kernel(sampler, samples=args.samples or DEFAULT_SAMPLES, laws=laws, **common)
    md, js = write_report(report, args.out)
    print(report.to_markdown() if args.verbose else _summary(report))
    print(f"report: {md}, {js}", file=sys.stderr)
    return 0 if report.passed else 1


def _summary(report) -> str:
    lines = [
        f"verispec certify kernel: {report.verdict} ({report.sampler})",
        f"  {len(report.cases)} cases x {report.samples_per_case} steps, {len(report.tests)} chi-square tests, "
        f"Holm family-wise level {report.level}",
        f"  {report.power_note()}",
    ]
    lines += [f"  error: {e}" for e in report.errors]
    for t in sorted(report.failing, key=lambda t: t.pvalue)[:10]:
        lines.append(f"  rejected: {t.case} / {t.test}: p = {t.pvalue:.3g} (Holm {t.holm_pvalue:.3g})")
    return "\n".join(lines)
