"""`verispec bench structured`: constrained decoding (JSON-schema extraction), with and without speculation, every
method side by side in one process and one run.

Every prompt of the set (`DEFAULT_PROMPTS`: JSONL lines {"category", "prompt", "schema"}) is decoded under its
schema (`Constraint.json_schema`) by every method in turn (prompt by prompt, so load drift on a shared host falls on
all methods alike), at each temperature, with the chat template, the same seed per prompt and repeat:
    plain         SpecConfig draft=none: plain constrained decoding (the baseline ratios are relative to)
    spec          draft=ngram,gamma=auto with jump-forward (SpecConfig's jump, default 16 tokens per step)
    spec-nojump   draft=ngram,gamma=auto,jump=0: prompt lookup alone, cut where the grammar refuses
    jump-only     no drafter but the grammar: a Proposer that drafts nothing, so each chain is the grammar's
                  forced tokens alone (jump-forward)
    draft         draft=model,gamma=auto with the --draft model (and jump-forward); only with a draft model
    self          draft=self,gamma=auto: the target's weights quantized (config.self_quant) as the draft
    verispec:SPEC any other speculation configuration (SpecConfig's string form)
Generation stops at EOS (where the grammar allows it: the document is complete) or at max_new_tokens.

Per method, category and overall: tokens/s and its ratio to plain, tau (tokens per target pass), alpha (accepted
drafts / drafted, jump-forward tokens included), the jump-forward tokens proposed and accepted, the grammar's cost
(masks computed per token, microseconds per mask, and the share of wall time spent in the grammar: masks, the
walks that cut and extend drafts, and advancing each row's matcher) and the validity rate: every output that ended
with "stop" must parse as JSON and validate against its schema (jsonschema, or jsonschema_rs); outputs cut by
max_new_tokens ("length") are counted apart. The grammar's costs are measured by wrapping the engine's grammar
entry points for the run (`_Probe`); the run's wall times include those wrappers' own overhead (~1 us a call).

With the default random=auto a seeded request is Gumbel-coupled: every method then emits plain decoding's tokens
for that seed (lossless speculation, one workload for all methods), which `same_as_plain` counts.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch

from ..drafting.base import Draft, Proposer
from ..engine.config import SpecConfig, SpecError, parse_items
from ..engine.generator import SpeculativeGenerator
from ..model.loading import LoadedModel
from ..sampling import Constraint, SamplingParams
from ._provenance import provenance, provenance_lines

__all__ = [
    "DEFAULT_PROMPTS",
    "METHODS",
    "StructuredConfig",
    "load_extract_prompts",
    "method_config",
    "plot",
    "run_structured",
    "summarize",
    "to_markdown",
    "validate",
]

DEFAULT_PROMPTS = "extract.jsonl"  # in verispec/bench/data (shipped inside the package)
METHODS = {  # name -> its spec keys (jump-only: a Proposer that drafts nothing, given separately)
    "plain": {"draft": "none"},
    "spec": {"draft": "ngram", "gamma": "auto"},
    "spec-nojump": {"draft": "ngram", "gamma": "auto", "jump": 0},
    "jump-only": {"draft": "custom", "gamma": 1},
    "draft": {"draft": "model", "gamma": "auto"},
    "self": {"draft": "self", "gamma": "auto"},
}


@dataclass(frozen=True)
class StructuredConfig:
    max_new_tokens: int = 128
    temperatures: tuple[float, ...] = (1.0,)
    repeats: int = 1
    num_prompts: int | None = None  # per category (None: all)
    seed: int = 0
    chat: bool = True
    runner: str = "auto"
    random: str = "auto"  # SpecConfig's random of every method (auto: seeded requests Gumbel-coupled)
    jump: int = 16  # jump-forward tokens per step of the methods that jump (spec, jump-only, draft, self)
    draft_quant: str | None = None
    self_quant: str = "int4"
    methods: tuple[str, ...] = ("plain", "spec", "spec-nojump", "jump-only", "draft")

    def __post_init__(self):
        if "plain" not in self.methods:
            raise ValueError("the methods must include plain (the baseline)")
        for m in self.methods:
            method_config(m, self)


def method_config(name: str, cfg: StructuredConfig) -> SpecConfig:
    """The SpecConfig of a method (see the module docstring); ValueError for an unknown name or a bad spec."""
    if name.startswith("verispec:"):
        try:
            items = parse_items(name.removeprefix("verispec:"))
        except SpecError as e:
            raise ValueError(f"method {name!r}: {e}") from None
    elif name in METHODS:
        items = dict(METHODS[name])
    else:
        raise ValueError(f"unknown method {name!r}; choose from {', '.join(METHODS)} or verispec:SPEC")
    draft = items.get("draft", SpecConfig.draft)
    base = {"runner": cfg.runner, "random": cfg.random}
    if draft != "none":
        base["jump"] = cfg.jump
    if draft == "model":
        base["quant"] = cfg.draft_quant
    elif draft == "self":
        base["quant"] = cfg.self_quant
    try:
        return SpecConfig(**(base | items))
    except SpecError as e:
        raise ValueError(f"method {name!r}: {e}") from None


class _NoDraft(Proposer):
    """Drafts nothing: with a constraint, each step's chain is the grammar's forced tokens (jump-forward) alone."""

    name = "no-draft"

    def propose(self, view, caps):
        return Draft.empty(len(caps), torch.device("cpu"))


def load_extract_prompts(path: str | Path | None = None) -> list[dict]:
    """The prompt set: JSONL lines {"category", "prompt", "schema"} (default: the set shipped in the package)."""
    if path is None:
        text = resources.files("verispec.bench").joinpath("data", DEFAULT_PROMPTS).read_text(encoding="utf-8")
        name = DEFAULT_PROMPTS
    else:
        text, name = Path(path).read_text(encoding="utf-8"), str(path)
    rows = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            row = {"category": str(rec.get("category") or "all"), "prompt": str(rec["prompt"])}
            row["schema"] = rec["schema"]
            Constraint.json_schema(row["schema"])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{name}:{n}: expected a JSON object with 'prompt' and 'schema' fields ({e})") from None
        rows.append(row)
    if not rows:
        raise ValueError(f"{name}: no prompts")
    return rows


# --- validity ---------------------------------------------------------------------------------------------------


def _validator():
    """(name, check(schema, instance) -> error text or None) of the installed JSON-schema validator, or None."""
    try:
        import jsonschema

        def check(schema, value):
            cls = jsonschema.validators.validator_for(schema)
            err = jsonschema.exceptions.best_match(cls(schema).iter_errors(value))
            return None if err is None else err.message

        return "jsonschema", check
    except ImportError:
        pass
    try:
        import jsonschema_rs

        def check_rs(schema, value):
            try:
                jsonschema_rs.validate(schema, value)
            except jsonschema_rs.ValidationError as e:
                return str(e).splitlines()[0]
            return None

        return "jsonschema_rs", check_rs
    except ImportError:
        return None


def validate(text: str, schema, check=None) -> tuple[bool, str | None]:
    """(valid, why not): the text parses as one JSON document and (when a validator is given) matches the schema."""
    try:
        value = json.loads(text)
    except ValueError as e:
        return False, f"not JSON: {e}"
    if check is not None:
        err = check(schema, value)
        if err is not None:
            return False, f"schema: {err}"
    return True, None


# --- the grammar probe ------------------------------------------------------------------------------------------


class _Probe:
    """Wraps the engine's grammar entry points for a run: time in them (grammar_s: masks, draft fitting, matcher
    advances and request setup; mask_s: the masks filled alone), masks filled, and jump-forward tokens
    proposed (tokens appended beyond the drafter's own chain) and accepted (of those, the ones verification kept)."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.grammar_s = self.mask_s = 0.0
        self.masks = self.jump_proposed = self.jump_accepted = 0

    def __enter__(self):
        from ..engine import batch, core, session
        from ..structured import grammar

        probe = self
        self._saved = []

        def patch(owner, name, make):
            old = getattr(owner, name)
            self._saved.append((owner, name, old))
            setattr(owner, name, make(old))

        def timed(old):
            def wrapper(*a, **k):
                t0 = time.perf_counter()
                try:
                    return old(*a, **k)
                finally:
                    probe.grammar_s += time.perf_counter() - t0

            return wrapper

        def fill(old):  # the grammar's own mask computations (a cached path costs a dict lookup, not counted)
            def wrapper(state, key):
                before, t0 = state.masks_filled, time.perf_counter()
                try:
                    return old(state, key)
                finally:
                    if state.masks_filled > before:
                        probe.mask_s += time.perf_counter() - t0
                        probe.masks += state.masks_filled - before

            return wrapper

        fitted = {}

        def fit(old):
            def wrapper(draft, grammars, room, jump):
                t0 = time.perf_counter()
                out = old(draft, grammars, room, jump)
                probe.grammar_s += time.perf_counter() - t0
                if out is not draft and draft.chain:
                    before, after = draft.token_ids.tolist(), out.token_ids.tolist()
                    starts = []
                    for b in range(len(after)):
                        mine, theirs = before[b][: draft.num_nodes[b]], after[b][: out.num_nodes[b]]
                        same = 0
                        while same < min(len(mine), len(theirs)) and mine[same] == theirs[same]:
                            same += 1
                        starts.append((same, len(theirs)))
                        probe.jump_proposed += len(theirs) - same
                    fitted.clear()
                    fitted[id(out)] = starts
                return out

            return wrapper

        def commit(old):
            def wrapper(sess, view, draft, out, *rest):
                starts = fitted.pop(id(draft), None)
                if starts is not None:
                    for (start, end), acc in zip(starts, out.accepted):
                        probe.jump_accepted += max(0, min(acc, end) - start)
                return old(sess, view, draft, out, *rest)

            return wrapper

        patch(grammar.GrammarState, "_fill", fill)
        patch(grammar.GrammarState, "advance", timed)
        patch(grammar.GrammarState, "stuck", lambda old: property(timed(old.fget)))  # the next root's mask, per step
        patch(batch, "allowed_at_nodes", timed)
        patch(batch, "root_allowed", timed)
        patch(core.EngineCore, "grammar_state", timed)
        patch(session, "fit_draft", fit)
        patch(session.GenerationSession, "_commit", commit)
        return self

    def __exit__(self, *exc):
        for owner, name, old in reversed(self._saved):
            setattr(owner, name, old)
        self._saved = []


# --- the run ----------------------------------------------------------------------------------------------------


def _generator(name: str, target: LoadedModel, draft: LoadedModel | None, cfg: StructuredConfig):
    config = method_config(name, cfg)
    if config.draft == "custom":
        return SpeculativeGenerator(target, _NoDraft(), config=config)
    return SpeculativeGenerator(target, draft if config.drafter.model else None, config=config)


def _runnable(methods, target, draft, cfg, log) -> list[str]:
    keep = []
    for m in methods:
        config = method_config(m, cfg)
        if config.drafter.model and draft is None:
            log(f"{m} skipped: it needs a draft model (--draft)")
        elif config.drafter.target_weights and not isinstance(target.model, torch.nn.Module):
            log(f"{m} skipped: a quantized self-draft needs a torch target")
        else:
            keep.append(m)
    return keep


def run_structured(
    target: LoadedModel, draft: LoadedModel | None, prompts: list[dict], cfg: StructuredConfig, log=print
) -> dict:
    """Every method of cfg on every prompt (see the module docstring): one record per temperature, repeat, prompt
    and method, then the summary per method and category (`summarize`)."""
    origin = provenance()  # the code, date and command at the start of the run
    if cfg.num_prompts is not None:
        seen: dict[str, int] = defaultdict(int)
        chosen = []
        for p in prompts:
            if seen[p["category"]] < cfg.num_prompts:
                seen[p["category"]] += 1
                chosen.append(p)
        prompts = chosen
    methods = _runnable(cfg.methods, target, draft, cfg, log)
    gens = {}
    for m in methods:
        if method_config(m, cfg).drafter.target_weights:
            log(f"quantizing the target's weights ({cfg.self_quant}) for the self-draft ...")
        gens[m] = _generator(m, target, draft, cfg)
    plain = gens["plain"]
    constraints = [Constraint.json_schema(p["schema"]) for p in prompts]
    # every schema compiled before any timing (each generator has its own compiler cache); the first one's times
    compile_s = []
    for name, gen in gens.items():
        for c in constraints:
            t0 = time.perf_counter()
            gen.core.grammars.compile(c)
            if name == "plain":
                compile_s.append(time.perf_counter() - t0)
    log("calibrating gamma auto's cost curves at batch 1 ...")
    calibration = {}
    for name, gen in gens.items():
        if gen.proposer is not None and gen.controller.fixed is None:
            calibration[name] = {str(b): v for b, v in gen.calibrate((1,), repeats=2).items()}
    ids = [plain.encode(p["prompt"], chat=cfg.chat) for p in prompts]
    for gen in gens.values():  # warm-up: one short constrained generation each
        gen.generate([ids[0]], [SamplingParams(seed=0, constraint=constraints[0])], max_new_tokens=4)
    found = _validator()
    check = found[1] if found else None
    records = []
    probe = _Probe()
    with probe:
        for temp in cfg.temperatures:
            for rep in range(cfg.repeats):
                for i, (p, c) in enumerate(zip(prompts, constraints)):
                    seed = cfg.seed + 1000 * rep + i
                    for m in methods:
                        probe.reset()
                        params = SamplingParams(temperature=temp, seed=seed, constraint=c)
                        out = gens[m].generate([ids[i]], [params], max_new_tokens=cfg.max_new_tokens)[0]
                        s = gens[m].last_stats
                        rec = {
                            "temperature": temp,
                            "repeat": rep,
                            "prompt": i,
                            "category": p["category"],
                            "method": m,
                            "seed": seed,
                            "tokens": s.output_tokens,
                            "seconds": s.wall_time,
                            "target_passes": s.target_passes,
                            "emitted": s.emitted,
                            "drafted": s.drafted,
                            "accepted": s.accepted,
                            "jump_proposed": probe.jump_proposed,
                            "jump_accepted": probe.jump_accepted,
                            "masks": probe.masks,
                            "mask_s": probe.mask_s,
                            "grammar_s": probe.grammar_s,
                            "finish_reason": out.finish_reason,
                            "text": out.text,
                        }
                        rec.update(_validity(rec, p["schema"], check))
                        records.append(rec)
                        log(
                            f"T={temp:g} r{rep} #{i:<2d} {p['category']:9s} {m:12s} {rec['tokens']:4d} tok "
                            f"{rec['tokens'] / max(rec['seconds'], 1e-9):6.2f} tok/s tau "
                            f"{s.emitted / max(s.target_passes, 1):.2f} {out.finish_reason} "
                            f"{'valid' if rec['valid'] else 'INVALID' if rec['valid'] is False else ''}"
                        )
    for rec in records:  # the same text as plain decoding for the same seed (Gumbel coupling, or T = 0)
        base = next(
            r for r in records if r["method"] == "plain" and (r["temperature"], r["repeat"], r["prompt"]) == _key(rec)
        )
        rec["same_as_plain"] = rec["text"] == base["text"]
    return {
        **origin,  # commit, dirty, date, command, verispec, python, torch, threads
        "config": cfg.__dict__ | {"temperatures": list(cfg.temperatures), "methods": list(methods)},
        "target": target.name,
        "draft": draft.name if draft else None,
        "runner": type(plain.runner).__name__,
        "specs": {m: str(g.config) for m, g in gens.items()},
        "validator": found[0] if found else None,
        "prompts": len(prompts),
        "schema_compile_s": compile_s,
        "calibration": calibration,
        "records": records,
        "summary": summarize(records),
    }


def _key(rec: dict) -> tuple:
    return rec["temperature"], rec["repeat"], rec["prompt"]


def _validity(rec: dict, schema, check) -> dict:
    if rec["finish_reason"] != "stop":
        return {"valid": None, "invalid_reason": None}
    ok, why = validate(rec["text"], schema, check)
    return {"valid": ok, "invalid_reason": why}


def summarize(records: list[dict]) -> list[dict]:
    """One row per temperature, method and category (and category "all"), with ratios to plain's row."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in records:
        groups[(r["temperature"], r["method"], r["category"])].append(r)
        groups[(r["temperature"], r["method"], "all")].append(r)
    rows = []
    for (temp, method, cat), rs in groups.items():
        tot = {k: sum(r[k] for r in rs) for k in _SUMMED}
        stop = [r for r in rs if r["finish_reason"] == "stop"]
        row = {"temperature": temp, "method": method, "category": cat, "outputs": len(rs)} | tot
        row["tokens_per_s"] = tot["tokens"] / tot["seconds"] if tot["seconds"] else None
        row["tau"] = tot["emitted"] / tot["target_passes"] if tot["target_passes"] else None
        row["alpha"] = tot["accepted"] / tot["drafted"] if tot["drafted"] else None
        row["jump_acceptance"] = tot["jump_accepted"] / tot["jump_proposed"] if tot["jump_proposed"] else None
        row["masks_per_token"] = tot["masks"] / tot["tokens"] if tot["tokens"] else None
        row["us_per_mask"] = 1e6 * tot["mask_s"] / tot["masks"] if tot["masks"] else None
        row["grammar_ms_per_token"] = 1e3 * tot["grammar_s"] / tot["tokens"] if tot["tokens"] else None
        row["grammar_share"] = tot["grammar_s"] / tot["seconds"] if tot["seconds"] else None
        row["mask_share"] = tot["mask_s"] / tot["seconds"] if tot["seconds"] else None
        row["stopped"] = len(stop)
        row["valid"] = sum(bool(r["valid"]) for r in stop)
        row["invalid"] = len(stop) - row["valid"]
        row["length"] = sum(r["finish_reason"] == "length" for r in rs)
        row["validity"] = row["valid"] / len(stop) if stop else None
        row["same_as_plain"] = sum(bool(r.get("same_as_plain")) for r in rs)
        rows.append(row)
    for row in rows:
        base = next(
            r
            for r in rows
            if (r["temperature"], r["method"], r["category"]) == (row["temperature"], "plain", row["category"])
        )
        tps, base_tps = row["tokens_per_s"], base["tokens_per_s"]
        row["speedup"] = tps / base_tps if tps and base_tps else None
    return rows


_SUMMED = (
    "tokens",
    "seconds",
    "target_passes",
    "emitted",
    "drafted",
    "accepted",
    "jump_proposed",
    "jump_accepted",
    "masks",
    "mask_s",
    "grammar_s",
)


def _fmt(x, spec=".2f"):
    return "-" if x is None else format(x, spec)


def to_markdown(result: dict) -> str:
    cfg = result["config"]
    comp = result["schema_compile_s"]
    lines = [
        *provenance_lines(result),
        f"target: {result['target']}; draft: {result['draft']}; runner {result['runner']}; torch {result['torch']}, "
        f"{result['threads']} threads",
        f"{result['prompts']} prompts x {cfg['repeats']} repeat(s), max_new_tokens {cfg['max_new_tokens']}, "
        f"chat template {'on' if cfg['chat'] else 'off'}, random={cfg['random']}; validator: "
        f"{result['validator'] or 'none installed (JSON parse only)'}; schema compile (xgrammar) "
        + (f"{1e3 * sum(comp) / len(comp):.1f} ms mean, {1e3 * max(comp):.1f} ms max" if comp else "-"),
        "methods: " + "; ".join(f"{m} = {s}" for m, s in result["specs"].items()),
        "",
        "| T | category | method | tokens | tok/s | vs plain | tau | alpha | jump tokens proposed / accepted "
        "| masks / token | us / mask | grammar ms / token | grammar share (masks alone) | valid / stopped "
        "| length | same text as plain |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    rows = sorted(
        result["summary"],
        key=lambda r: (r["temperature"], r["category"] == "all", r["category"], cfg["methods"].index(r["method"])),
    )
    for r in rows:
        lines.append(
            f"| {r['temperature']:g} | {r['category']} | {r['method']} | {r['tokens']} | {_fmt(r['tokens_per_s'])} | "
            f"{_fmt(r['speedup'])} | {_fmt(r['tau'])} | {_fmt(r['alpha'])} | "
            f"{r['jump_proposed']} / {r['jump_accepted']} | {_fmt(r['masks_per_token'])} | "
            f"{_fmt(r['us_per_mask'], '.1f')} | {_fmt(r['grammar_ms_per_token'])} | "
            f"{_fmt(100 * r['grammar_share'] if r['grammar_share'] is not None else None, '.1f')}% "
            f"({_fmt(100 * r['mask_share'] if r['mask_share'] is not None else None, '.1f')}%) | "
            f"{r['valid']} / {r['stopped']} | {r['length']} | {r['same_as_plain']} / {r['outputs']} |"
        )
    bad = [r for r in result["records"] if r["valid"] is False]
    if bad:
        lines += ["", "Invalid outputs:"]
        lines += [f"- {r['method']} prompt {r['prompt']} ({r['category']}): {r['invalid_reason']}" for r in bad]
    return "\n".join(lines)


def plot(result: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["summary"] if r["temperature"] == result["config"]["temperatures"][0]]
    cats = list(dict.fromkeys(r["category"] for r in rows))
    methods = result["config"]["methods"]
    width = 0.8 / len(methods)
    fig, ax = plt.subplots(figsize=(8, 4))
    for i, m in enumerate(methods):
        vals = [next((r["speedup"] or 0 for r in rows if r["method"] == m and r["category"] == c), 0) for c in cats]
        ax.bar([x + i * width for x in range(len(cats))], vals, width, label=m)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([x + width * (len(methods) - 1) / 2 for x in range(len(cats))], cats)
    ax.set_ylabel("tokens/s over plain constrained decoding")
    ax.set_title(f"JSON-schema extraction, T={result['config']['temperatures'][0]:g}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
