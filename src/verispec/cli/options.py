"""Option groups shared by the subcommands, and the checks that run before any model loads.

Each group is added by one function, so a subcommand's parser reads as the list of groups it takes. A value a flag
can check alone is checked by the flag's `type` (argparse reports it and exits with status 2); checks across flags
run in `spec_config` (--spec and its shorthands --draft, --gamma, --tree, --max-gamma and --stop-below, into one `SpecConfig`) and
`sampling_params`, which every handler calls before it loads a model.

The library's imports stay inside the functions: `import verispec.cli` itself loads no torch.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from contextlib import contextmanager
from pathlib import Path

from ..data import PROMPT_SETS, prompt_file
from . import constants

__all__ = [
    "UsageError",
    "add_counts",
    "add_device_args",
    "add_prompt_args",
    "add_sampling_args",
    "add_seed_arg",
    "add_spec_args",
    "add_speculation_args",
    "dtype_name",
    "flag",
    "gamma_type",
    "int_range",
    "level_type",
    "load",
    "model_errors",
    "pick",
    "read_prompts",
    "sampling_params",
    "spec_config",
    "user_errors",
]


BUILTIN = f"or a built-in set: {', '.join(PROMPT_SETS)}; repeatable"  # the --prompts names (verispec.data)


class UsageError(Exception):
    """A user mistake: reported as one line (`verispec: error: ...`), exit status 2."""


def flag(field: str) -> str:
    """The command-line flag of a parameter: top_p -> --top-p."""
    return "--" + field.replace("_", "-")


@contextmanager
def user_errors(*also: type[BaseException]):
    """Report the library's ValueError (and the `also` kinds) raised inside the block as a usage error."""
    try:
        yield
    except (ValueError, *also) as e:
        raise UsageError(str(e)) from None


def model_errors():
    """`user_errors` that also reports a model that cannot be loaded."""
    from ..model.loading import ModelLoadError

    return user_errors(ModelLoadError)


# --- types: one flag's value, checked alone -----------------------------------------------------------------


def int_range(low: int, high: int | None = None):
    """An argparse type: an integer in [low, high] (no upper bound when high is None)."""
    bounds = f">= {low}" if high is None else f"from {low} to {high}"

    def integer(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be an integer {bounds}, got {text!r}")
        return value

    return integer


def gamma_type(auto: bool = True):
    """An argparse type for a draft length. auto: the spec key gamma's values, 'auto' or 0..MAX_GAMMA (0: no drafts,
    the target decodes plainly with the drafter loaded); else a fixed chain length, 1..MAX_GAMMA."""
    low = 0 if auto else 1

    def gamma(text: str) -> int | str:
        if auto and text == "auto":
            return "auto"
        try:
            value = int(text)
        except ValueError:
            value = -1
        if not low <= value <= constants.MAX_GAMMA:
            expected = f"an integer from {low} to {constants.MAX_GAMMA}"
            hint = " (drafts per step; 0: none, plain decoding)" if auto else ""
            raise argparse.ArgumentTypeError(f"must be {'auto or ' if auto else ''}{expected}{hint}, got {text!r}")
        return value

    return gamma


def fraction_or_none(text: str) -> float | str:
    """An argparse type: a number in [0, 1], or 'none' (kept as the string: None means the flag was not given)."""
    try:
        value = math.nan if text == "none" else float(text)
    except ValueError:
        value = math.nan
    if text != "none" and not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1] or none, got {text!r}")
    return text if text == "none" else value


def level_type(text: str) -> float:
    """An argparse type for a significance level, in (0, 1)."""
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"must be a number in (0, 1), e.g. 0.01, got {text!r}")
    return value


def dtype_name(text: str) -> str:
    """An argparse type for a precision: float32, bfloat16 or float16 (as load_model reads them)."""
    if text not in constants.DTYPES:
        raise argparse.ArgumentTypeError(f"unknown dtype {text!r}; choose one of float32, bfloat16, float16")
    return text


