"""Option groups shared by the subcommands, and the checks that run before any model loads.

Each group is added by one function and built from the library's own constants (runner kinds, quantization
modes, tree rules, sampling defaults), so a subcommand's parser reads as the list of groups it takes.
A value that a flag can check alone is checked by the flag's `type` (argparse reports it and exits with
status 2); checks across flags and the sampling parameters run in `spec_config` (the speculation options: --spec and
the flags that are its shorthands, into one `SpecConfig`) and `sampling_params`, which every handler calls before it
loads a model.

The library's imports stay inside the functions: `import verispec.cli` itself loads no torch.
"""

from __future__ import annotations

import argparse
import json
import sys
from contextlib import contextmanager
from pathlib import Path

__all__ = [
    "UsageError",
    "add_counts",
    "add_cross_vocab_arg",
    "add_device_args",
    "add_prompt_args",
    "add_quant_arg",
    "add_runner_arg",
    "add_sampling_args",
    "add_seed_arg",
    "add_spec_arg",
    "add_speculation_args",
    "add_tree_args",
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


def gamma_limit() -> int:
    """The most drafts per step the generator accepts."""
    from ..engine.adaptive import MAX_GAMMA

    return MAX_GAMMA


def gamma_type(auto: bool = True):
    """An argparse type for a draft length: 1..gamma_limit(), or 'auto' (when allowed)."""

    def gamma(text: str) -> int | str:
        if auto and text == "auto":
            return "auto"
        try:
            value = int(text)
        except ValueError:
            value = 0
        if not 1 <= value <= gamma_limit():
            expected = (
                f"auto or an integer from 1 to {gamma_limit()}" if auto else f"an integer from 1 to {gamma_limit()}"
            )
            hint = " (drafts per step; for no drafts at all use --draft none)" if auto else ""
            raise argparse.ArgumentTypeError(f"must be {expected}{hint}, got {text!r}")
        return value

    return gamma


def level_type(text: str) -> float:
    """An argparse type for a significance level, in (0, 1)."""
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"must be a number in (0, 1), e.g. 0.01, got {text!r}")
    return value


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(n) for n in text.split(","))
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"must be comma-separated integers >= 1, e.g. 3,2,1, got {text!r}")
    return values


def dtype_name(text: str) -> str:
    """An argparse type for a precision: float32, bfloat16 or float16 (as load_model reads them)."""
    from ..model.loading import ModelLoadError, parse_dtype

    try:
        parse_dtype(text)
    except ModelLoadError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


# --- option groups --------------------------------------------------------------------------------------------

_HELP = {
    "tree": "tree speculation: children per node at each depth (e.g. 4-2-2-1) or dynamic-D-K-M (EAGLE-2: depth D, "
    "top-K expansion, budget of M nodes)",
    "tree_rule": "how tree children are drawn and verified (default deterministic: the top-k of q)",
    "target": "target model: hub id, local directory or .gguf file (default: SmolLM2-135M-Instruct, fetched once "
    "into ~/.cache/verispec)",
    "draft": "draft model (hub id, directory, .gguf; or an EAGLE-3 / EAGLE / Medusa head's directory), 'self' (the "
    "target's weights quantized: with --draft-quant), 'mtp' (the multi-token-prediction layer in the target's own "
    "checkpoint), 'ngram' (prompt lookup, default) or 'none'",
    "cross_vocab": "a --draft with another tokenizer than the target's: tli (token-level intersection, the default: "
    "q moved into the target's vocabulary by byte string; any temperature, chains and trees) or slem (string-level "
    "exact match: the draft's greedy text re-tokenized by the target, verified as one-hot proposals; chains)",
    "draft_quant": "weight-only quantize the draft model's linear layers (lossless: q is what it sampled from)",
    "ngram_sizes": "prompt-lookup n-gram sizes, longest first (default 3,2,1)",
    "spec": "the speculation configuration in one string, comma-separated key=value items, e.g. "
    "draft=model,gamma=4,verify=block (keys: draft, model, cross_vocab, quant, ngram, stop_below, min_share, choose_depth, gamma, "
    "max_gamma, tree, jump, verify, random, runner; see docs/guides/generating.md). --draft, --cross-vocab, --draft-quant, --gamma, --max-gamma, "
    "--ngram-sizes, --tree, --tree-rule, --verify, --seeding, --coupling and --runner are shorthands for its keys; a "
    "flag that disagrees with --spec is an error",
    "verify": "how drafted chains are verified: token-wise (default) or block verification (exact too, an accepted "
    "prefix at least as long in expectation; chains only)",
    "coupling": "gumbel: every token is the exponential race of p under noise keyed by (seed, position), drafts draw "
    "with the same noise: a seeded request then gives plain decoding's tokens for any drafter, gamma and batch",
    "seeding": "position: key every random number by (seed, output position) and draft each step's last position "
    "too, so a seeded request's tokens do not depend on --gamma (auto included), the batch or timing; one draft "
    "forward more per step; a draft model's chains (or --draft none) with --verify token; stream: every request on "
    "its own stream in draw order (default: neither, --spec random=auto: a request with a seed Gumbel-coupled as "
    "--coupling gumbel, one without on its stream)",
}


