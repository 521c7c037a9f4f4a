"""`verispec <command>`: the single command-line entry point.

One module per subcommand, each with its one-line `HELP`, its parser (`add_parser`) and its handler (`run`, whose
docstring, where it has one, is the command's description in --help); the option groups they share, and the checks
that run before any model loads, are in `options`. Errors in user input print one line (`verispec: error: ...`, or
argparse's usage line and its error, with a "did you mean" for a misspelt flag or choice) and exit with status 2;
Ctrl-C, wherever it comes (importing, loading, running), exits with status 130; never a traceback.

Start-up is lazy: building the parser imports no torch (`verispec --help` answers at once). A command's options are
added when its parser is first used (parsing, its --help), and the library loads inside its handler.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import os
import re
import sys

from .options import UsageError

__all__ = ["UsageError", "build_parser", "main"]

# the commands in the order --help lists them: a name's module (in this package), or a group of commands as
# (its help, the dest and metavar of its choice, its commands)
COMMANDS: dict[str, str | tuple] = {
    "explain": "explain",
    "generate": "generate",
    "serve": "serve",
    "train-draft": "train_draft",
    "bench": (
        "benchmarks, side by side in one run",
        "bench_command",
        "BENCH",
        {
            "kernel": "bench_kernel",
            "e2e": "bench_e2e",
            "runner": "bench_runner",
            "rollout": "bench_rollout",
            "rl": "bench_rl",
            "replicas": "bench_replicas",
            "acceptance": "bench_acceptance",
            "stops": "bench_stops",
            "structured": "bench_structured",
        },
    ),
    "certify": (
        "statistical certificate that a sampler / generator is lossless",
        "certify_command",
        "CERTIFY",
        {
            "kernel": "certify_kernel",
            "known-bugs": "certify_known_bugs",
            "generate": "certify_generate",
            "study": "certify_study",
        },
    ),
}

# flags of earlier versions and of other engines, and what verispec calls them (a "did you mean" for each)
OTHER_SPELLINGS = {
    "--draft-quant": "--spec quant=int4",
    "--verify": "--spec verify=block",
    "--tree-rule": "--spec verify=iid",
    "--seeding": "--spec random=position",
    "--coupling": "--spec random=gumbel",
    "--runner": "--spec runner=...",
    "--ngram-sizes": "--spec ngram=3-2-1",
    "--cross-vocab": "--spec cross_vocab=...",
    "--model-draft": "--draft",  # llama.cpp's -md
    "--draft-max": "--gamma N (or --max-gamma N with --gamma auto)",
    "--draft-p-min": "--stop-below",
    "--num-speculative-tokens": "--gamma",
}


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose options are added on first use (parsing, --help, usage) by `add_options(parser)`, and
    whose errors about a choice suggest the closest one."""

    def __init__(self, *args, add_options=None, **kwargs):
        super().__init__(*args, **kwargs)
        self._add_options = add_options

    def complete(self) -> None:
        """Add the options now (once)."""
        add, self._add_options = self._add_options, None
        if add is not None:
            add(self)

    def parse_known_args(self, args=None, namespace=None):
        self.complete()
        return super().parse_known_args(args, namespace)

    def format_usage(self) -> str:
        self.complete()
        return super().format_usage()

    def format_help(self) -> str:
        self.complete()
        return super().format_help()

    def error(self, message: str):
        choice = re.search(r"invalid choice: '(.*?)' \(choose from (.*)\)$", message)
        if choice:
            close = difflib.get_close_matches(choice[1], re.findall(r"'([^']*)'", choice[2]), n=1)
            message += f"; did you mean {close[0]!r}?" if close else ""
        super().error(message)


class _Slot:
    """What a command's `add_parser(sub)` is given when its parser is completed: `sub.add_parser(name, ...)` hands
    back the parser already made (under that name, with its help), its other settings (description) applied."""

    def __init__(self, parser: argparse.ArgumentParser):
        self.parser = parser

    def add_parser(self, name: str, help: str | None = None, **settings) -> argparse.ArgumentParser:
        for key, value in settings.items():
            setattr(self.parser, key, value)
        return self.parser


def _add_commands(parser: argparse.ArgumentParser, dest: str, metavar: str, commands: dict) -> None:
    sub = parser.add_subparsers(dest=dest, required=True, metavar=metavar)
    for name, entry in commands.items():
        if isinstance(entry, tuple):
            text, group_dest, group_metavar, members = entry
            _add_commands(sub.add_parser(name, help=text), group_dest, group_metavar, members)
            continue
        module = importlib.import_module(f"{__name__}.{entry}")  # (cheap: the library loads in its handler)
        sub.add_parser(name, help=module.HELP, add_options=lambda p, m=module: m.add_parser(_Slot(p)))


def build_parser() -> argparse.ArgumentParser:
    """The `verispec` parser: every command, each completed with its options when first used (no torch loaded)."""
    parser = _Parser(prog="verispec", description="Lossless speculative decoding.")
    _add_commands(parser, "command", "COMMAND", COMMANDS)
    return parser


def _chosen(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The parser of the (sub)command the arguments chose."""
    while True:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        name = getattr(args, subs[0].dest, None) if subs else None
        if name not in (subs[0].choices if subs else {}):
            return parser
        parser = subs[0].choices[name]


def _unrecognized(parser: argparse.ArgumentParser, extras: list[str]) -> str:
    """argparse's "unrecognized arguments" error, with what each misspelt flag was probably meant to be."""
    flags = [s for a in parser._actions for s in a.option_strings if s.startswith("--")]
    unknown = [e.split("=", 1)[0] for e in extras if e.startswith("--") and e.split("=", 1)[0] not in flags]
    hints = []
    for name in unknown:
        if name in OTHER_SPELLINGS and "--spec" in flags:
            hints.append(f"{name} is {OTHER_SPELLINGS[name]} here")
        elif close := difflib.get_close_matches(name, flags, n=1, cutoff=0.7):
            hints.append(f"did you mean {close[0]}?" if len(unknown) == 1 else f"{name}: did you mean {close[0]}?")
    return f"unrecognized arguments: {' '.join(extras)}" + "".join(f"; {h}" for h in hints)


def main(argv: list[str] | None = None) -> int:
    """Run `verispec` with these arguments (default: the command line's); returns the exit status."""
    try:
        parser = build_parser()
        args, extras = parser.parse_known_args(argv)
        if extras:
            chosen = _chosen(parser, args)
            chosen.error(_unrecognized(chosen, extras))  # (the command's own usage line, exit status 2)
        return args.func(args)
    except UsageError as e:
        print(f"verispec: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C, wherever it came: importing, loading a model, running
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (`verispec ... | head`): no traceback, and none at exit either
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