# --- option groups --------------------------------------------------------------------------------------------

_HELP = {
    "target": "target model: hub id, local directory or .gguf file (default: SmolLM2-135M-Instruct, fetched once "
    "into ~/.cache/verispec)",
    "spec": "the speculation configuration in one string, comma-separated key=value items, e.g. "
    "draft=model,model=PATH,gamma=4,verify=block (keys: draft, model, quant, ngram, stop_below, min_share, "
    "choose_depth, gamma, max_gamma, tree, jump, verify, random, runner, cross_vocab; see docs/guides/generating.md). "
    "--draft, --gamma, --tree, --max-gamma and --stop-below are shorthands for its keys; a shorthand that disagrees "
    "with --spec is an error",
    "draft": "the drafter: a draft model (hub id, directory, .gguf; or an EAGLE-3 / EAGLE / Medusa head's directory), "
    "'self' (the target's weights quantized: with --spec quant=int4 or int8), 'mtp' (the multi-token-prediction "
    "layer in the target's own checkpoint), 'ngram' (prompt lookup, default) or 'none' (the spec keys draft and model)",
    "gamma": "drafts per step (0: none, plain decoding steps), or 'auto' (default auto; the spec key gamma)",
    "max_gamma": "the most drafts per step --gamma auto picks (default 8; the spec key max_gamma; llama.cpp's "
    "--draft-max)",
    "stop_below": "a draft model stops a chain once its own probability of a drafted token falls below P, or 'none' "
    "(always gamma drafts) (default 0.3; the spec key stop_below; llama.cpp's --draft-p-min)",
    "tree": "tree speculation: children per node at each depth (e.g. 4-2-2-1) or dynamic-D-K-M (EAGLE-2: depth D, "
    "top-K expansion, budget of M nodes) (the spec key tree; --spec verify=iid|without_replacement picks the rule)",
}


def add_device_args(
    p: argparse.ArgumentParser, *, device: bool = True, dtype_help: str = "float32 (default), bfloat16 or float16"
) -> None:
    p.add_argument("--dtype", type=dtype_name, default="float32", help=dtype_help)
    if device:
        p.add_argument("--device", default="cpu", help="cpu (default), cuda or cuda:N")
    p.add_argument(
        "--threads",
        type=int_range(1),
        help="CPU threads of every model in the process: torch's intra-op threads and llama.cpp's n_threads / "
        "n_threads_batch (default: OMP_NUM_THREADS if set, else one per CPU that other processes leave idle, "
        "at most one per core)",
    )


def add_counts(p: argparse.ArgumentParser, *counts: tuple[str, int, int | None, str], metavar: str | None = None):
    """Integer options, each given as (flag, lowest value, default, help); help may say %(default)s."""
    for name, low, default, text in counts:
        p.add_argument(name, type=int_range(low), default=default, metavar=metavar, help=text)


def add_level_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--level", type=level_type, default=0.01, help="family-wise significance level (default 0.01)")


def add_seed_arg(p: argparse.ArgumentParser, default: int | None = 0, help: str = "random seed (default 0)") -> None:
    p.add_argument("--seed", type=int_range(0, 2**63 - 1), default=default, help=help)


class _Once(argparse.Action):
    """An option that may be given once: a second one is an error (not silently the last)."""

    def __call__(self, parser, namespace, values, option_string=None):
        if getattr(namespace, self.dest, None) is not None:
            parser.error(f"{option_string} given twice: put every key in one {option_string} (comma-separated)")
        setattr(namespace, self.dest, values)