def add_device_args(
    p: argparse.ArgumentParser, *, device: bool = True, dtype_help: str = "float32 (default), bfloat16 or float16"
) -> None:
    p.add_argument("--dtype", type=dtype_name, default="float32", help=dtype_help)
    if device:
        p.add_argument("--device", default="cpu", help="cpu (default), cuda or cuda:N")
    p.add_argument("--threads", type=int_range(1), help="torch CPU threads (default: torch's own choice)")


def add_counts(p: argparse.ArgumentParser, *counts: tuple[str, int, int | None, str]) -> None:
    """Integer options, each given as (flag, lowest value, default, help); help may say %(default)s."""
    for name, low, default, text in counts:
        p.add_argument(name, type=int_range(low), default=default, help=text)


def add_level_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--level", type=level_type, default=0.01, help="family-wise significance level (default 0.01)")


def add_seed_arg(p: argparse.ArgumentParser, default: int | None = 0, help: str = "random seed (default 0)") -> None:
    p.add_argument("--seed", type=int_range(0, 2**63 - 1), default=default, help=help)


def add_runner_arg(
    p: argparse.ArgumentParser, help: str, torch_only: bool = False, default: str | None = "auto"
) -> None:
    """--runner; torch_only: a command whose models must be torch models (no llamacpp choice); default None: a
    shorthand of --spec runner=... (`spec_config` reads it)."""
    from ..model.fast import RUNNER_KINDS

    kinds = tuple(k for k in RUNNER_KINDS if not (torch_only and k == "llamacpp"))
    p.add_argument("--runner", choices=kinds, default=default, help=help)
    p.set_defaults(torch_only=torch_only)


def add_quant_arg(p: argparse.ArgumentParser, name: str, help: str, default: str | None = None) -> None:
    from ..model.linear import QUANT_MODES

    p.add_argument(name, choices=QUANT_MODES, default=default, help=help)


def add_tree_args(p: argparse.ArgumentParser) -> None:
    from ..sampling.tree import TREE_RULES

    p.add_argument("--tree", help=_HELP["tree"])
    p.add_argument("--tree-rule", choices=TREE_RULES, help=_HELP["tree_rule"])


def add_verify_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--verify", choices=("token", "block"), help=_HELP["verify"])


def add_coupling_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--coupling", choices=("gumbel",), help=_HELP["coupling"])


def add_seeding_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seeding", choices=("stream", "position"), help=_HELP["seeding"])


def add_spec_arg(p: argparse.ArgumentParser) -> None:
    """--spec: the whole speculation configuration in one string (`SpecConfig.parse`); read by `spec_config`."""
    p.add_argument("--spec", metavar="SPEC", help=_HELP["spec"])


def add_cross_vocab_arg(p: argparse.ArgumentParser) -> None:
    """--cross-vocab: how a draft with another tokenizer drafts (the spec key cross_vocab; default auto: tli)."""
    p.add_argument("--cross-vocab", choices=("tli", "slem"), help=_HELP["cross_vocab"])


