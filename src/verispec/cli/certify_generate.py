"""`verispec certify generate`: certify a generator's continuations against the target's own conditionals."""

from __future__ import annotations

import argparse
import sys

from .options import (
    UsageError,
    add_counts,
    add_coupling_arg,
    add_device_args,
    add_level_arg,
    add_prompt_args,
    add_quant_arg,
    add_runner_arg,
    add_sampling_args,
    add_seed_arg,
    add_seeding_arg,
    add_tree_args,
    add_verify_arg,
    check_draft,
    dtype_name,
    gamma_type,
    model_errors,
    pick,
    read_prompts,
    sampling_params,
    tree_spec,
)

MIN_SAMPLES = 20  # certify_generate's own minimum, checked here before the target loads
HELP = "certify a generator's continuations against the target's conditionals"


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help=HELP, description=run.__doc__)
    p.add_argument("--target", help="target model (default: the built-in default model)")
    _add_method_args(p)
    add_sampling_args(p, ("temperature", "top_k", "top_p", "min_p"))
    add_prompt_args(p)
    _add_certificate_args(p)
    p.set_defaults(func=run)


def _add_method_args(p: argparse.ArgumentParser) -> None:
    from ..certify.bugs import BLOCK_BUGS, BUGS, TREE_BUGS
    from ..certify.generate import LOSSY_VERIFIERS, METHODS

    p.add_argument(
        "--method",
        choices=METHODS,
        default="verispec",
        help="verispec (default), plain (verispec without drafts), hf (transformers generate), "
        "hf-assisted (transformers' assisted generation, --draft as the assistant), callable "
        "(--callable)",
    )
    p.add_argument(
        "--draft", default="ngram", help="verispec: draft model, ngram, self or none; hf-assisted: the assistant model"
    )
    add_quant_arg(p, "--draft-quant", "weight-only quantize verispec's draft model (or --draft self)")
    p.add_argument("--gamma", type=gamma_type(), default=4, help="verispec drafts per step, or auto (default 4)")
    add_runner_arg(p, "verispec's model forward (default auto)")
    add_device_args(p, device=False, dtype_help="the method's target precision (scoring is float32)")
    p.add_argument(
        "--draft-dtype", type=dtype_name, default="float32", help="the draft model's precision (default float32)"
    )
    p.add_argument("--callable", help="module:function mapping (prompt_ids, params dict, seed) -> token ids")
    p.add_argument(
        "--inject",
        help=f"verispec with a deliberately broken verifier (must FAIL): {', '.join(BUGS)}; "
        f"or a lossy acceptance rule: {LOSSY_VERIFIERS} (spec-rl: SPEC-RL's rollout reuse, a fresh draw from p "
        f"at a rejection); with --verify block: {', '.join(BLOCK_BUGS)}; with --tree: {', '.join(TREE_BUGS)}",
    )
    add_tree_args(p)
    add_verify_arg(p)
    add_coupling_arg(p)
    add_seeding_arg(p)


def _add_certificate_args(p: argparse.ArgumentParser) -> None:
    from ..certify.generate import DEFAULT_LENGTH, DEFAULT_SAMPLES

    add_counts(
        p,
        ("--samples", MIN_SAMPLES, DEFAULT_SAMPLES, "continuations per prompt (default %(default)s)"),
        ("--length", 1, DEFAULT_LENGTH, "tokens per continuation (default %(default)s)"),
        ("--two-sample-tokens", 0, 2, "positions compared with plain decoding samples (0 = off; default 2)"),
    )
    add_level_arg(p)
    p.add_argument("--workers", type=int, default=1, help="processes drawing samples (default 1)")
    add_seed_arg(p)
    p.add_argument("--out", default="certify-out", help="folder for generate-certificate.{md,json,png}")


def _method_spec(args: argparse.Namespace):
    """The MethodSpec of the options, every combination checked (no model loaded yet)."""
    from ..certify.generate import MethodSpec

    if args.method == "verispec":
        check_draft(args)
    elif tree_spec(args) is not None:
        raise UsageError(f"--tree applies to --method verispec, not to --method {args.method}")
    if args.method == "hf-assisted" and args.draft in ("ngram", "self", "none"):
        raise UsageError("--method hf-assisted needs --draft PATH: the assistant model")
    if args.method == "callable" and not args.callable:
        raise UsageError("--method callable needs --callable module:function")
    if args.workers < 1:
        raise UsageError(f"--workers must be >= 1, got {args.workers}")
    try:
        return MethodSpec(
            method=args.method,
            target=args.target,
            draft=args.draft,
            draft_quant=args.draft_quant,
            gamma=args.gamma,
            runner=args.runner,
            dtype=args.dtype,
            draft_dtype=args.draft_dtype,
            callable=args.callable,
            verifier=args.inject,
            tree=args.tree,
            tree_rule=args.tree_rule,
            verify=args.verify,
            coupling=args.coupling,
            seeding=args.seeding,
        )
    except ValueError as e:  # what MethodSpec still checks itself is the --inject name
        raise UsageError(f"--inject {args.inject}: {e}" if args.inject else str(e)) from None


def load_reference(args: argparse.Namespace, texts: list[str]):
    """(the float32 reference target, the prompts' token ids): what every certificate scores against."""
    from ..certify.generate import _load, encode_prompt

    print("loading the reference target (float32) ...", file=sys.stderr, flush=True)
    ref = _load(args.target, "float32")
    return ref, [encode_prompt(ref.tokenizer, t, args.chat) for t in texts]


def run(args: argparse.Namespace) -> int:
    """Draw N continuations of L tokens per prompt from a method and test them against the target model's own
    distribution (first-token and sequence goodness of fit, PIT uniformity, log-likelihood, two-sample vs plain
    decoding). Exit status 0 = PASS, 1 = FAIL."""
    from ..certify.generate import certify_generate, write_report

    params = sampling_params(args)
    spec = _method_spec(args)
    texts = read_prompts(args)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    with model_errors():
        ref, prompts = load_reference(args, texts)
        options = pick(args, "samples", "length", "level", "seed", "workers", "two_sample_tokens")
        report = certify_generate(spec, prompts, params, reference=ref, **options)
    files = write_report(report, args.out)
    print(report.to_markdown())
    print(f"report: {', '.join(str(f) for f in files)}", file=sys.stderr)
    return 0 if report.passed else 1
