"""`verispec certify generate`: certify a generator's continuations against the target's own conditionals."""

from __future__ import annotations

import argparse
import sys

from .options import (
    UsageError,
    add_constraint_args,
    add_counts,
    add_device_args,
    add_level_arg,
    add_prompt_args,
    add_sampling_args,
    add_seed_arg,
    add_spec_args,
    dtype_name,
    model_errors,
    pick,
    read_prompts,
    sampling_params,
    spec_config,
)

MIN_SAMPLES = 20  # certify_generate's own minimum, checked here before the target loads
HELP = "certify a generator's continuations against the target's conditionals"


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help=HELP, description=run.__doc__)
    p.add_argument("--target", help="target model (default: the built-in default model)")
    _add_method_args(p)
    add_sampling_args(p, ("temperature", "top_k", "top_p", "min_p"))
    add_constraint_args(p)  # the law under test is then the constrained one (certify/scoring.py)
    add_prompt_args(p)
    _add_certificate_args(p)
    p.set_defaults(func=run)


def _add_method_args(p: argparse.ArgumentParser) -> None:
    from ..certify.bugs import BLOCK_BUGS, BUGS, TREE_BUGS
    from ..certify.methods import CERTIFY_SPEC, METHODS
    from ..certify.mutants import CROSS_VOCAB_BUGS, GRAMMAR_BUGS, GRAMMAR_NON_BUGS, HEAD_BUGS, LOSSY_VERIFIERS

    p.add_argument(
        "--method",
        choices=METHODS,
        default="verispec",
        help="verispec (default), plain (verispec without drafts), hf (transformers generate), "
        "hf-assisted (transformers' assisted generation, --draft as the assistant), hf-lookup (transformers' "
        "prompt lookup, --gamma tokens), callable (--callable), openai (an OpenAI-compatible endpoint: --base-url, "
        "--model)",
    )
    draft = "verispec: the drafter (as `verispec generate --draft`); hf-assisted: the assistant model"
    add_spec_args(p, draft_help=draft, gamma_help=f"verispec drafts per step, or auto (default {CERTIFY_SPEC.gamma})")
    add_device_args(p, device=False, dtype_help="the method's target precision (scoring is float32)")
    p.add_argument(
        "--draft-dtype", type=dtype_name, default="float32", help="the draft model's precision (default float32)"
    )
    p.add_argument("--callable", help="module:function mapping (prompt_ids, params dict, seed) -> token ids")
    p.add_argument(
        "--inject",
        help=f"verispec with a deliberately broken verifier (must FAIL): {', '.join(BUGS)}; "
        f"or a lossy acceptance rule: {LOSSY_VERIFIERS} (spec-rl: SPEC-RL's rollout reuse, a fresh draw from p "
        f"at a rejection); with --spec verify=block: {', '.join(BLOCK_BUGS)}; with --tree: {', '.join(TREE_BUGS)}; "
        f"with a constraint (--json-schema ...): {', '.join(GRAMMAR_BUGS)}, or the lossless control "
        f"{', '.join(GRAMMAR_NON_BUGS)}; with a --draft of another tokenizer: {', '.join(CROSS_VOCAB_BUGS)}; "
        f"with a --draft EAGLE-3 head directory (chains): {', '.join(HEAD_BUGS)}",
    )
    _add_endpoint_args(p)


def _add_endpoint_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("--method openai (certify another engine's server)")
    g.add_argument("--base-url", help="the endpoint, e.g. http://localhost:8000 or http://localhost:8000/v1")
    g.add_argument("--model", help="the model name the endpoint serves")
    g.add_argument("--api-key", help="sent as a Bearer token (default: $OPENAI_API_KEY when set)")
    g.add_argument("--max-in-flight", type=int, default=8, help="concurrent requests (default 8)")
    g.add_argument(
        "--reference-url",
        help="the two-sample reference: another endpoint, or the same server with speculation off (no "
        "assumption about numerics); default: verispec's plain decoding of --target",
    )
    g.add_argument("--reference-model", help="the model name at --reference-url (default: --model)")
    g.add_argument(
        "--tv-tolerance",
        type=float,
        default=0.0,
        help="test TV <= this against --target instead of exact equality (another engine's numerics; "
        "PIT / log-likelihood / sequence tests are left out, the two-sample test runs only with --reference-url)",
    )


