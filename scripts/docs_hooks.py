"""mkdocs hooks for the docs site (`hooks:` in mkdocs.yml): the reference pages generated from the code at each build.

* `reference/cli.md`: the marker `<!-- cli-reference -->` becomes the `--help` of `verispec` and of every
  subcommand, walked from the live argparse parser (`verispec.cli.build_parser`) at a fixed width, so the page
  cannot drift from the CLI.
* any page: a marker `<!-- run: verispec ARGS -->` becomes that command's output, run in-process at the same
  fixed width (for quick, model-free commands such as `verispec explain`), so a worked example cannot drift.
* any page: a marker `<!-- run-process: verispec ARGS -->` runs the command in a subprocess (`python -m
  verispec.cli`) and shows what a terminal shows, standard output and standard error in the order written (for
  commands that load the default model, such as `verispec generate`: its summary line). It needs the default model,
  which CI's first command (the README's `verispec generate`) has fetched before the docs build.
* any page: `<!--v:SOURCE-->TEXT<!--/v-->` becomes the value SOURCE names, read from the code at build time (TEXT is
  the last value written, for readers of the raw file; tests/test_docs_values.py keeps it current). SOURCE is a
  dotted name (`verispec.engine.adaptive.MAX_GAMMA`, a class attribute such as a dataclass default, or a call with
  no arguments ending in `()`), `len:` and a dotted name (its length), or `default:COMMAND:--flag` (a CLI option's
  default, e.g. `default:serve:--max-batch`, `default:certify generate:--samples`); `|SPEC` after it formats the
  value (`|,` thousands separators, `|g` 30.0 as 30). TEXT in backticks puts the value in backticks.
* `reference/http.md`: the marker `<!-- http-reference -->` becomes the server's routes and request / response
  schemas, read from the OpenAPI schema of an app built by `verispec.serve.create_app` over a tiny random model
  (no download, no weights read: the schema does not depend on the model). The schema itself is written into the
  site as `openapi.json`.

A page without its marker is an error, so a marker lost in an edit fails the build instead of emptying the page.
"""

from __future__ import annotations

import argparse
import importlib
import io
import json
import os
import re
import shlex
import subprocess
import sys
from contextlib import contextmanager, redirect_stdout
from pathlib import Path

try:
    from mkdocs.exceptions import PluginError
except ImportError:  # the tests read the value markers with this module, without the docs extra installed

    class PluginError(Exception):
        """mkdocs' PluginError, where mkdocs is not installed."""


ROOT = Path(__file__).resolve().parent.parent

CLI_PAGE, CLI_MARKER = "reference/cli.md", "<!-- cli-reference -->"
HTTP_PAGE, HTTP_MARKER = "reference/http.md", "<!-- http-reference -->"
OPENAPI_FILE = "openapi.json"
RUN_MARKER = re.compile(r"<!-- run: (verispec [^\n]*?) -->")
PROCESS_MARKER = re.compile(r"<!-- run-process: (verispec [^\n]*?) -->")
VALUE_MARKER = re.compile(r"<!--v:([^>|]+?)(?:\|([^>]*))?-->(.*?)<!--/v-->", re.S)
PROCESS_TIMEOUT_S = 900  # a hang guard for run-process commands (the default model on a loaded 2-core machine)
COLUMNS = 100  # argparse's help width: fixed, so the page does not depend on the terminal that builds it

_schema: dict | None = None  # the OpenAPI schema, built once per build (on_files) and read by on_page_markdown


def _import_paths() -> None:
    """This checkout's package (also when it is not installed) and tests.helpers (the tiny model) importable. At
    call time: mkdocs restores sys.path after it imports a hook module."""
    for path in (str(ROOT), str(ROOT / "src")):
        if path not in sys.path:
            sys.path.insert(0, path)


# --- the CLI ---------------------------------------------------------------------------------------------------------


@contextmanager
def _columns(width: int):
    """argparse reads the help width from $COLUMNS (shutil.get_terminal_size): set it while the help is formatted."""
    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(width)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = old


