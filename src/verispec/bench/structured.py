"""`verispec bench structured`: constrained decoding (JSON-schema extraction), every method (METHODS or `verispec:SPEC`)
side by side in one run; what it measures: docs/benchmarks.md, "What each benchmark measures"."""

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
from ..engine.observe import StepObserver
from ..model.loading import LoadedModel
from ..sampling import Constraint, SamplingParams
from .harness import SelfDraftBenchConfig, bars, fmt, jsonl, ratio_to, report_head, side_by_side, started, table

__all__ = ["DEFAULT_PROMPTS", "METHODS", "StructuredConfig", "load_extract_prompts", "method_config", "plot"]
__all__ += ["run_structured", "summarize", "to_markdown", "validate"]

DEFAULT_PROMPTS = "extract.jsonl"  # in verispec/bench/data (shipped inside the package)
METHODS = {"plain": {"draft": "none"}, "spec": {"draft": "ngram", "gamma": "auto"}}  # name -> its spec keys
METHODS |= {"spec-nojump": {"draft": "ngram", "gamma": "auto", "jump": 0}, "jump-only": {"draft": "custom", "gamma": 1}}
METHODS |= {"draft": {"draft": "model", "gamma": "auto"}, "self": {"draft": "self", "gamma": "auto"}}


@dataclass(frozen=True)
class StructuredConfig(SelfDraftBenchConfig):
    max_new_tokens: int = 128
    temperatures: tuple[float, ...] = (1.0,)
    repeats: int = 1
    num_prompts: int | None = None  # per category (None: all)
    random: str = "auto"  # SpecConfig's random of every method (auto: seeded requests Gumbel-coupled)
    jump: int = 16  # jump-forward tokens per step of the methods that jump (spec, jump-only, draft, self)
    methods: tuple[str, ...] = ("plain", "spec", "spec-nojump", "jump-only", "draft")

    def __post_init__(self):
        if "plain" not in self.methods:
            raise ValueError("the methods must include plain (the baseline)")
        for m in self.methods:
            method_config(m, self)


def method_config(name: str, cfg: StructuredConfig) -> SpecConfig:
    """The SpecConfig of a method (see the module docstring); ValueError for an unknown name or a bad spec."""
    try:
        if name.startswith("verispec:"):
            items = parse_items(name.removeprefix("verispec:"))
        elif name in METHODS:
            items = dict(METHODS[name])
        else:
            raise ValueError(f"unknown method {name!r}; choose from {', '.join(METHODS)} or verispec:SPEC")
        draft = items.get("draft", SpecConfig.draft)
        base = {"runner": cfg.runner, "random": cfg.random} | ({"jump": cfg.jump} if draft != "none" else {})
        return SpecConfig(**(base | cfg.quant_keys(draft) | items))
    except SpecError as e:
        raise ValueError(f"method {name!r}: {e}") from None


class _NoDraft(Proposer):
    """Drafts nothing: with a constraint, each step's chain is the grammar's forced tokens (jump-forward) alone."""

    name = "no-draft"

    def propose(self, view, caps):
        return Draft.empty(len(caps), torch.device("cpu"))


def load_extract_prompts(path: str | Path | None = None) -> list[dict]:
    """The prompt set: JSONL lines {"category", "prompt", "schema"} (default: the set shipped in the package)."""
    name = DEFAULT_PROMPTS if path is None else str(path)
    source = resources.files("verispec.bench").joinpath("data", DEFAULT_PROMPTS) if path is None else Path(path)
    text = source.read_text(encoding="utf-8")
    rows = [
        {"category": str(r.get("category") or "all"), "prompt": str(r["prompt"]), "schema": r["schema"]}
        for r in jsonl(text, name, ("prompt", "schema"))
    ]
    for n, row in enumerate(rows):
        try:
            Constraint.json_schema(row["schema"])
        except (TypeError, ValueError) as e:
            raise ValueError(f"{name}: prompt {n + 1}'s schema: {e}") from None
    if not rows:
        raise ValueError(f"{name}: no prompts")
    return rows


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
    err = check(schema, value) if check is not None else None
    return (True, None) if err is None else (False, f"schema: {err}")


