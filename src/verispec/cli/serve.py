"""`verispec serve`: the OpenAI-compatible HTTP server."""

from __future__ import annotations

import argparse
import math
import os
import socket
import sys

from ..serve.limits import (
    DEFAULT_MAX_QUEUE,
    DEFAULT_MAX_QUEUE_TOKENS,
    DEFAULT_REQUEST_TIMEOUT_S,
    ONLINE_SAVE_INTERVAL_S,
)
from .constants import (
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_MAX_REQUEST_BYTES,
    DEFAULT_READ_TIMEOUT_S,
    LOG_LEVELS,
    PREFILL_CHUNK,
)
from .generate import build_generator, check_models
from .options import UsageError, add_counts, add_speculation_args, int_range, pick, spec_config, user_errors

HELP = "OpenAI-compatible HTTP server (completions, chat, streaming, metrics)"


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help=HELP)
    add_speculation_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int_range(1, 65535), default=8000)
    p.add_argument("--served-model-name", help="the model id clients send (default: --target)")
    add_counts(
        p,
        ("--max-batch", 1, 8, "rows (choices) decoded together (default %(default)s)"),
        (
            "--max-queue",
            0,
            DEFAULT_MAX_QUEUE,
            "choices (prompts x n) that may wait for a batch row (0: none; a request is admitted if a row is free); "
            "beyond, 429 with Retry-After; a request with more than --max-batch + --max-queue choices gets 400 "
            "(default %(default)s)",
        ),
        (
            "--max-queue-tokens",
            1,
            DEFAULT_MAX_QUEUE_TOKENS,
            "prompt tokens the waiting choices may hold (a prompt shared by n choices counts once); beyond, 429 "
            "(default %(default)s)",
        ),
    )
    add_counts(
        p,
        (
            "--prefill-chunk",
            0,
            PREFILL_CHUNK,
            "chunked prefill: while requests decode, a longer prompt is prefilled at most N tokens per step, between "
            "their steps, so they wait one chunk per step instead of the whole prompt (0: off, every prompt "
            "prefilled whole when it joins) (default %(default)s)",
        ),
        metavar="N",
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
    _add_exposure_args(p)
    _add_operator_args(p)
    _add_online_args(p)
    p.add_argument(
        "--log-level", choices=list(LOG_LEVELS), default="warning", help="the HTTP server's log level (default warning)"
    )
    p.set_defaults(func=run)


def _add_exposure_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--enable-weight-updates",
        action="store_true",
        help="let clients replace the served model's weights (POST /update_weights_from_tensor, "
        "/update_weights_from_disk: the RL routes; off: 403). Beyond loopback it needs --api-key",
    )
    p.add_argument(
        "--weight-dir",
        action="append",
        dest="weight_dirs",
        default=[],
        metavar="DIR",
        help="a directory /update_weights_from_disk may read under (repeatable; symlinks are resolved; none: "
        "no update from disk)",
    )
    p.add_argument(
        "--allowed-host",
        action="append",
        dest="allowed_hosts",
        default=[],
        metavar="NAME",
        help="a Host header name the server answers (repeatable; '*.example.com' for subdomains, '*' for any). "
        "Default: on a loopback --host only localhost, 127.0.0.1 and [::1] (no DNS rebinding); otherwise any",
    )
    add_counts(
        p,
        (
            "--max-request-bytes",
            1024,
            DEFAULT_MAX_REQUEST_BYTES,
            "the largest request body, counted while it is read (413 beyond; a weight upload's cap is the model's "
            "size) (default %(default)s)",
        ),
        metavar="N",
    )


def _add_operator_args(p: argparse.ArgumentParser) -> None:
    add_counts(
        p,
        (
            "--max-model-len",
            2,
            None,
            "the most tokens a request may hold, prompt and max_tokens together; beyond, 400 (default: the model's "
            "context; more is refused)",
        ),
        (
            "--max-connections",
            1,
            None,
            "open connections (and requests being answered) at most; beyond, uvicorn answers 503 (default: no cap)",
        ),
        metavar="N",
    )
    p.add_argument(
        "--request-timeout",
        type=_seconds(0, inclusive=False),
        metavar="SECONDS",
        help="a request still running this long after it arrived is stopped at the next step, read by its client "
        f"or not: its unfinished choices end with finish_reason 'abort' and what they have (default "
        f"{DEFAULT_REQUEST_TIMEOUT_S:g} on the OpenAI routes; the RL route /generate/ has a deadline only when this "
        "is given: a rollout cut short would be trained on)",
    )
    for name, kind, default, text in (
        (
            "--shutdown-timeout",
            _seconds(0),
            30.0,
            "on SIGTERM / Ctrl-C: new requests get 503, running ones get this long to finish, then end with "
            "finish_reason 'abort'",
        ),
        (
            "--read-timeout",
            _seconds(0, inclusive=False),
            DEFAULT_READ_TIMEOUT_S,
            "a request's headers must arrive within this long, and its body may not go this long without bytes "
            "(then: the connection closed / 408)",
        ),
        (
            "--body-timeout",
            _seconds(0, inclusive=False),
            DEFAULT_BODY_TIMEOUT_S,
            "a request's whole body must arrive within this long of its first read, plus 1 s per MiB received; "
            "else 408 and the connection closed (a body trickled a byte at a time)",
        ),
    ):
        p.add_argument(name, type=kind, default=default, metavar="SECONDS", help=f"{text} (default %(default)s)")
    p.add_argument(
        "--chat-template",
        metavar="FILE_OR_STRING",
        help="a Jinja chat template (a file, or the template itself) replacing the tokenizer's",
    )
    _add_log_args(p)