def add_speculation_args(p: argparse.ArgumentParser) -> None:
    """Target, draft and how the draft runs: the options of `generate` and `serve`. The speculation flags default to
    None: they are shorthands of --spec keys, and the defaults are SpecConfig's (`spec_config`)."""
    from ..engine.config import SpecConfig

    default = SpecConfig()
    p.add_argument("--target", help=_HELP["target"])
    add_spec_arg(p)
    p.add_argument("--draft", help=_HELP["draft"])
    add_cross_vocab_arg(p)
    add_quant_arg(p, "--draft-quant", _HELP["draft_quant"])
    add_runner_arg(
        p,
        "model forward: auto (default: llama.cpp for a .gguf file when llama-cpp-python is installed, else verispec's "
        "fast runner where supported), fast, hf, or llamacpp (the GGUF file's own quantization, on llama.cpp's kernels)",
        default=None,
    )
    p.add_argument("--gamma", type=gamma_type(), help=f"drafts per step, or 'auto' (default {default.gamma})")
    p.add_argument(
        "--max-gamma", type=gamma_type(auto=False), help=f"upper bound for --gamma auto (default {default.max_gamma})"
    )
    p.add_argument("--ngram-sizes", type=_int_list, help=_HELP["ngram_sizes"])
    add_tree_args(p)
    add_verify_arg(p)
    add_coupling_arg(p)
    add_seeding_arg(p)
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
    from ..sampling import SamplingParams

    base = SamplingParams(**defaults)
    for name in names:
        kind, text = _SAMPLING_HELP[name]
        p.add_argument(flag(name), type=kind, default=getattr(base, name), help=f"{text}; default %(default)s")
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
    """The Constraint of the structured-output flags (None: none given); a bad file or schema names its flag."""
    from ..sampling import Constraint, ConstraintError

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
            return Constraint.json_schema(read(args.json_schema, "--json-schema"))
        if args.json_object:
            return Constraint.json_object()
        if args.regex is not None:
            return Constraint.regex(args.regex)
        if args.choice:
            return Constraint.choice(args.choice)
        if args.grammar is not None:
            return Constraint.grammar(read(args.grammar, "--grammar"))
    except ConstraintError as e:
        raise UsageError(f"{_constraint_flag(args)}: {e}") from None
    return None


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
    p.add_argument("--prompts", nargs="+", action="extend", help="JSONL prompt files ({'prompt': ...}; repeatable)")
    p.add_argument("--num-prompts", type=int_range(1), default=1, help="prompts taken from each file (default 1)")
    p.add_argument("--chat", action="store_true", help=chat_help)


# --- checks across flags, before a model loads ----------------------------------------------------------------


def sampling_params(args: argparse.Namespace, **extra):
    """The SamplingParams of the sampling options (see add_sampling_args); an invalid value names its flag."""
    from ..sampling import ParamError, SamplingParams

    if "constraint" not in extra and getattr(args, "constraint_flags", False):
        extra["constraint"] = constraint(args)
    try:
        return SamplingParams(**{name: getattr(args, name) for name in args.sampling_fields}, **extra)
    except ParamError as e:
        raise UsageError(f"{flag(e.field)} {e.message}") from None


_SPEC_FLAGS = {  # spec key -> its flag (verify, random and draft are spelled by value: see _flag_name)
    "quant": "--draft-quant",
    "cross_vocab": "--cross-vocab",
    "ngram": "--ngram-sizes",
    "gamma": "--gamma",
    "max_gamma": "--max-gamma",
    "runner": "--runner",
    "tree": "--tree",
}


def spec_config(args: argparse.Namespace, defaults: dict | None = None):
    """The one SpecConfig of --spec and the speculation flags that are its shorthands, checked before any model
    loads: a flag and --spec that set one key differently is an error, keys neither sets take the command's own
    `defaults` (keys), then SpecConfig's. Errors name what the user typed (flags, or --spec's keys). The config is
    also kept as `args.config` (where `load` reads the runner and the drafter)."""
    from ..engine.config import SpecConfig, SpecError, canonical, format_value, parse_items

    text = getattr(args, "spec", None)
    try:
        given = parse_items(text) if text is not None else {}
    except SpecError as e:
        raise UsageError(f"--spec {text}: {e}") from None
    flags = _flag_items(args, tree_given=getattr(args, "tree", None) is not None or given.get("tree") is not None)
    for key, (shown, value) in flags.items():
        if key in given and canonical(key, given[key]) != canonical(key, value):
            raise UsageError(f"{shown} disagrees with --spec {key}={format_value(given[key])}: give it once")
    try:
        cfg = SpecConfig(**(dict(defaults or {}) | given | {key: value for key, (_, value) in flags.items()}))
    except SpecError as e:
        message = e.render(lambda key, value: _flag_name(key, value, given, flags))
        raise UsageError(f"--spec {text}: {message}" if e.key in given else message) from None
    if not cfg.drafter.built_by_generator:
        raise UsageError(
            f"--spec {text}: draft={cfg.draft} is drafted by objects the command line cannot give (a RolloutEngine's "
            "history, a Proposer); use draft=ngram, none, model or self"
        )
    if cfg.drafter.model and cfg.model is None:
        raise UsageError("draft=model needs the draft model: --draft PATH, or model=PATH in --spec")
    args.config = cfg
    return cfg