def _validity(rec: dict, schema, check) -> dict:
    if rec["finish_reason"] != "stop":
        return {"valid": None, "invalid_reason": None}
    ok, why = validate(rec["text"], schema, check)
    return {"valid": ok, "invalid_reason": why}


class _Probe(StepObserver):
    """Watches the steps of one generate call at a time (`reset` between): each request's GrammarState (its own
    counters: masks computed, their seconds, the seconds of every grammar call), and the jump-forward tokens
    proposed (the fitted chain beyond what it shares with the drafter's) and accepted (of those, the ones kept)."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.states, self.jump_proposed, self.jump_accepted, self._jumps = [], 0, 0, None

    def grammar(self, request, state):
        if state is not None:
            self.states.append(state)
        return state

    def after_fit(self, view, drafted, fitted):
        self._jumps = None
        if fitted is drafted or not drafted.chain:
            return None
        before, after = drafted.token_ids.tolist(), fitted.token_ids.tolist()
        self._jumps = []  # per row: (where its jump-forward tokens start, where they end)
        for b, (n, m) in enumerate(zip(drafted.num_nodes, fitted.num_nodes)):
            mine, theirs = before[b][: int(n)], after[b][: int(m)]
            same = next((i for i, (x, y) in enumerate(zip(mine, theirs)) if x != y), min(len(mine), len(theirs)))
            self._jumps.append((same, len(theirs)))
            self.jump_proposed += len(theirs) - same
        return None

    def after_verify(self, view, draft, out) -> None:
        if self._jumps is not None:
            accepted = out.accepted.tolist() if isinstance(out.accepted, torch.Tensor) else out.accepted
            self.jump_accepted += sum(max(0, min(a, end) - start) for (start, end), a in zip(self._jumps, accepted))
            self._jumps = None

    def figures(self) -> dict:
        counted = dict(masks="masks_filled", mask_s="mask_seconds", grammar_s="seconds")  # figure -> GrammarState's
        sums = {k: sum(getattr(s, a) for s in self.states) for k, a in counted.items()}
        return dict(jump_proposed=self.jump_proposed, jump_accepted=self.jump_accepted, **sums)


def _generators(methods, target: LoadedModel, draft, cfg: StructuredConfig, probe: _Probe, log) -> dict:
    """A generator per method this run can run (a draft model's methods need one; a self-draft a torch target)."""
    gens = {}
    for m in methods:
        config = method_config(m, cfg)
        if config.drafter.model and draft is None:
            log(f"{m} skipped: it needs a draft model (--draft)")
        elif config.drafter.target_weights and not isinstance(target.model, torch.nn.Module):
            log(f"{m} skipped: a quantized self-draft needs a torch target")
        else:
            if config.drafter.target_weights:
                log(f"quantizing the target's weights ({cfg.self_quant}) for the self-draft ...")
            drafter = _NoDraft() if config.draft == "custom" else draft if config.drafter.model else None
            gens[m] = SpeculativeGenerator(target, drafter, config=config, observers=[probe])
    return gens


def _prepare(gens: dict, constraints: list, first_ids: list[int], log) -> tuple[list[float], dict]:
    """Before any timing: every schema compiled by every generator (plain's compile seconds returned), gamma auto's
    cost curves at batch 1, and one short constrained generation each (a warm-up)."""
    compile_s = []
    for name, gen in gens.items():
        for c in constraints:
            t0 = time.perf_counter()
            gen.core.grammars.compile(c)
            compile_s += [time.perf_counter() - t0] if name == "plain" else []
    log("calibrating gamma auto's cost curves at batch 1 ...")
    calibration = {
        name: {str(b): v for b, v in gen.calibrate((1,), repeats=2).items()}
        for name, gen in gens.items()
        if gen.core.proposer is not None and gen.core.controller.fixed is None
    }
    for gen in gens.values():
        gen.generate([first_ids], [SamplingParams(seed=0, constraint=constraints[0])], max_new_tokens=4)
    return compile_s, calibration


def run_structured(target: LoadedModel, draft, prompts: list[dict], cfg: StructuredConfig, log=print) -> dict:
    """Every method of cfg on every prompt (see the module docstring): one record per temperature, repeat, prompt
    and method, then the summary per method and category (`summarize`)."""
    result = started()  # the code, date and command at the start of the run
    if cfg.num_prompts is not None:  # the first num_prompts of each category
        rank = [sum(q["category"] == p["category"] for q in prompts[:i]) for i, p in enumerate(prompts)]
        prompts = [p for p, n in zip(prompts, rank) if n < cfg.num_prompts]
    probe = _Probe()
    gens = _generators(cfg.methods, target, draft, cfg, probe, log)
    constraints = [Constraint.json_schema(p["schema"]) for p in prompts]
    ids = [gens["plain"].encode(p["prompt"], chat=cfg.chat) for p in prompts]
    compile_s, calibration = _prepare(gens, constraints, ids[0], log)
    found = _validator()
    check = found[1] if found else None
    cases = [
        dict(temperature=t, repeat=r, prompt=i, category=p["category"], seed=cfg.seed + 1000 * r + i)
        for t in cfg.temperatures
        for r in range(cfg.repeats)
        for i, p in enumerate(prompts)
    ]

    def one(method: str, case: dict) -> dict:
        probe.reset()
        i = case["prompt"]
        params = SamplingParams(temperature=case["temperature"], seed=case["seed"], constraint=constraints[i])
        out = gens[method].generate([ids[i]], [params], max_new_tokens=cfg.max_new_tokens)[0]
        s = gens[method].last_stats
        rec = dict(tokens=s.output_tokens, seconds=s.wall_time, tokens_per_s=s.output_tokens / max(s.wall_time, 1e-9))
        rec |= dict(target_passes=s.target_passes, emitted=s.emitted, tau=s.emitted / max(s.target_passes, 1))
        rec |= dict(drafted=s.drafted, accepted=s.accepted, **probe.figures())
        rec |= dict(finish_reason=out.finish_reason, text=out.text)
        return rec | _validity(rec, prompts[i]["schema"], check)

    records = side_by_side(cases, list(gens), one, log)
    for rec in records:  # the same text as plain decoding for the same seed (Gumbel coupling, or T = 0)
        base = next(r for r in records if r["method"] == "plain" and _key(r) == _key(rec))
        rec["same_as_plain"] = rec["text"] == base["text"]
    config = cfg.__dict__ | {"temperatures": list(cfg.temperatures), "methods": list(gens)}
    result |= dict(config=config, target=target.name, draft=draft.name if draft else None)
    result |= dict(runner=type(gens["plain"].core.runner).__name__, specs={m: str(g.config) for m, g in gens.items()})
    result |= dict(validator=found[0] if found else None, prompts=len(prompts), schema_compile_s=compile_s)
    return result | dict(calibration=calibration, records=records, summary=summarize(records))


def _key(rec: dict) -> tuple:
    return rec["temperature"], rec["repeat"], rec["prompt"]


_SUMMED = ("tokens", "seconds", "target_passes", "emitted", "drafted", "accepted", "jump_proposed", "jump_accepted")
_SUMMED += ("masks", "mask_s", "grammar_s")
_RATES = {"tokens_per_s": ("tokens", "seconds", 1), "tau": ("emitted", "target_passes", 1)}  # (num., denom., scale)
_RATES |= {"alpha": ("accepted", "drafted", 1), "jump_acceptance": ("jump_accepted", "jump_proposed", 1)}
_RATES |= {"masks_per_token": ("masks", "tokens", 1), "us_per_mask": ("mask_s", "masks", 1e6)}
_RATES |= {"grammar_ms_per_token": ("grammar_s", "tokens", 1e3), "grammar_share": ("grammar_s", "seconds", 1)}
_RATES |= {"mask_share": ("mask_s", "seconds", 1)}


def summarize(records: list[dict]) -> list[dict]:
    """One row per temperature, method and category (and category "all"), with ratios to plain's row."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in records:
        groups[(r["temperature"], r["method"], r["category"])].append(r)
        groups[(r["temperature"], r["method"], "all")].append(r)
    rows = []
    for (temp, method, cat), rs in groups.items():
        row = {"temperature": temp, "method": method, "category": cat, "outputs": len(rs)}
        row |= {k: sum(r[k] for r in rs) for k in _SUMMED}
        row |= {k: scale * row[a] / row[b] if row[b] else None for k, (a, b, scale) in _RATES.items()}
        stop = [r for r in rs if r["finish_reason"] == "stop"]
        row |= dict(stopped=len(stop), valid=sum(bool(r["valid"]) for r in stop))
        row |= dict(invalid=len(stop) - row["valid"], length=sum(r["finish_reason"] == "length" for r in rs))
        row["validity"] = row["valid"] / len(stop) if stop else None
        row["same_as_plain"] = sum(bool(r.get("same_as_plain")) for r in rs)
        rows.append(row)
    ratio_to(rows, {"method": "plain"}, "tokens_per_s", ("temperature", "category"), "speedup")
    return rows


def _share(r: dict) -> str:
    grammar, masks = (None if r[k] is None else 100 * r[k] for k in ("grammar_share", "mask_share"))
    return f"{fmt(grammar, '.1f')}% ({fmt(masks, '.1f')}%)"


COLUMNS = [("T", "temperature", "g"), "category", "method", "tokens", ("tok/s", "tokens_per_s", ".2f")]
COLUMNS += [("vs plain", "speedup", ".2f"), ("tau", "tau", ".2f"), ("alpha", "alpha", ".2f")]
COLUMNS += [("jump tokens proposed / accepted", ("jump_proposed", "jump_accepted"))]
COLUMNS += [("masks / token", "masks_per_token", ".2f"), ("us / mask", "us_per_mask", ".1f")]
COLUMNS += [("grammar ms / token", "grammar_ms_per_token", ".2f"), ("grammar share (masks alone)", _share)]
COLUMNS += [("valid / stopped", ("valid", "stopped")), "length", ("same text as plain", ("same_as_plain", "outputs"))]


def to_markdown(result: dict) -> str:
    cfg, comp = result["config"], result["schema_compile_s"]
    compile_ms = f"{1e3 * sum(comp) / len(comp):.1f} ms mean, {1e3 * max(comp):.1f} ms max" if comp else "-"
    lines = report_head(
        result,
        f"target: {result['target']}; draft: {result['draft']}; runner {result['runner']}; torch {result['torch']}, "
        f"{result['threads']} threads",
        f"{result['prompts']} prompts x {cfg['repeats']} repeat(s), max_new_tokens {cfg['max_new_tokens']}, chat "
        f"template {'on' if cfg['chat'] else 'off'}, random={cfg['random']}; validator: "
        f"{result['validator'] or 'none installed (JSON parse only)'}; schema compile (xgrammar) {compile_ms}",
        "methods: " + "; ".join(f"{m} = {s}" for m, s in result["specs"].items()),
    )
    order = lambda r: (r["temperature"], r["category"] == "all", r["category"], cfg["methods"].index(r["method"]))  # noqa: E731
    lines += table(sorted(result["summary"], key=order), COLUMNS)
    bad = [r for r in result["records"] if r["valid"] is False]
    if bad:
        lines += ["", "Invalid outputs:"]
        lines += [f"- {r['method']} prompt {r['prompt']} ({r['category']}): {r['invalid_reason']}" for r in bad]
    return "\n".join(lines)


def plot(result: dict, path) -> None:
    temp = result["config"]["temperatures"][0]
    rows = [r for r in result["summary"] if r["temperature"] == temp]
    title, ylabel = f"JSON-schema extraction, T={temp:g}", "tokens/s over plain constrained decoding"
    bars(path, rows, None, "category", "method", "speedup", title=title, ylabel=ylabel)