def _subcommands(parser: argparse.ArgumentParser) -> list[tuple[str, str, argparse.ArgumentParser]]:
    """(name, one-line help, parser) of each subcommand of `parser`, in the order `--help` lists them."""
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            out += [(name, helps.get(name, ""), sub) for name, sub in action.choices.items()]
    return out


def _fence(text: str) -> str:
    return "```text\n" + text.rstrip() + "\n```\n"


def cli_reference() -> str:
    """Markdown: `verispec --help`, then a section per command (nested for `bench` and `certify`) with its help."""
    _import_paths()
    from verispec.cli import build_parser

    with _columns(COLUMNS):
        parser = build_parser()
        parts = [_fence(parser.format_help())]

        def walk(p: argparse.ArgumentParser, level: int) -> None:
            for _name, summary, sub in _subcommands(p):
                parts.append(f"{'#' * level} `{sub.prog}`\n")
                if summary:
                    parts.append(summary[0].upper() + summary[1:] + ".\n")
                parts.append(_fence(sub.format_help()))
                walk(sub, level + 1)

        walk(parser, 2)
    return "\n".join(parts)


def command_output(command: str) -> str:
    """Markdown: `$ command` and its standard output, run in-process by `verispec.cli.main` (a non-zero exit
    status fails the build)."""
    _import_paths()
    from verispec.cli import main

    out = io.StringIO()
    with _columns(COLUMNS), redirect_stdout(out):
        status = main(shlex.split(command)[1:])
    if status != 0:
        raise PluginError(f"`{command}` exited with status {status}")
    text = re.sub(r"\x1b\[[0-9;]*m", "", out.getvalue())  # no colours, should a terminal setting force them
    lines = [line.rstrip() for line in text.splitlines()]
    return _fence("\n".join([f"$ {command}", *lines]))