def _flag_items(args: argparse.Namespace, tree_given: bool) -> dict:
    """The spec keys the speculation flags given set: key -> (the flag as typed, value)."""
    out = {}
    draft = getattr(args, "draft", None)
    if draft in ("ngram", "none", "self", "mtp"):
        out["draft"] = (f"--draft {draft}", draft)
    elif draft is not None:
        out["draft"], out["model"] = (f"--draft {draft}", "model"), (f"--draft {draft}", draft)
    for key, name in (
        ("quant", "draft_quant"),
        ("cross_vocab", "cross_vocab"),
        ("gamma", "gamma"),
        ("max_gamma", "max_gamma"),
        ("runner", "runner"),
    ):
        if getattr(args, name, None) is not None:
            out[key] = (f"{flag(name)} {getattr(args, name)}", getattr(args, name))
    if getattr(args, "ngram_sizes", None) is not None:
        out["ngram"] = (f"--ngram-sizes {','.join(map(str, args.ngram_sizes))}", args.ngram_sizes)
    if getattr(args, "tree", None) is not None:
        out["tree"] = (f"--tree {args.tree}", args.tree)
    verify, rule = getattr(args, "verify", None), getattr(args, "tree_rule", None)
    verify = None if verify == "token" and tree_given else verify  # the chains' rule, beside a tree's own
    if verify is not None and rule is not None:
        raise UsageError(f"--verify {verify} verifies chains and --tree-rule {rule} a --tree's: give one of them")
    if verify is not None or rule is not None:
        out["verify"] = (f"--verify {verify}", verify) if verify is not None else (f"--tree-rule {rule}", rule)
    seeding, coupling = getattr(args, "seeding", None), getattr(args, "coupling", None)
    if seeding == "position" and coupling is not None:
        raise UsageError(
            f"--seeding position works without --coupling: --coupling {coupling} keys its noise by position already "
            "(one setting, --spec random=auto|stream|position|gumbel)"
        )
    if coupling is not None or seeding is not None:
        out["random"] = (
            (f"--coupling {coupling}", coupling) if coupling is not None else (f"--seeding {seeding}", seeding)
        )
    return out


def _flag_name(key: str, value: str | None, given: dict, flags: dict) -> str:
    """How an error names a spec key: as --spec does where --spec set it, else as its flag."""
    from ..engine.config import spec_name
    from ..sampling.tree import TREE_RULES

    if key in given:
        return spec_name(key, value)
    if key in ("draft", "model") and (value == "model" or key == "model"):
        return flags["model"][0] if "model" in flags else "--draft PATH"
    if key == "draft":
        return "--draft" if value is None else f"--draft {value}"
    if key == "verify":
        name = "--tree-rule" if value in TREE_RULES else "--verify"
    elif key == "random":
        name = "--coupling" if value == "gumbel" else "--seeding"
    elif key in _SPEC_FLAGS:
        name, value = _SPEC_FLAGS[key], value.replace("-", ",") if key == "ngram" and value else value
    else:
        return spec_name(key, value)  # no flag: only --spec sets it
    return name if value is None else f"{name} {value}"


def pick(args: argparse.Namespace, *names: str) -> dict:
    """The options `names` as keyword arguments."""
    return {name: getattr(args, name) for name in names}


# --- running ---------------------------------------------------------------------------------------------------


