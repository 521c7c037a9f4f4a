"""`verispec certify study`: how far classic speculative-sampling mistakes move the output, and their verdicts."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..strict_json import dumps
from .certify_generate import MIN_SAMPLES, load_reference
from .options import (
    UsageError,
    add_counts,
    add_level_arg,
    add_prompt_args,
    add_sampling_args,
    add_seed_arg,
    check_model_path,
    gamma_type,
    model_errors,
    pick,
    read_prompts,
    sampling_params,
)

HELP = (
    "measure how far classic mistakes (temperature mismatch, a bf16 / fp16 target, lossy acceptance rules: "
    "lenient, typical, SPEC-RL's rollout reuse) move the output, and the certificate's verdict on each"
)


def add_parser(sub) -> None:
    from ..certify.study import VARIANTS

    p = sub.add_parser("study", help=HELP)
    p.add_argument("--target", help="target model (default: the built-in default model)")
    p.add_argument("--draft", required=True, help="draft model (sharing the target's tokenizer)")
    p.add_argument("--variants", help=f"comma-separated subset of {', '.join(VARIANTS)} (default: all)")
    add_sampling_args(p, ("temperature", "top_k", "top_p"), temperature=0.7)
    add_prompt_args(p)
    certify = "N of the generator certificate run on each variant (0 = deviations only, default)"
    add_counts(
        p,
        ("--contexts", 1, 16, "target continuations per prompt used as contexts (default %(default)s)"),
        ("--length", 1, 8, "tokens per continuation (default %(default)s)"),
        ("--certify-samples", 0, 0, certify),
    )
    p.add_argument("--gamma", type=gamma_type(auto=False), default=4, help="drafts per step (default 4)")
    add_level_arg(p)
    add_seed_arg(p)
    p.add_argument("--out", default="certify-out", help="folder for study.{md,json}")
    p.set_defaults(func=run)


def _variants(args: argparse.Namespace) -> list[str] | None:
    """The variants asked for (None: all), every option checked (no model loaded yet)."""
    from ..certify.kernel import select
    from ..certify.study import VARIANTS

    if args.temperature == 0:
        raise UsageError("--temperature must be > 0 for the study (at temperature 0 every variant here is exact)")
    if args.draft in ("ngram", "self", "none"):
        raise UsageError("--draft takes a draft model: the study compares its probabilities with the target's")
    if 0 < args.certify_samples < MIN_SAMPLES:
        raise UsageError(f"--certify-samples must be 0 (off) or >= {MIN_SAMPLES}, got {args.certify_samples}")
    if not args.variants:
        return None
    try:
        return select(args.variants, list(VARIANTS), "variant(s)")
    except ValueError as e:
        raise UsageError(f"--variants: {e}") from None


def run(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from ..certify.study import run_study, study_markdown

    params = sampling_params(args)
    variants = _variants(args)
    texts = read_prompts(args)
    check_model_path(f"--target {args.target}", args.target)
    if args.draft not in ("ngram", "self", "none"):
        check_model_path(f"--draft {args.draft}", args.draft)
    with model_errors():
        _, prompts = load_reference(args, texts)
        options = pick(args, "contexts", "length", "certify_samples", "gamma", "level", "seed")
        rows = run_study(
            args.target, args.draft, prompts, params, variants=variants, certify_length=args.length, **options
        )
    n = args.certify_samples
    certificate = f"N = {n}, L = {args.length}, level {args.level}" if n else "not run (--certify-samples 0)"
    header = (
        f"# verispec certify study\n\ntarget `{args.target}`, draft `{args.draft}`; {params}; {len(prompts)} "
        f"prompt(s) x {args.contexts} contexts x {args.length} positions for the deviations; certificate: "
        + certificate
    )
    md = study_markdown(rows, header)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "study.md").write_text(md)
    (out / "study.json").write_text(dumps([asdict(r) for r in rows], indent=1))
    print(md)
    return 0