def add_spec_args(p: argparse.ArgumentParser, draft_help: str = _HELP["draft"], gamma_help: str = _HELP["gamma"]):
    """--spec, the whole speculation configuration in one string (`SpecConfig.parse`), and its shorthands --draft,
    --gamma, --tree, --max-gamma and --stop-below (default None: `spec_config` fills what none of them sets from the
    defaults)."""
    p.add_argument("--spec", metavar="SPEC", action=_Once, help=_HELP["spec"])
    p.add_argument("--draft", help=draft_help)
    p.add_argument("--gamma", type=gamma_type(), help=gamma_help)
    p.add_argument("--tree", help=_HELP["tree"])
    p.add_argument("--max-gamma", type=int_range(1, constants.MAX_GAMMA), metavar="N", help=_HELP["max_gamma"])
    p.add_argument("--stop-below", type=fraction_or_none, metavar="P", help=_HELP["stop_below"])


def add_speculation_args(p: argparse.ArgumentParser) -> None:
    """Target, speculation and device: the options of `generate` and `serve`."""
    p.add_argument("--target", help=_HELP["target"])
    add_spec_args(p)
    add_device_args(p)


_SAMPLING_HELP = {  # SamplingParams field -> (type, help); defaults come from SamplingParams itself
    "temperature": (float, "0 = greedy"),
    "top_k": (int, "keep the K most probable tokens (0 = off)"),
    "top_p": (float, "keep the most probable tokens up to this probability mass (1 = off)"),
    "min_p": (float, "drop tokens less probable than this fraction of the most probable one (0 = off)"),
    "repetition_penalty": (float, "penalise tokens already in the prompt or the output (1 = off)"),
    "presence_penalty": (float, "subtracted from the logit of every token already in the output (0 = off)"),
    "frequency_penalty": (float, "subtracted from a token's logit once per time it is in the output (0 = off)"),
}


def add_sampling_args(p: argparse.ArgumentParser, names=tuple(_SAMPLING_HELP), **defaults) -> None:
    """The sampling options `names` (SamplingParams fields), with SamplingParams' defaults unless overridden."""
    base = constants.SAMPLING_DEFAULTS | defaults
    for name in names:
        kind, text = _SAMPLING_HELP[name]
        p.add_argument(flag(name), type=kind, default=base[name], help=f"{text}; default %(default)s")
    p.set_defaults(sampling_fields=tuple(names))


def add_constraint_args(p: argparse.ArgumentParser) -> None:
    """Structured-output flags (at most one): the output must match a JSON schema, any JSON object, a regex, one
    of several strings or an EBNF grammar (`verispec.sampling.Constraint`); `sampling_params` reads them."""
    g = p.add_argument_group("structured output (at most one)").add_mutually_exclusive_group()
    g.add_argument("--json-schema", metavar="FILE", help="the output is JSON valid under the JSON schema in FILE")
    g.add_argument("--json-object", action="store_true", help="the output is a JSON object")
    g.add_argument("--regex", metavar="PATTERN", help="the whole output matches this regular expression")
    g.add_argument("--choice", metavar="TEXT", action="append", help="the output is one of these strings (repeatable)")
    g.add_argument("--grammar", metavar="FILE", help="the output is a sentence of the EBNF / GBNF grammar in FILE")
    p.set_defaults(constraint_flags=True)


def constraint(args: argparse.Namespace):
    """The Constraint of the structured-output flags (None: none given), its regex, grammar or schema parsed (no
    tokenizer needed: before any model loads); a bad file, schema, regex or grammar names its flag."""
    from ..sampling import Constraint, ConstraintError
    from ..structured import check_syntax

    if not getattr(args, "constraint_flags", False):
        return None

    def read(path: str, name: str) -> str:
        try:
            with open(path, encoding="utf-8") as f:
                return f.read()
        except OSError as e:
            raise UsageError(f"{name}: cannot read {path}: {e.strerror or e}") from None

    try:
        if args.json_schema is not None:
            c = Constraint.json_schema(read(args.json_schema, "--json-schema"))
        elif args.json_object:
            c = Constraint.json_object()
        elif args.regex is not None:
            c = Constraint.regex(args.regex)
        elif args.choice:
            c = Constraint.choice(args.choice)
        elif args.grammar is not None:
            c = Constraint.grammar(read(args.grammar, "--grammar"))
        else:
            return None
        check_syntax(c)
    except ConstraintError as e:
        raise UsageError(f"{_constraint_flag(args)}: {e}") from None
    return c


