"""`verispec serve`: the OpenAI-compatible HTTP server."""

from __future__ import annotations

import argparse
import os
import sys

from .generate import build_generator
from .options import UsageError, add_counts, add_speculation_args, check_draft, draft_label, int_range


def add_parser(sub) -> None:
    from uvicorn.config import LOG_LEVELS

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (completions, chat, streaming, metrics)")
    add_speculation_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int_range(1, 65535), default=8000)
    p.add_argument("--served-model-name", help="the model id clients send (default: --target)")
    add_counts(
        p,
        ("--max-batch", 1, 8, "rows (choices) decoded together (default %(default)s)"),
        ("--max-queue", 0, 64, "requests waiting for a batch slot; beyond, 429 with Retry-After (default %(default)s)"),
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get("VERISPEC_API_KEY"),
        help="require 'Authorization: Bearer KEY' on every route but /health, /version and /metrics (default: "
        "$VERISPEC_API_KEY; none: open)",
    )
    p.add_argument(
        "--cors-origin",
        action="append",
        dest="cors_origins",
        metavar="ORIGIN",
        help="allow browser requests from this origin (repeatable; '*' for any)",
    )
    levels = list(LOG_LEVELS)
    p.add_argument(
        "--log-level", choices=levels, default="warning", help="the HTTP server's log level (default warning)"
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import logging

    import uvicorn

    from ..model.loading import DEFAULT_MODEL_NAME
    from ..serve import create_app

    tree = check_draft(args)
    gen = build_generator(args, tree)
    name = args.served_model_name or args.target or DEFAULT_MODEL_NAME
    if args.api_key == "":
        raise UsageError("--api-key must not be empty")
    app = create_app(
        gen,
        name,
        max_batch=args.max_batch,
        max_queue=args.max_queue,
        api_key=args.api_key,
        cors_origins=args.cors_origins,
    )
    logging.basicConfig(level=logging.INFO)
    print(
        f"serving {name!r} on http://{args.host}:{args.port}/v1 (draft={draft_label(args, tree)}, gamma={args.gamma})",
        file=sys.stderr,
        flush=True,
    )
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0
