"""`verispec bench kernel`: verify_chain against a straightforward reference and one read pass."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..strict_json import dumps
from .options import UsageError, int_range


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
    p = sub.add_parser("kernel", help="time verify_chain against a reference and one read pass")
    p.add_argument(
        "--shape",
        type=_shape,
        action="append",
        help=f"batch x drafts x vocabulary, BxKxV (repeatable); default: {shapes}",
    )
    p.add_argument("--repeats", type=int_range(1), default=10, help="timed repeats per variant (default 10)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--no-reference", action="store_true", help="skip the slow reference implementation")
    p.add_argument(
        "--json", metavar="FILE", help="also write the raw timings as JSON ({commit, date, command, ..., rows})"
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from ..bench import kernel, provenance, provenance_line

    origin = provenance()  # the code, date and command at the start of the run
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError("--device cuda asked for, but torch sees no CUDA device")
    shapes = args.shape or list(kernel.DEFAULT_SHAPES)
    rows = kernel.run(shapes, repeats=args.repeats, device=args.device, reference=not args.no_reference)
    print(
        f"verify_chain on {args.device}, torch {torch.__version__}, {torch.get_num_threads()} threads; "
        "median times; 'x read' = time / one read pass over the inputs\n"
    )
    print(kernel.to_markdown(rows))
    print(f"\n{provenance_line(origin)}")
    if args.json:
        Path(args.json).write_text(dumps({**origin, "device": args.device, "rows": rows}, indent=2))
        print(f"wrote {args.json}")
    return 0