def _constraint_flag(args: argparse.Namespace) -> str:
    """The structured-output flag given (`--json-schema`, ...)."""
    return flag(next(f for f in ("json_schema", "json_object", "regex", "choice", "grammar") if getattr(args, f, None)))


def compile_constraint(core, params, args: argparse.Namespace) -> None:
    """Compile the request's constraint for the loaded model's tokenizer now (cached for the run), so that a schema,
    regex or grammar the engine refuses is a usage error naming its flag, not an error mid-run."""
    from ..sampling import ConstraintError

    if params.constraint is None:
        return
    try:
        core.grammars.compile(params.constraint)
    except ConstraintError as e:
        raise UsageError(f"{_constraint_flag(args)}: {e}") from None


def add_prompt_args(p: argparse.ArgumentParser, chat_help: str = "wrap prompts in the tokenizer's chat template"):
    p.add_argument("--prompt", action="append", help="prompt text (repeatable)")
    p.add_argument("--prompts", nargs="+", action="extend", help=f"JSONL prompt files ({{'prompt': ...}}; {BUILTIN})")
    p.add_argument("--num-prompts", type=int_range(1), default=1, help="prompts taken from each file (default 1)")
    p.add_argument("--chat", action="store_true", help=chat_help)


# --- checks across flags, before a model loads ----------------------------------------------------------------


def sampling_params(args: argparse.Namespace, **extra):
    """The SamplingParams of the sampling options (see add_sampling_args); an invalid value names its flag."""
    from ..sampling import ParamError, SamplingParams

    if "constraint" not in extra and getattr(args, "constraint_flags", False):
        extra["constraint"] = constraint(args)
    flags_constraint = getattr(args, "constraint_flags", False) and extra.get("constraint") is not None
    if flags_constraint and getattr(args, "stop", None):  # (engine.request.Request's rule, before any model loads)
        raise UsageError(
            f"--stop cannot be combined with {_constraint_flag(args)}: a structured-output constraint ends the output "
            "where its grammar does (stop strings could cut the structure short)"
        )
    try:
        return SamplingParams(**{name: getattr(args, name) for name in args.sampling_fields}, **extra)
    except ParamError as e:
        raise UsageError(f"{flag(e.field)} {e.message}") from None


def spec_config(args: argparse.Namespace, defaults: dict | None = None):
    """The one SpecConfig of --spec and its shorthands (--draft, --gamma, --tree), checked before any model loads:
    a shorthand and --spec that set one key differently is an error; keys neither sets take the command's own
    `defaults` (keys), then SpecConfig's. Errors name what the user typed. The config is also kept as `args.config`
    (where `load` reads the runner and the drafter)."""
    from ..engine.config import SpecConfig, SpecError, canonical, format_value, parse_items

    text = getattr(args, "spec", None)
    try:
        given = parse_items(text) if text is not None else {}
    except SpecError as e:
        raise UsageError(f"--spec {text}: {e}") from None
    flags = _flag_items(args)
    for key, (typed, value) in flags.items():
        if key in given and canonical(key, given[key]) != canonical(key, value):
            raise UsageError(f"{typed} disagrees with --spec {key}={format_value(given[key])}: give it once")
    try:
        cfg = SpecConfig(**(dict(defaults or {}) | given | {key: value for key, (_, value) in flags.items()}))
        _check_runner(cfg, getattr(args, "device", "cpu"))
    except SpecError as e:
        in_spec = e.key in given  # the message then follows --spec's text, naming the keys it has not as --spec ...
        message = e.render(lambda key, value: _named(key, value, given, flags, in_spec))
        raise UsageError(f"--spec {text}: {message}" if in_spec else message) from None
    typed = "draft" in given or "draft" in flags  # else the default drafter, which the user did not name
    _check_shorthands(cfg, flags, lambda key, value: _named(key, value, given, flags, False) if typed else None)
    if not cfg.drafter.built_by_generator:
        raise UsageError(
            f"--spec {text}: draft={cfg.draft} is drafted by objects the command line cannot give (a RolloutEngine's "
            "history, a Proposer); use draft=ngram, none, model, self or mtp"
        )
    if cfg.drafter.model and cfg.model is None:
        raise UsageError("draft=model needs the draft model: --draft PATH, or model=PATH in --spec")
    check_model_path(flags["model"][0] if "model" in flags else f"--spec model={cfg.model}", cfg.model)
    check_model_path(f"--target {getattr(args, 'target', None)}", getattr(args, "target", None))
    args.config = cfg
    return cfg