def load(spec: str | None, args: argparse.Namespace, *, threads: bool = True):
    """Load one model with the device options, saying so on stderr. --runner llamacpp (or auto, for a GGUF file on
    the CPU when llama-cpp-python is installed) loads it into llama.cpp instead of torch."""
    from ..model.loading import DEFAULT_MODEL_NAME, load_model

    backend = backend_for(spec, args)
    print(f"loading {spec or DEFAULT_MODEL_NAME} ({backend}) ...", file=sys.stderr, flush=True)
    return load_model(
        spec, dtype=args.dtype, device=args.device, threads=args.threads if threads else None, backend=backend
    )


def backend_for(spec: str | None, args: argparse.Namespace) -> str:
    """torch or llamacpp, for a model spec under --runner (see `load`)."""
    from ..model.llamacpp import INSTALL_HINT, llamacpp_available

    config = getattr(args, "config", None)  # the SpecConfig of `spec_config`, where the command has one
    runner = config.runner if config is not None else getattr(args, "runner", None)  # none: torch models
    if runner == "llamacpp":
        if not llamacpp_available():
            raise UsageError(f"--runner llamacpp: {INSTALL_HINT}")
        return "llamacpp"
    gguf = spec is None or str(spec).endswith(".gguf")
    if config is not None:
        self_draft = config.drafter.target_weights or config.drafter.target_head
    else:
        self_draft = getattr(args, "draft", None) in ("self", "mtp")
    torch_needed = getattr(args, "torch_only", False) or self_draft  # quantizes (self) or reads (mtp) torch weights
    auto = runner == "auto" and gguf and not torch_needed and getattr(args, "device", "cpu") == "cpu"
    auto = auto and args.dtype == "float32"
    return "llamacpp" if auto and llamacpp_available() else "torch"


def read_prompts(args: argparse.Namespace) -> list[str]:
    """The texts of --prompt and --prompts (the first --num-prompts of each file); a default prompt if none."""
    texts = list(args.prompt or [])
    for path in args.prompts or []:
        try:
            rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
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
        return load_prompts(paths)
    except OSError as e:
        raise UsageError(f"cannot read prompts from {e.filename}: {e.strerror}") from None
    except ValueError as e:
        raise UsageError(f"--prompts: {e}") from None


def write_bench_report(out: str, name: str, result: dict, markdown: str, plot) -> None:
    """A benchmark's NAME.json (strict JSON), NAME.md and NAME.png (plot(result, path)) in folder `out`; prints the
    markdown and where the files went."""
    from pathlib import Path

    from ..strict_json import dumps

    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    files = [folder / f"{name}.{ext}" for ext in ("json", "md", "png")]
    files[0].write_text(dumps(result, indent=2))
    files[1].write_text(markdown + "\n")
    plot(result, files[2])
    print(markdown)
    print("wrote " + ", ".join(map(str, files)))


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
        help="JSONL prompt files ({'prompt', 'category'}; repeatable)",
    )
    add_counts(p, *counts)


def add_bench_model_args(
    p: argparse.ArgumentParser, name: str, draft_quant_help: str, self_quant_help: str, torch_only: bool = False
) -> None:
    """The options a model benchmark shares: seed, chat template, runner (torch_only: no llamacpp), draft / self-draft
    quantization, device, --out."""
    add_seed_arg(p)
    p.add_argument("--no-chat", action="store_true", help="feed prompts raw instead of through the chat template")
    add_runner_arg(p, "verispec's model forward (default auto)", torch_only)
    add_quant_arg(p, "--draft-quant", draft_quant_help)
    add_quant_arg(p, "--self-quant", self_quant_help, default="int4")
    add_device_args(p)
    p.add_argument("--out", default=f"bench-{name}", help=f"folder for {name}.json, {name}.md and {name}.png")


def bench_model_options(args: argparse.Namespace) -> dict:
    """The benchmark config fields that add_bench_model_args' options give (seed, chat, runner, quantizations)."""
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


def run_model_bench(args: argparse.Namespace, name: str, cfg, run, report) -> int:
    """Load --target (and --draft, when given) with the device options, `run(target, draft, the --prompts, cfg,
    log=log_stderr)` and write its result into --out (`report.to_markdown`, `report.plot`: the bench module)."""
    prompts = read_bench_prompts(args.prompts)
    with model_errors():
        target = load(args.target, args)
        draft = load(args.draft, args, threads=False) if args.draft else None
        result = run(target, draft, prompts, cfg, log=log_stderr)
    write_bench_report(args.out, name, result, report.to_markdown(result), report.plot)
    return 0
