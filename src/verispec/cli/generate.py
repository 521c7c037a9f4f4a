"""`verispec generate`: speculative decoding to the terminal (or one JSON object)."""

from __future__ import annotations

import argparse
import sys

from ..strict_json import dumps
from .options import (
    UsageError,
    add_constraint_args,
    add_sampling_args,
    add_seed_arg,
    add_speculation_args,
    check_gguf,
    compile_constraint,
    int_range,
    load,
    model_errors,
    sampling_params,
    spec_config,
    user_errors,
)

HELP = "generate text with speculative decoding (streams to the terminal)"


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help=HELP, description=run.__doc__)
    p.add_argument("prompt", help="the prompt ('-' reads standard input)")
    add_speculation_args(p)
    add_sampling_args(p)
    add_seed_arg(p, None, "seed of this request's random stream (default: a fresh one each run)")
    p.add_argument("--max-new-tokens", type=int_range(1), default=128, help="default 128")
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object (text, tokens, logprobs, stats)")
    add_constraint_args(p)
    p.set_defaults(func=run)


def check_heads(args: argparse.Namespace, models, runner: str | None) -> None:
    """Before any model loads: a draft model that is a hidden-state head (EAGLE-3, EAGLE, Medusa) reads the target's
    hidden states, so the target loads with torch (runner auto picks it) and runner llamacpp is refused."""
    from ..heads import head_kind

    for model in models:
        kind = head_kind(model) if model else None
        if kind is None:
            continue
        if runner == "llamacpp":
            raise UsageError(
                f"--draft {model} is a hidden-state head ({kind}): it reads the target's hidden states, which "
                "llama.cpp does not expose; run the target on the fast or hf runner"
            )
        args.torch_only = True  # (`load`: the target loads with torch, a GGUF file dequantized)


def check_models(args: argparse.Namespace, config) -> None:
    """Before any model loads: the target and draft the config names fit its runner (`check_heads`; llama.cpp runs
    GGUF files only)."""
    check_heads(args, [config.model] if config.drafter.model else [], config.runner)
    if config.runner == "llamacpp":  # (a head was refused above)
        check_gguf(f"--target {args.target}", args.target, "--spec runner=llamacpp")
        model = f"--draft {config.model}" if args.draft else f"--spec model={config.model}"
        check_gguf(model, config.model, "--spec runner=llamacpp")


def build_generator(args: argparse.Namespace, config):
    """Load the target and the draft model the SpecConfig names (`spec_config`: options already checked;
    `check_models`, again where the caller has not) and build a SpeculativeGenerator from the config."""
    from ..engine.generator import SpeculativeGenerator

    check_models(args, config)
    with model_errors():
        target = load(args.target, args)
        draft = load(config.model, args, threads=False, draft=True) if config.drafter.model else None
        return SpeculativeGenerator(target, draft, config=config)


def run(args: argparse.Namespace) -> int:
    """Generate from the target model; every token follows the target's distribution exactly. With no --target, uses
    the built-in default model."""
    params = sampling_params(args, seed=args.seed)
    config = spec_config(args)
    prompt = args.prompt if args.prompt != "-" else sys.stdin.read()
    if not prompt:
        raise UsageError("the prompt is empty")
    gen = build_generator(args, config)
    compile_constraint(gen.core, params, args)
    kwargs = dict(max_new_tokens=args.max_new_tokens, stop=args.stop or (), chat=args.chat)
    from ..model.threads import current_threads, read_sample, threads_hint

    start = read_sample()  # the CPUs' counters: was the run starved of CPU by other processes? (`threads_hint`)
    with user_errors():
        if args.json:
            out = gen.generate(prompt, params, **kwargs)[0]
            doc = {k: getattr(out, k) for k in ("text", "token_ids", "finish_reason", "logprobs", "raw_logprobs")}
            # one request: the call's pooled stats are its own, times included (its Completion's carry none)
            stats = {"drafter": gen.drafter, "threads": current_threads()} | gen.last_stats.summary()
            print(dumps(doc | {"stats": stats}, indent=2))
        else:
            for event in gen.stream(prompt, params, **kwargs):
                sys.stdout.write(event.delta)
                sys.stdout.flush()
            _print_summary(gen, config)
    hint = threads_hint(start)
    if hint:
        print(hint, file=sys.stderr)
    return 0


def _print_summary(gen, config) -> None:
    """The summary line on stderr after a streamed run: tokens, speed, the drafter in use, rates and times."""
    from ..engine.drafters import describe_fallback

    s = gen.last_stats
    fallback = describe_fallback(s, gen.core.proposer is not None)
    drafter = gen.drafter + (f", {fallback}" if fallback else "")
    acceptance = f"{s.acceptance_rate:.2f}" if s.drafted else "-"  # nothing drafted: no rate
    print(
        f"\n[{s.output_tokens} tokens, {s.tokens_per_second:.1f} tok/s, drafter={drafter}, spec {config}, "
        f"acceptance={acceptance}, tau={s.tau:.2f} tokens/pass, prefill {s.prefill_time:.2f}s / "
        f"draft {s.draft_time:.2f}s / verify {s.verify_time:.2f}s / other {s.other_time:.2f}s]",
        file=sys.stderr,
    )