def _check_runner(cfg, device: str | None) -> None:
    """What the llama.cpp runner refuses (docs/guides/llamacpp.md, "What it refuses"), before any model loads: a
    SpecError naming the keys, as `spec_config` renders them."""
    from ..engine.config import SpecError

    if cfg.runner != "llamacpp":
        return
    if device not in (None, "cpu"):
        raise SpecError(
            "runner", f"[runner=llamacpp] runs on the CPU here, not on --device {device} (a torch runner runs there)"
        )
    if cfg.quant is not None:
        self_draft = cfg.drafter.target_weights
        what = "[draft=self] quantizes the target's torch weights" if self_draft else "[quant] quantizes"
        raise SpecError(
            "runner",
            f"{what} ([quant={cfg.quant}]), but [runner=llamacpp] runs a GGUF file in its own quantization "
            "([runner=auto] loads the target with torch for it)",
        )
    if cfg.drafter.target_head:
        raise SpecError(
            "runner",
            "[draft=mtp] reads the target's hidden states, which [runner=llamacpp] does not expose ([runner=auto] "
            "loads the target with torch for it)",
        )


def _check_shorthands(cfg, flags: dict, named) -> None:
    """--stop-below and --max-gamma apply to what they concern only (their spec keys are kept silently)."""
    if "stop_below" in flags and (not (cfg.drafter.uses_model or cfg.drafter.target_head) or cfg.tree is not None):
        raise UsageError(
            f"{flags['stop_below'][0]}: a draft model's chains stop below this probability of their own; it does not "
            f"apply to {named('draft', cfg.draft) or f'the default drafter (draft={cfg.draft})'}"
            + (" with a tree" if cfg.tree is not None else "")
        )
    if "max_gamma" in flags and cfg.gamma != "auto":
        raise UsageError(f"{flags['max_gamma'][0]} caps what --gamma auto picks; it does not apply to a fixed gamma")


def check_gguf(typed: str, spec: str | None, runner: str) -> None:
    """Before anything loads: what the llama.cpp runner runs is a GGUF file (a .gguf path, or a directory holding
    one; None, the built-in default model, is one)."""
    if spec is None or spec.endswith(".gguf") or (Path(spec).expanduser().is_dir() and any(Path(spec).glob("*.gguf"))):
        return
    raise UsageError(f"{typed}: {runner} runs GGUF files (a .gguf file, or a directory holding one)")


def check_model_path(typed: str, spec: str | None) -> None:
    """Before anything loads: a model named by a local path must be one (`model.loading.check_source`: it exists, and
    a directory holds a model); a hub id is left to the loader. typed: how the user named it (the flag)."""
    from ..model.loading import ModelLoadError, check_source

    try:
        check_source(spec)
    except ModelLoadError as e:
        message = str(e).removesuffix(f": {spec}")  # (the flag as typed names the path already)
        raise UsageError(f"{typed}: {message}") from None


