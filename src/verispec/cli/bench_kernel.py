"""`verispec bench kernel`: verify_chain against a straightforward reference and one read pass."""

from __future__ import annotations

import argparse

from .bench_common import report
from .options import UsageError, int_range

HELP = "time verify_chain against a reference and one read pass"


def _shape(text: str) -> tuple[int, int, int]:
    try:
        b, k, v = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"shape must be BxKxV, e.g. 8x4x151936, got {text!r}") from None
    if b < 1 or k < 1 or v < 2:
        raise argparse.ArgumentTypeError(f"shape needs B >= 1, k >= 1, V >= 2, got {text!r}")
    return b, k, v


def add_parser(sub) -> None:
    from ..bench.kernel import DEFAULT_SHAPES

    shapes = ", ".join("x".join(map(str, s)) for s in DEFAULT_SHAPES)
    p = sub.add_parser("kernel", help=HELP)
    shape_help = f"batch x drafts x vocabulary, BxKxV (repeatable); default: {shapes}"
    p.add_argument("--shape", type=_shape, action="append", help=shape_help)
    p.add_argument("--repeats", type=int_range(1), default=10, help="timed repeats per variant (default 10)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--no-reference", action="store_true", help="skip the slow reference implementation")
    json_help = "also write the raw timings as JSON ({commit, date, command, ..., rows})"
    p.add_argument("--json", metavar="FILE", help=json_help)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from ..bench import kernel

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError("--device cuda asked for, but torch sees no CUDA device")
    shapes = args.shape or list(kernel.DEFAULT_SHAPES)
    result = kernel.run(shapes, repeats=args.repeats, device=args.device, reference=not args.no_reference)
    return report(args, "kernel", kernel, result)