def process_output(command: str) -> str:
    """Markdown: `$ command` and what it prints to a terminal (standard output and error interleaved as written),
    run as `python -m verispec.cli ARGS` in a subprocess (a non-zero exit status fails the build)."""
    _import_paths()
    env = os.environ | {"COLUMNS": str(COLUMNS), "NO_COLOR": "1", "TERM": "dumb"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    argv = [sys.executable, "-m", "verispec.cli", *shlex.split(command)[1:]]
    done = subprocess.run(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, timeout=PROCESS_TIMEOUT_S
    )
    if done.returncode != 0:
        raise PluginError(f"`{command}` exited with status {done.returncode}:\n{done.stdout[-2000:]}")
    lines = [line.rstrip() for line in re.sub(r"\x1b\[[0-9;]*m", "", done.stdout).splitlines()]
    return _fence("\n".join([f"$ {command}", *lines]))


# --- numbers the pages quote -----------------------------------------------------------------------------------------


def _dotted(name: str):
    """The object a dotted name gives: the longest importable module prefix, then attributes; `()` calls it."""
    call = name.endswith("()")
    parts = name.removesuffix("()").split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj() if call else obj
    raise PluginError(f"no module in {name!r}")


def _option_default(command: str, option: str):
    """The default of `option` in the `verispec COMMAND` parser (COMMAND: `serve`, `certify generate`, ...)."""
    from verispec.cli import build_parser

    parser = build_parser()
    for word in command.split():
        parser = dict((name, sub) for name, _, sub in _subcommands(parser))[word]
    parser.format_help()  # a command's options are added on first use (verispec.cli builds its parsers lazily)
    for action in parser._actions:
        if option in action.option_strings:
            return action.default
    raise PluginError(f"`verispec {command}` has no option {option}")


def value(source: str, spec: str = ""):
    """The text of a value marker's SOURCE (see the module docstring), formatted by `spec`."""
    _import_paths()
    try:
        if source.startswith("default:"):
            command, option = source.removeprefix("default:").rsplit(":", 1)
            found = _option_default(command, option)
        elif source.startswith("len:"):
            found = len(_dotted(source.removeprefix("len:")))
        else:
            found = _dotted(source)
    except (AttributeError, KeyError, TypeError) as e:
        raise PluginError(f"value marker {source!r}: {type(e).__name__}: {e}") from None
    return format(found, spec) if spec else str(found)


def fill_values(markdown: str) -> str:
    """Every `<!--v:SOURCE|SPEC-->TEXT<!--/v-->` of a page replaced by the value it names (in backticks where TEXT
    is in backticks: a value in a code span)."""

    def fill(m: re.Match) -> str:
        text = value(m.group(1).strip(), m.group(2) or "")
        return f"`{text}`" if len(m.group(3)) > 1 and m.group(3)[0] == m.group(3)[-1] == "`" else text

    return VALUE_MARKER.sub(fill, markdown)


# --- the HTTP API ----------------------------------------------------------------------------------------------------


def openapi_schema() -> dict:
    """The OpenAPI schema of `verispec serve`'s app, built over the tests' tiny random model (2 layers, 32 tokens)."""
    _import_paths()
    from tests.helpers.tiny import loaded

    from verispec.engine.generator import SpeculativeGenerator
    from verispec.serve import create_app

    app = create_app(SpeculativeGenerator(loaded(0), None), "model")
    return app.openapi()


def _ref_name(ref: str) -> str:
    return ref.rsplit("/", 1)[-1]


def _schema_link(name: str) -> str:
    return f"[`{name}`](#{name.lower()})"


def _type(s: dict) -> str:
    """A JSON schema as a short type: `integer`, `array of string`, `CompletionRequest`, `string | null`."""
    if "$ref" in s:
        return _schema_link(_ref_name(s["$ref"]))
    for key in ("anyOf", "oneOf"):
        if key in s:
            return " \\| ".join(dict.fromkeys(_type(x) for x in s[key]))
    if "allOf" in s and len(s["allOf"]) == 1:
        return _type(s["allOf"][0])
    if "const" in s:
        return f"`{json.dumps(s['const'])}`"
    if "enum" in s:
        return " \\| ".join(f"`{json.dumps(v)}`" for v in s["enum"])
    t = s.get("type")
    if t == "array":
        items = s.get("items")
        return "array of " + (_type(items) if items else "any")
    if t == "object" and isinstance(s.get("additionalProperties"), dict):
        return f"object of {_type(s['additionalProperties'])}"
    if isinstance(t, list):
        return " \\| ".join(t)
    return t or "any"


def _limits(s: dict) -> str:
    """The bounds of a field (and of its anyOf branches), e.g. `0 ≤ x ≤ 64`, `≤ 1024 items`."""
    found = []
    for b in [s, *s.get("anyOf", [])]:
        lo, hi = b.get("minimum", b.get("exclusiveMinimum")), b.get("maximum", b.get("exclusiveMaximum"))
        if lo is not None or hi is not None:
            found.append(f"{_num(lo) + ' ≤ ' if lo is not None else ''}x{' ≤ ' + _num(hi) if hi is not None else ''}")
        if "maxItems" in b:
            found.append(f"≤ {b['maxItems']:,} items")
        if "maxLength" in b:
            found.append(f"≤ {b['maxLength']:,} characters")
        if "maxProperties" in b:
            found.append(f"≤ {b['maxProperties']:,} keys")
    return "; ".join(dict.fromkeys(found))


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _content_schemas(content: dict) -> str:
    """The schema names of a request body's or a response's media types (`—` for none or an untyped body)."""
    names = []
    for media, body in content.items():
        s = body.get("schema") or {}
        if s:
            names.append(_type(s))
        elif media != "application/json":
            names.append(f"`{media}`")
    return ", ".join(names) or "—"


def _fields_table(schema: dict) -> str:
    props = schema.get("properties", {})
    if not props:
        return "No fields.\n"
    required = set(schema.get("required", []))
    rows = ["| field | type | required | default | limits | description |", "|---|---|---|---|---|---|"]
    for name, s in props.items():
        default = f"`{json.dumps(s['default'])}`" if "default" in s else ""
        rows.append(
            f"| `{name}` | {_type(s)} | {'yes' if name in required else ''} | {_cell(default)} | {_limits(s)} "
            f"| {_cell(s.get('description', ''))} |"
        )
    return "\n".join(rows) + "\n"


def _refs(node, found: set[str]) -> set[str]:
    """The component schema names a JSON value refers to ($ref), at any depth."""
    if isinstance(node, dict):
        if isinstance(node.get("$ref"), str):
            found.add(_ref_name(node["$ref"]))
        for v in node.values():
            _refs(v, found)
    elif isinstance(node, list):
        for v in node:
            _refs(v, found)
    return found


def _reachable(schema: dict, roots: set[str]) -> list[str]:
    """The component schemas `roots` name and every schema they refer to, sorted."""
    components = schema.get("components", {}).get("schemas", {})
    seen, todo = set(), list(roots)
    while todo:
        name = todo.pop()
        if name in seen or name not in components:
            continue
        seen.add(name)
        todo += sorted(_refs(components[name], set()) - seen)
    return sorted(seen)


def http_reference(schema: dict) -> str:
    """Markdown: a table of the routes, then each schema a request body or a 200 reply names, with its fields
    (FastAPI's 422 schemas are left out: the server answers invalid requests with a 400 of its own)."""
    routes: dict[tuple, list[str]] = {}  # one row per route; a path with and without its trailing slash: one row
    roots: set[str] = set()
    for path, ops in schema["paths"].items():
        for method, op in ops.items():
            body = op.get("requestBody", {}).get("content", {})
            ok = op.get("responses", {}).get("200", {}).get("content", {})
            roots |= _refs(body, set()) | _refs(ok, set())
            what = (op.get("description") or "").strip().split("\n\n")[0] or op.get("summary", "")
            row = (method.upper(), path.rstrip("/") or "/", _cell(what), _content_schemas(body), _content_schemas(ok))
            routes.setdefault(row, []).append(path)
    rows = ["| method | path | what it does | request body | response (200) |", "|---|---|---|---|---|"]
    for (method, _, what, body, ok), paths in routes.items():
        rows.append(f"| `{method}` | {', '.join(f'`{p}`' for p in paths)} | {what} | {body} | {ok} |")
    parts = ["\n".join(rows) + "\n", "## Schemas\n"]
    components = schema.get("components", {}).get("schemas", {})
    for name in _reachable(schema, roots):
        s = components[name]
        parts.append(f"### {name}\n")
        if s.get("description"):
            parts.append(_cell(s["description"]) + "\n")
        parts.append(_fields_table(s))
    return "\n".join(parts)


# --- the hooks -------------------------------------------------------------------------------------------------------


def on_files(files, config):
    """Build the OpenAPI schema once and add it to the site as `openapi.json` (so links to it are checked)."""
    from mkdocs.structure.files import File

    global _schema
    _schema = openapi_schema()
    text = json.dumps(_schema, indent=2, sort_keys=False) + "\n"
    files.append(File.generated(config, OPENAPI_FILE, content=text))
    return files


def on_page_markdown(markdown, page, config, files):
    """Fill the reference pages' markers (and any page's `run:` markers) with what the code says now."""
    uri = page.file.src_uri
    markdown = RUN_MARKER.sub(lambda m: command_output(m.group(1)), markdown)
    markdown = PROCESS_MARKER.sub(lambda m: process_output(m.group(1)), markdown)
    markdown = fill_values(markdown)
    if uri == CLI_PAGE:
        return _fill(markdown, CLI_MARKER, cli_reference(), uri)
    if uri == HTTP_PAGE:
        if _schema is None:
            raise PluginError("the OpenAPI schema was not built (on_files did not run)")
        return _fill(markdown, HTTP_MARKER, http_reference(_schema), uri)
    return markdown


def _fill(markdown: str, marker: str, text: str, uri: str) -> str:
    if marker not in markdown:
        raise PluginError(f"{uri} must contain the marker {marker} (where the generated reference goes)")
    return markdown.replace(marker, text)