def _flag_items(args: argparse.Namespace) -> dict:
    """The spec keys the shorthands given set: key -> (the flag as typed, value)."""
    out = {}
    draft = getattr(args, "draft", None)
    if draft in ("ngram", "none", "self", "mtp", "ngram+self"):
        out["draft"] = (f"--draft {draft}", draft)
    elif draft is not None:  # a path: a draft model (or a head's directory)
        out["draft"], out["model"] = (f"--draft {draft}", "model"), (f"--draft {draft}", draft)
    for key in ("gamma", "tree", "max_gamma", "stop_below"):
        if getattr(args, key, None) is not None:
            value = getattr(args, key)
            out[key] = (f"{flag(key)} {value}", None if value == "none" else value)
    return out


def _named(key: str, value: str | None, given: dict, flags: dict, in_spec: bool) -> str:
    """How an error names a spec key: as --spec does where --spec set it, else as its shorthand where it has one,
    else as a key of --spec (`--spec quant`; plainly after --spec's own text)."""
    from ..engine.config import spec_name

    if key in given:
        return spec_name(key, value)
    if key == "model" or (key == "draft" and value == "model"):
        return flags["model"][0] if "model" in flags else "--draft PATH"
    if key in ("draft", "gamma", "tree") or key in flags:
        return flag(key) if value is None else f"{flag(key)} {value}"
    return spec_name(key, value) if in_spec else f"--spec {spec_name(key, value)}"


def pick(args: argparse.Namespace, *names: str) -> dict:
    """The options `names` as keyword arguments."""
    return {name: getattr(args, name) for name in names}


# --- running ---------------------------------------------------------------------------------------------------


def load(spec: str | None, args: argparse.Namespace, *, threads: bool = True, draft: bool = False):
    """Load one model with the device options, saying so on stderr (draft: a draft model or a hidden-state head's
    directory, `engine.drafters.load_draft`). Runner llamacpp (or auto, for a GGUF file on the CPU when
    llama-cpp-python is installed) loads it into llama.cpp instead of torch."""
    from ..engine.drafters import load_draft
    from ..model.loading import DEFAULT_MODEL_NAME, load_model

    backend = backend_for(spec, args)
    print(f"loading {spec or DEFAULT_MODEL_NAME} ({backend}) ...", file=sys.stderr, flush=True)
    options = dict(dtype=args.dtype, device=args.device, threads=args.threads if threads else None, backend=backend)
    return load_draft(spec, **options) if draft else load_model(spec, **options)


def backend_for(spec: str | None, args: argparse.Namespace) -> str:
    """torch or llamacpp, for a model spec under the runner (the SpecConfig's, else --runner; see `load`)."""
    from ..model.llamacpp import INSTALL_HINT, llamacpp_available

    config = getattr(args, "config", None)  # the SpecConfig of `spec_config`, where the command has one
    runner = config.runner if config is not None else getattr(args, "runner", None)  # none: torch models
    if runner == "llamacpp":
        if not llamacpp_available():
            raise UsageError(f"{'--spec runner=' if config is not None else '--runner '}llamacpp: {INSTALL_HINT}")
        return "llamacpp"
    if config is not None:
        self_draft = config.drafter.target_weights or config.drafter.target_head
    else:
        self_draft = getattr(args, "draft", None) in ("self", "mtp")
    quantized = getattr(args, "draft_quant", None) is not None  # (bench: the draft model's weights quantized by torch)
    torch_needed = getattr(args, "torch_only", False) or self_draft or quantized  # quantizes / reads torch weights
    gguf = spec is None or str(spec).endswith(".gguf")
    auto = runner == "auto" and gguf and not torch_needed and getattr(args, "device", "cpu") == "cpu"
    return "llamacpp" if auto and args.dtype == "float32" and llamacpp_available() else "torch"


def read_prompts(args: argparse.Namespace) -> list[str]:
    """The texts of --prompt and --prompts (the first --num-prompts of each file); a default prompt if none."""
    texts = list(args.prompt or [])
    for path in args.prompts or []:
        try:
            rows = [json.loads(line) for line in prompt_file(path).read_text().splitlines() if line.strip()]
            texts += [str(r["prompt"]) for r in rows[: args.num_prompts]]
        except (OSError, json.JSONDecodeError) as e:
            raise UsageError(f"cannot read prompts from {path}: {e}") from None
        except (KeyError, TypeError):
            raise UsageError(f"{path}: every line must be a JSON object with a 'prompt' field") from None
    if "" in texts:
        raise UsageError("a prompt is empty")
    return texts or ["def fibonacci(n):"]