def _endpoint_fields(args: argparse.Namespace) -> dict:
    """MethodSpec's endpoint fields from the options (checked)."""
    import os

    given = [o for o in ("base_url", "model", "reference_url", "reference_model", "api_key") if getattr(args, o)]
    given += ["max_in_flight"] if args.max_in_flight != 8 else []
    if args.method != "openai":
        if given:
            raise UsageError(f"--{given[0].replace('_', '-')} applies to --method openai")
        return {}
    if not (args.base_url and args.model):
        raise UsageError("--method openai needs --base-url URL and --model NAME (the model the endpoint serves)")
    if args.max_in_flight < 1:
        raise UsageError(f"--max-in-flight must be >= 1, got {args.max_in_flight}")
    key = args.api_key or os.environ.get("OPENAI_API_KEY")
    return dict(base_url=args.base_url, model_name=args.model, api_key=key, max_in_flight=args.max_in_flight)


def _reference_fn(args: argparse.Namespace, spec):
    """The two-sample reference's sample function: the --reference-url endpoint, or None (plain decoding)."""
    from dataclasses import replace

    from ..certify.methods import build_method

    if not args.reference_url:
        return None
    return build_method(replace(spec, base_url=args.reference_url, model_name=args.reference_model or args.model))


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
    p.add_argument(
        "--quiet",
        "-q",
        action="store_true",
        help="no progress on stderr (default: a bar on a terminal, else a line every 30 s per phase: sampling, "
        "scoring, two-sample reference)",
    )


def _method_spec(args: argparse.Namespace):
    """The MethodSpec of the options, every combination checked (no model loaded yet)."""
    from ..certify.methods import CERTIFY_DEFAULTS, MethodSpec

    config = spec_config(args, CERTIFY_DEFAULTS)  # verispec's (plain: random and runner; hf-*: model, gamma)
    if args.method != "verispec" and config.tree is not None:
        raise UsageError(f"--tree applies to --method verispec, not to --method {args.method}")
    if args.method == "hf-assisted" and config.draft != "model":
        raise UsageError("--method hf-assisted needs --draft PATH: the assistant model")
    if args.method == "hf-assisted":
        from ..heads import head_kind

        if kind := head_kind(config.model):
            raise UsageError(
                f"--method hf-assisted: --draft {config.model} is a hidden-state head ({kind}), not a model "
                "transformers' assisted generation runs; certify it with --method verispec"
            )
    if args.method == "callable" and not args.callable:
        raise UsageError("--method callable needs --callable module:function")
    if args.workers < 1:
        raise UsageError(f"--workers must be >= 1, got {args.workers}")
    if not 0 <= args.tv_tolerance < 1:
        raise UsageError(f"--tv-tolerance must lie in [0, 1), got {args.tv_tolerance}")
    endpoint = _endpoint_fields(args)
    try:
        chosen = pick(args, "method", "target", "dtype", "draft_dtype", "callable")
        return MethodSpec(**chosen, config=config, verifier=args.inject, **endpoint)
    except ValueError as e:  # what MethodSpec still checks itself is the --inject name
        raise UsageError(f"--inject {args.inject}: {e}" if args.inject else str(e)) from None


def load_reference(args: argparse.Namespace, texts: list[str]):
    """(the float32 reference target, the prompts' token ids): what every certificate scores against."""
    from ..certify.generate import encode_prompt
    from ..certify.methods import _load

    if not getattr(args, "quiet", False):
        print("loading the reference target (float32) ...", file=sys.stderr, flush=True)
    ref = _load(args.target, "float32")
    return ref, [encode_prompt(ref.tokenizer, t, args.chat) for t in texts]


def run(args: argparse.Namespace) -> int:
    """Draw N continuations of L tokens per prompt from a method and test them against the target model's own
    distribution (first-token and sequence goodness of fit, PIT uniformity, log-likelihood, two-sample vs plain
    decoding). With a structured-output constraint (--json-schema, --json-object, --regex, --choice, --grammar) the
    target's law is the constrained one and the method is asked for the constraint. Exit status 0 = PASS,
    1 = FAIL or INCONCLUSIVE."""
    from ..certify.generate import certify_generate
    from ..certify.report import write_report
    from .progress import ProgressDisplay

    params = sampling_params(args)
    spec = _method_spec(args)
    texts = read_prompts(args)
    if args.threads:
        from ..model.threads import set_threads

        set_threads(args.threads)  # every model of the run, torch's and llama.cpp's (`load_model` keeps it)
    with model_errors():
        ref, prompts = load_reference(args, texts)
        options = pick(args, "samples", "length", "level", "seed", "workers", "two_sample_tokens")
        options |= dict(reference=ref, reference_fn=_reference_fn(args, spec), tv_tolerance=args.tv_tolerance)
        with ProgressDisplay(args.quiet) as display:
            report = certify_generate(spec, prompts, params, **options, show_progress=False, progress=display.update)
    files = write_report(report, args.out)
    print(report.to_markdown())
    print(f"report: {', '.join(str(f) for f in files)}", file=sys.stderr)
    return 0 if report.passed else 1
