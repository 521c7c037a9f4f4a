"""`verispec bench rl`: a real RL loop (GRPO, a verifiable reward) on the target, every drafting method side by side
on the same policy: tau, acceptance, rollout tokens/s, head training and each step's wall time."""

from __future__ import annotations

import argparse

from .bench_common import TARGET_HELP, add_fields, run_on_models
from .options import UsageError, add_counts, add_device_args, add_seed_arg, flag, pick, user_errors

HELP = "a real RL loop (GRPO on arithmetic): tau, tokens/s and wall time per step, every drafting method"

_COUNTS = {  # the integer options: field -> (lowest value, help)
    "steps": (1, "policy steps (default %(default)s)"),
    "group": (2, "samples per prompt, G (default %(default)s)"),
    "prompts_per_step": (1, "prompts per policy step, P (default %(default)s)"),
    "pool": (1, "distinct problems, cycled: an epoch every pool / P steps (default %(default)s)"),
    "max_new_tokens": (1, "per sample (default %(default)s)"),
    "frozen_steps": (1, "the frozen head's data: the rollouts of this many steps, P x G each (default %(default)s)"),
    "head_steps": (1, "the frozen head's training steps (default %(default)s)"),
}
_OPTIONS = (("--lr", float, "the policy's Adam learning rate (default %(default)s)"),)


def _methods(text: str) -> tuple[str, ...]:
    """--methods: comma-separated names of METHODS, each one whose drafter this build has."""
    from ..bench.rl import METHODS, method_config
    from ..engine.config import SpecError

    names = tuple(m.strip() for m in text.split(",") if m.strip())
    if not names or any(m not in METHODS for m in names) or len(set(names)) < len(names):
        raise argparse.ArgumentTypeError(f"distinct names from {', '.join(METHODS)}, got {text!r}")
    for m in names:
        try:
            method_config(m)
        except SpecError as e:
            raise argparse.ArgumentTypeError(f"{m}: {e}") from None
    return names


def add_parser(sub) -> None:
    from ..bench.rl import RLBenchConfig
    from .constants import RUNNER_KINDS

    d = RLBenchConfig()
    p = sub.add_parser("rl", help=HELP)
    p.add_argument("--target", help=TARGET_HELP)
    add_counts(p, *((flag(c), low, getattr(d, c), text) for c, (low, text) in _COUNTS.items()))
    methods_help = f"comma-separated; the policy trains on the first's rollouts (default {','.join(d.methods)})"
    p.add_argument("--methods", type=_methods, default=d.methods, help=methods_help)
    add_fields(p, d, *_OPTIONS)
    add_seed_arg(p)
    runners = tuple(k for k in RUNNER_KINDS if k != "llamacpp")  # the weights are updated in place
    p.add_argument("--runner", choices=runners, default="auto", help="verispec's model forward (default auto)")
    add_device_args(p)
    p.add_argument("--out", default="bench-rl", help="folder for rl.json, rl.md and rl.png (default %(default)s)")
    p.set_defaults(func=run, draft=None, torch_only=True)


def run(args: argparse.Namespace) -> int:
    from ..bench import rl

    if not args.lr > 0:
        raise UsageError(f"--lr must be > 0, got {args.lr}")
    with user_errors():
        cfg = rl.RLBenchConfig(**pick(args, *_COUNTS, "lr", "seed", "runner"), methods=args.methods)
    return run_on_models(args, "rl", rl, cfg, rl.run_rl_bench, prompts={})