def _add_online_args(p: argparse.ArgumentParser) -> None:
    """draft=online's head, kept across restarts (serve.online)."""
    p.add_argument(
        "--online-dir",
        metavar="DIR",
        help="with --spec draft=online: keep the head learned from the traffic in DIR (the published EAGLE-3 layout "
        "and its training state): a server started with DIR continues from the head saved there; a new version is "
        "saved at most every --online-save-interval seconds and at shutdown, each save replacing DIR whole "
        "(atomically). DIR must be new, empty or written by an earlier --online-dir",
    )
    p.add_argument(
        "--online-save-interval",
        type=_seconds(0, inclusive=False),
        default=ONLINE_SAVE_INTERVAL_S,
        metavar="SECONDS",
        help="--online-dir: seconds between two saves at least (default %(default)s)",
    )


def _add_log_args(p: argparse.ArgumentParser) -> None:
    """verispec's own log lines (serve.logs), at INFO: vLLM's flags."""
    p.add_argument(
        "--disable-log-requests",
        action="store_true",
        help="no access line per request (default: one at INFO on the verispec.serve.access logger: client, method, "
        "path, status, request id, prompt and output tokens, latency)",
    )
    p.add_argument(
        "--disable-log-stats",
        action="store_true",
        help="no periodic stats lines (default: vLLM's, at INFO on verispec.serve.stats: throughput, running and "
        "waiting requests, KV cache use, and the speculative-decoding line: mean acceptance length, accepted and "
        "drafted tokens, per-position acceptance rate)",
    )
    p.add_argument(
        "--log-stats-interval",
        type=_seconds(0, inclusive=False),
        default=10.0,
        metavar="SECONDS",
        help="seconds between two stats lines, each logged only when something happened since the last (default "
        "%(default)s, as vLLM)",
    )


def _seconds(low: float, inclusive: bool = True):
    """An argparse type: a number of seconds >= low (> low when not inclusive)."""

    def seconds(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not (value >= low if inclusive else value > low) or math.isinf(value):
            raise argparse.ArgumentTypeError(
                f"must be a number of seconds {'>=' if inclusive else '>'} {low}, got {text!r}"
            )
        return value

    return seconds


def _reserve_port(host: str, port: int) -> socket.socket:
    """Listen on --host:--port before anything loads, as uvicorn will (SO_REUSEADDR), so that a port in use is a usage
    error now and not uvicorn's once the model has loaded. The caller holds the socket while the model loads and
    closes it just before uvicorn binds the port again."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen()
    except socket.gaierror as e:
        sock.close()
        raise UsageError(f"--host {host}: cannot resolve it ({e.strerror or e})") from None
    except OSError as e:
        sock.close()
        raise UsageError(f"--port {port}: cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def _check_access(args: argparse.Namespace):
    """The access options, checked before anything loads: (the chat template, the Host names answered)."""
    from ..serve.access import allowed_hosts, is_loopback
    from ..serve.chat import load_chat_template

    if args.api_key == "":
        raise UsageError("--api-key must not be empty")
    if args.enable_weight_updates and not is_loopback(args.host) and args.api_key is None:
        raise UsageError(
            f"--enable-weight-updates on --host {args.host} (beyond this machine) lets anyone who reaches the port "
            "replace the model: give --api-key too (or $VERISPEC_API_KEY), or bind to 127.0.0.1"
        )
    if args.weight_dirs and not args.enable_weight_updates:
        raise UsageError("--weight-dir is for updates from disk: give --enable-weight-updates too")
    with user_errors():
        template = None if args.chat_template is None else load_chat_template(args.chat_template)
        return template, allowed_hosts(args.host, args.allowed_hosts)


def run(args: argparse.Namespace) -> int:
    import logging

    from ..model.loading import DEFAULT_MODEL_NAME
    from ..serve import create_app
    from ..serve.shutdown import serve

    template, hosts = _check_access(args)
    config = spec_config(args)
    if args.online_dir is not None:  # draft=online from the head saved there, if one is
        from ..serve.online import online_config

        with user_errors():
            config = online_config(config, args.online_dir)
    check_models(args, config)  # every check before the port: a port in use is the last thing to go wrong
    listener = _reserve_port(args.host, args.port)
    try:
        gen = build_generator(args, config)
    finally:
        listener.close()  # uvicorn binds the port again below (the model has loaded: nothing is left to fail first)
    gen.core.prefill_chunk = args.prefill_chunk  # before the server's session is made: it reads it then
    name = args.served_model_name or args.target or DEFAULT_MODEL_NAME
    with user_errors():
        limits = ("max_batch", "max_queue", "max_queue_tokens", "api_key", "cors_origins", "max_model_len")
        exposure = ("enable_weight_updates", "weight_dirs", "max_request_bytes", "read_timeout", "body_timeout")
        online = ("online_dir", "online_save_interval")
        timeouts = {  # the default on the OpenAI routes; /generate/ only when given
            "request_timeout": DEFAULT_REQUEST_TIMEOUT_S if args.request_timeout is None else args.request_timeout,
            "rollout_timeout": args.request_timeout,
        }
        logs = {"log_requests": not args.disable_log_requests}
        logs["log_stats_interval"] = None if args.disable_log_stats else args.log_stats_interval
        app = create_app(
            gen,
            name,
            **pick(args, *limits, *exposure, *online),
            **timeouts,
            **logs,
            allowed_hosts=hosts,
            chat_template=template,
        )
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    print(f"serving {name!r} on http://{args.host}:{args.port}/v1 (spec {config})", file=sys.stderr, flush=True)
    serve(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        shutdown_timeout=args.shutdown_timeout,
        max_connections=args.max_connections,
    )
    # (serve reads the read timeout from the app: create_app installed it)
    return 0