def read_bench_prompts(paths: list[str]) -> dict[str, list[str]]:
    """The prompt files of a benchmark (--prompts), by category; unreadable or malformed files are usage errors."""
    from ..bench.e2e import load_prompts

    try:
        return load_prompts([prompt_file(p) for p in paths])
    except OSError as e:
        raise UsageError(f"cannot read prompts from {e.filename}: {e.strerror}") from None
    except ValueError as e:
        raise UsageError(f"--prompts: {e}") from None


def add_bench_inputs(
    p: argparse.ArgumentParser, target_help: str, draft_help: str, *counts: tuple[str, int, int | None, str]
) -> None:
    """What a model benchmark runs on: --target, --draft, the --prompts files, then its integer options (add_counts)."""
    p.add_argument("--target", help=target_help)
    p.add_argument("--draft", help=draft_help)
    p.add_argument(
        "--prompts",
        nargs="+",
        action="extend",
        required=True,
        help=f"JSONL prompt files ({{'prompt', 'category'}}; {BUILTIN})",
    )
    add_counts(p, *counts)


def add_bench_model_args(
    p: argparse.ArgumentParser, name: str, draft_quant_help: str, self_quant_help: str, torch_only: bool = False
) -> None:
    """The options a model benchmark shares: seed, chat template, runner (torch_only: no llamacpp), draft / self-draft
    quantization, device, --out."""
    from .constants import QUANT_MODES, RUNNER_KINDS

    add_seed_arg(p)
    p.add_argument("--no-chat", action="store_true", help="feed prompts raw instead of through the chat template")
    runners = tuple(k for k in RUNNER_KINDS if not (torch_only and k == "llamacpp"))
    p.add_argument("--runner", choices=runners, default="auto", help="verispec's model forward (default auto)")
    p.add_argument("--draft-quant", choices=QUANT_MODES, help=draft_quant_help)
    p.add_argument("--self-quant", choices=QUANT_MODES, default="int4", help=self_quant_help)
    add_device_args(p)
    p.add_argument("--out", default=f"bench-{name}", help=f"folder for {name}.json, {name}.md and {name}.png")
    p.set_defaults(torch_only=torch_only)


def bench_model_options(args: argparse.Namespace) -> dict:
    """The benchmark config fields that add_bench_model_args' options give (seed, chat, runner, quantizations);
    what --runner llamacpp refuses (docs/guides/llamacpp.md) is refused here, before any model loads."""
    if args.runner == "llamacpp" and args.device != "cpu":
        raise UsageError(f"--runner llamacpp runs on the CPU here, not on --device {args.device}")
    if args.runner == "llamacpp" and args.draft_quant is not None:
        raise UsageError(
            f"--draft-quant {args.draft_quant} quantizes torch weights, but --runner llamacpp runs a GGUF file in its "
            "own quantization (--runner auto loads torch models for it)"
        )
    return pick(args, "seed", "runner", "draft_quant", "self_quant") | {"chat": not args.no_chat}


def bench_config(make, args: argparse.Namespace, *names: str, **extra):
    """A benchmark's config dataclass: `make(**the options names, **extra, **bench_model_options)`, the model options
    limited to the fields `make` has; its ValueError is a usage error."""
    from dataclasses import fields

    known = {f.name for f in fields(make)}
    model = {k: v for k, v in bench_model_options(args).items() if k in known}
    with user_errors():
        return make(**pick(args, *names), **extra, **model)


def log_stderr(message: str) -> None:
    """A benchmark's progress log: one line on stderr, flushed."""
    print(message, file=sys.stderr, flush=True)
