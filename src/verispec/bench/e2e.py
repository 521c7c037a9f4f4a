"""`verispec bench e2e`: end-to-end decoding speed, every method (`verispec:SPEC`, NAMED, other engines' FOREIGN)
side by side in one run; what it measures: docs/benchmarks.md, "What each benchmark measures"."""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch

from ..certify.methods import hf_assistant_kwargs
from ..crossvocab import same_tokenizer
from ..engine.adaptive import check_gamma, measure_cost_curve
from ..engine.config import SpecConfig, SpecError, format_value, parse_items
from ..engine.generator import SpeculativeGenerator, draft_runners
from ..engine.stats import SpecStats
from ..heads import LoadedHead
from ..model.fast import fast_path_unsupported
from ..model.llamacpp import llamacpp_available
from ..model.loading import LoadedModel
from ..sampling import SamplingParams
from ..sampling.theory import expected_tokens_per_pass
from .harness import SelfDraftBenchConfig, bars, fmt, jsonl, ratio_to, report_head, side_by_side, started, table

__all__ = ["E2EConfig", "build_methods", "calibrate", "load_prompts", "method_config", "plot"]
__all__ += ["best_fixed", "decisions", "oracle", "oracle_variants", "run_e2e", "to_markdown"]

NAMED = {"verispec-plain": "none", "verispec-draft": "model", "verispec-ngram": "ngram", "verispec-self": "self"}
FOREIGN = ("hf-plain", "hf-assisted", "llamacpp-plain", "llamacpp-lookup")  # other engines' methods: batch 1 only
STANDARD = (*NAMED, *FOREIGN[:2])
RUNS = ("none", "ngram", "model", "self", "ngram+model", "ngram+self")  # the drafters bench e2e runs
KNOWN = f"{', '.join(NAMED)}, verispec:SPEC (e.g. verispec:draft=model,gamma=4), {', '.join(FOREIGN)}"
ORACLE = (1, 2, 4, 8)  # the fixed gammas `--oracle` runs beside each gamma-auto method unless it names others


@dataclass(frozen=True)
class E2EConfig(SelfDraftBenchConfig):
    max_new_tokens: int = 64
    temperatures: tuple[float, ...] = (0.0, 1.0)
    num_prompts: int = 2  # per category at batch 1
    batch: tuple[int, ...] = (4,)  # batched verispec runs, each on the first `batch` prompts of each category
    # fixed by default (generators default to "auto"): a seed then gives the same tokens run after run
    gamma: int | str = 4  # of every verispec method that does not name its own
    methods: tuple[str, ...] = STANDARD
    spec: str = ""  # keys every verispec method takes unless it names them, e.g. "random=gumbel,max_gamma=16"
    oracle: tuple[int, ...] = ()  # fixed gammas each gamma-auto chain method also runs at (`oracle_variants`)

    def __post_init__(self):
        for g in self.oracle:
            if check_gamma(g, "each oracle gamma") < 1:
                raise ValueError("each oracle gamma must be >= 1 (plain decoding is always the oracle's first choice)")
        if fixed := [k for k in parse_items(self.spec) if k in ("draft", "model", "quant", "tree", "gamma", "runner")]:
            why = "a method names its drafter (draft, tree), the run's gamma, runner and quantizations are fields"
            raise ValueError(f"{', '.join(fixed)}: not keys of the run's spec: {why} of their own")
        for m in self.methods:
            method_config(m, self)


def load_prompts(paths: list[str]) -> dict[str, list[str]]:
    """JSONL files with {"prompt": ..., "category": ...} per line -> category -> prompts (file order)."""
    out: dict[str, list[str]] = defaultdict(list)
    for path in paths:
        for rec in jsonl(Path(path).read_text(), path, ("prompt",)):
            out[rec.get("category") or Path(path).stem].append(rec["prompt"])
    if not out:
        raise ValueError("no prompts found")
    return dict(out)


def theory_speedup(alpha: float, steps_by_drafted: dict[int, int], draft_cost: float, curve: list[float]) -> float:
    """Expected speedup over plain decoding for the run's own mix of draft lengths: each step with g drafts
    yields tau(alpha, g) tokens for g draft steps plus one target pass over g + 1 tokens (cost T(g + 1))."""
    a = min(alpha, 0.9999)
    tokens = sum(n * expected_tokens_per_pass(a, g) for g, n in steps_by_drafted.items())
    cost = sum(n * (g * draft_cost + curve[min(g, len(curve) - 1)]) for g, n in steps_by_drafted.items())
    return tokens * curve[0] / cost


def _llamacpp_generate(path: Path, prompts_ids, temperature: float, max_new: int, seed: int, lookup: bool) -> dict:
    """llama-cpp-python's own decoding over the prompts one at a time: exactly max_new tokens each (`generate` does
    not stop at EOS), neutral sampling knobs, its prompt cache reset before each prompt (prompt lookup: lookup)."""
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    threads = torch.get_num_threads()
    opts = dict(n_ctx=max(map(len, prompts_ids)) + max_new + 16, n_threads=threads, n_threads_batch=threads, seed=seed)
    lookup = LlamaPromptLookupDecoding() if lookup else None
    llm = Llama(model_path=str(path), draft_model=lookup, verbose=False, **opts)
    seconds = prefill = 0.0
    for i, ids in enumerate(prompts_ids):
        llm.reset()
        llm.set_seed(seed + i)
        t0 = time.perf_counter()
        stream = llm.generate(ids, temp=temperature, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.0)
        for n, _ in enumerate(stream, 1):
            prefill += time.perf_counter() - t0 if n == 1 else 0.0
            if n == max_new:
                break
        seconds += time.perf_counter() - t0
    return dict(tokens=max_new * len(prompts_ids), seconds=seconds, prefill_s=prefill)


def _hf_generate(target: LoadedModel, draft, prompts_ids, temperature: float, max_new: int, seed: int):
    """(tokens, seconds, target forward calls) for HF generate over prompts one at a time; with a draft, its
    assisted generation (universal assisted generation when the draft's tokenizer differs)."""
    same = draft is None or same_tokenizer(target, draft)
    calls: list[int] = []
    hook = target.model.register_forward_pre_hook(lambda *_: calls.append(1))
    tokens, seconds = 0, 0.0
    try:
        for i, ids in enumerate(prompts_ids):
            torch.manual_seed(seed + i)
            pad = target.tokenizer.pad_token_id or target.tokenizer.eos_token_id
            kwargs = dict(max_new_tokens=max_new, min_new_tokens=max_new, do_sample=temperature > 0, pad_token_id=pad)
            if temperature > 0:
                kwargs.update(temperature=temperature, top_k=None, top_p=None)
            if draft is not None:
                kwargs |= hf_assistant_kwargs(target, draft, sample=temperature > 0, same=same)
            x = torch.tensor([ids], device=target.device)
            t0 = time.perf_counter()
            with torch.inference_mode():
                out = target.model.generate(x, attention_mask=torch.ones_like(x), **kwargs)
            seconds += time.perf_counter() - t0
            tokens += out.shape[1] - x.shape[1]
    finally:
        hook.remove()
    return tokens, seconds, len(calls)


def _runnable(methods: list[str], target: LoadedModel, log) -> list[str]:
    """The methods this target can run: HF's need a torch model, llama.cpp's a GGUF file and llama-cpp-python."""
    keep = []
    for m in methods:
        if m.startswith("hf-") and not isinstance(target.model, torch.nn.Module):
            log(f"{m} skipped: the target runs on llama.cpp (HF generate needs a torch model)")
        elif m.startswith("llamacpp-") and (getattr(target, "gguf", None) is None or not llamacpp_available()):
            log(f"{m} skipped: it needs a .gguf target and llama-cpp-python (pip install -e '.[llamacpp]')")
        else:
            keep.append(m)
    return keep


def method_config(name: str, cfg: E2EConfig) -> SpecConfig | None:
    """The SpecConfig of a verispec method (None for another engine's): its own keys over the run's (cfg.spec, gamma,
    runner, its drafter's quantization); ValueError for a name run_e2e does not know."""
    if name in FOREIGN:
        return None
    if name not in NAMED and not name.startswith("verispec:"):
        raise ValueError(f"unknown method {name!r}; choose from {KNOWN}")
    try:
        items = {"draft": NAMED[name]} if name in NAMED else parse_items(name.removeprefix("verispec:"))
    except SpecError as e:
        raise ValueError(f"method {name!r}: {e}") from None
    draft = items.get("draft", SpecConfig.draft)
    if draft not in RUNS:
        raise ValueError(
            f"method {name!r}: bench e2e runs draft=none, ngram, model (the --draft model, or its own model=PATH), "
            "self, ngram+model or ngram+self"
        )
    # random=stream unless named: every request is seeded, and auto (SpecConfig's default) would couple them all
    base = {"random": "stream"} | parse_items(cfg.spec) | {"runner": cfg.runner} | cfg.quant_keys(draft)
    base |= {"gamma": cfg.gamma} if draft != "none" else {}
    try:
        return SpecConfig(**(base | items))
    except SpecError as e:
        under = f" under the run's spec {cfg.spec!r}" if e.key not in items and cfg.spec else ""
        raise ValueError(f"method {name!r}{under}: {e}") from None


def oracle_variants(methods, cfg: E2EConfig) -> dict[str, dict[int, str]]:
    """Per verispec method that drafts chains with gamma auto (its own gamma= or the run's): {G: the same method at
    fixed gamma G, a verispec:SPEC name} for each G of cfg.oracle; {} without cfg.oracle. (A tree's shape, not
    gamma, sets its drafts: tree methods have none.)"""
    out = {}
    for m in methods if cfg.oracle else ():
        c = method_config(m, cfg)
        if c is None or c.draft == "none" or c.gamma != "auto" or c.tree is not None:
            continue
        out[m] = {g: _at_gamma(m, g) for g in sorted(set(cfg.oracle))}
    return out


def _at_gamma(method: str, gamma: int) -> str:
    """A verispec method at a fixed gamma, as verispec:SPEC: verispec-ngram at 2 is verispec:draft=ngram,gamma=2."""
    items = {"draft": NAMED[method]} if method in NAMED else parse_items(method.removeprefix("verispec:"))
    return "verispec:" + ",".join(f"{k}={format_value(v)}" for k, v in (items | {"gamma": gamma}).items())


def _with_variants(cfg: E2EConfig) -> list[str]:
    """cfg.methods, each gamma-auto method followed by its oracle variants, and verispec-plain (the oracle's first
    choice) first where there are variants and it is not listed."""
    variants = oracle_variants(cfg.methods, cfg)
    plain = ["verispec-plain"] if variants and "verispec-plain" not in cfg.methods else []
    return list(dict.fromkeys(plain + [n for m in cfg.methods for n in (m, *variants.get(m, {}).values())]))


def _needs_draft(method: str, config: SpecConfig | None) -> bool:
    """Whether a method drafts with the run's --draft model (a method naming its own model= does not)."""
    return method == "hf-assisted" or (config is not None and config.drafter.model and config.model is None)


def method_models(methods, cfg: E2EConfig) -> list[str]:
    """The draft models methods name themselves (`verispec:draft=model,model=PATH`), each once, to load beside --draft."""
    configs = [method_config(m, cfg) for m in methods]
    return list(dict.fromkeys(c.model for c in configs if c is not None and c.drafter.model and c.model))


def _generator(target: LoadedModel, draft, config: SpecConfig, drafts=None) -> SpeculativeGenerator:
    """A method's generator; its draft model: its own model= (loaded into `drafts`, path -> model) or the run's."""
    if config.model and config.model not in (drafts or {}):
        raise ValueError(f"a method names model={config.model}, which was not loaded (pass it in drafts)")
    model = drafts[config.model] if config.model else draft
    return SpeculativeGenerator(target, model if config.drafter.model else None, config=config)


def build_methods(target: LoadedModel, draft, cfg: E2EConfig, log, drafts=None):
    """The methods this run can run (cfg.methods' order with their oracle variants, less those without their model
    or engine) and a generator for each verispec one, plus "verispec-plain" always (the baseline: calibration and
    prompt encoding)."""
    names = _with_variants(cfg)
    configs = {m: method_config(m, cfg) for m in names}  # every name checked; None: another engine's
    methods = _runnable([m for m in names if draft is not None or not _needs_draft(m, configs[m])], target, log)
    if isinstance(draft, LoadedHead) and "hf-assisted" in methods:
        methods.remove("hf-assisted")
        log(f"hf-assisted skipped: the draft is a hidden-state head ({draft.kind}), not a model HF generate runs")
    for m in [m for m in methods if configs[m] is not None and configs[m].drafter.target_weights]:
        why = "and runner='hf' was asked for" if configs[m].runner == "hf" else fast_path_unsupported(target.model)
        if why:
            methods.remove(m)
            log(f"{m} skipped: a quantized self-draft needs the fast runner, " + why)
    gens = {"verispec-plain": _generator(target, draft, method_config("verispec-plain", cfg))}
    ours = [m for m in methods if configs[m] is not None and m != "verispec-plain"]
    for m in sorted(ours, key=lambda m: configs[m].drafter.target_weights):  # self-drafts last: they quantize
        if configs[m].drafter.target_weights:
            log(f"quantizing the target's weights ({configs[m].quant}) for the self-draft ...")
        gens[m] = _generator(target, draft, configs[m], drafts)
    return methods, gens


def calibrate(gens: dict[str, SpeculativeGenerator], cfg: E2EConfig, log) -> tuple[dict, dict]:
    """({B: the target's T_B(1..n) up to the widest verification}, {draft-model chain method: {B: its draft step}})
    at every batch size B; generators with gamma auto start from them."""
    cores = {m: g.core for m, g in gens.items()}
    plain, widest = cores["verispec-plain"], cfg.gamma if isinstance(cfg.gamma, int) else 8
    for c in cores.values():  # the widest verification of any method
        widest = max(widest, c.tree.max_nodes if c.tree else c.controller.max_gamma if c.proposer else 0)
    batches = sorted({1, *cfg.batch})
    log(f"calibrating the cost curves at batch {', '.join(map(str, batches))} ...")
    curves = {b: measure_cost_curve(plain.runner, plain.vocab_size, min(widest, 64) + 1, b) for b in batches}
    models = {  # draft-model (or self-draft) chains: their draft step is calibrated (source, runner)
        m: draft_runners(c.proposer)[0]
        for m, c in cores.items()
        if gens[m].config.drafter.uses_model and c.tree is None
    }
    draft_steps = {
        m: {b: measure_cost_curve(r, plain.vocab_size, 1, b)[0] for b in batches} for m, (_, r) in models.items()
    }
    for m, c in cores.items():  # gamma auto starts from the measured costs at every batch size
        if c.proposer is not None and c.controller.fixed is None:
            for b in batches:
                c.controller.seed_costs(b, curves[b], None)
                if m in models:
                    c.controller.seed_costs(b, [], draft_steps[m][b], models[m][0])
    for b in batches:
        steps = ", ".join(f"{m} {t[b]:.3f}s" for m, t in draft_steps.items())
        log(f"batch {b}: T(n) target seconds: " + ", ".join(f"{t:.3f}" for t in curves[b]) + "; draft step " + steps)
    return curves, draft_steps


def _chunks(gen, prompts, params, batch: int, max_new: int) -> SpecStats:
    """The prompts generated in chunks of `batch` rows (EOS ignored): their stats, pooled."""
    stats = SpecStats()
    for start in range(0, len(prompts), batch):
        rows = slice(start, start + batch)
        gen.generate(prompts[rows], params[rows], max_new_tokens=max_new, ignore_eos=True)
        stats.merge(gen.last_stats)
    return stats


def _measure_verispec(gen, method: str, chosen, batch: int, temp: float, cfg: E2EConfig, costs) -> dict:
    """A verispec method's figures over the prompts in chunks of `batch` (the prefill's: a one-token run); costs:
    (the measured draft step or None, the target's cost curve) at this batch size, for the theory of chains."""
    params = [SamplingParams(temperature=temp, seed=cfg.seed + i) for i in range(len(chosen))]
    controller = gen.core.controller
    before = dict(getattr(controller, "counters", {}))  # cumulative: this cell's are the difference
    st = _chunks(gen, chosen, params, batch, cfg.max_new_tokens)
    after = dict(getattr(controller, "counters", {}))  # (a copy: the prefill's run below counts on)
    tree = gen.core.tree is not None
    prefill = _chunks(gen, chosen, [SamplingParams(seed=i) for i in range(len(chosen))], batch, 1).wall_time
    out = dict(prefill_s=prefill, tokens=st.output_tokens, seconds=st.wall_time, tau=st.tau)
    out["alpha"] = None if tree else st.acceptance_rate  # a tree's alpha is not one number: see per_position
    out |= dict(per_position=st.per_position_acceptance, drafted=st.drafted, steps=st.target_passes)
    out |= dict(draft_s=st.draft_time, verify_s=st.verify_time, nodes=st.nodes)
    out["drafted_per_step"] = st.nodes / max(st.target_passes, 1)
    out |= decisions(st, before, after) if gen.core.proposer is not None else {}
    if method != "verispec-plain" and st.drafted and not tree:
        measured, curve = costs
        draft_step = measured if measured is not None else st.draft_time / max(st.drafted, 1)
        out["theory_speedup"] = theory_speedup(st.acceptance_rate, st.steps_by_drafted, draft_step, curve)
    return out


def decisions(st: SpecStats, before: dict, after: dict) -> dict:
    """What a drafting method's steps did (pooled over rows): the share of steps that drafted, the mean drafts per
    drafting step, and from its gamma controller's cumulative `counters` before and after (where it has them) its
    probes and their seconds, and every counter's difference (`controller`)."""
    steps = sum(st.steps_by_drafted.values())
    drafting = steps - st.steps_by_drafted.get(0, 0)
    out = dict(
        drafting_share=drafting / steps if steps else None, mean_gamma=st.drafted / drafting if drafting else None
    )
    diff = {k: v - before.get(k, 0.0) for k, v in after.items()}
    out |= dict(probes=diff.get("probes"), probe_cost_s=diff.get("probe_cost_s"))
    return out | ({"controller": diff} if diff else {})


def measure(target, draft, gens, methods, prompts, cfg: E2EConfig, curves, draft_steps, log) -> list[dict]:
    """One record per temperature, category, batch size and method (batch 1: the first num_prompts prompts of a
    category; batch B: its first B, verispec methods only, skipped where a category has fewer)."""
    encode = gens["verispec-plain"].encode
    ids = {cat: [encode(t, chat=cfg.chat) for t in texts] for cat, texts in prompts.items()}
    cases = [
        {"temperature": t, "category": cat, "batch": b, "prompts": len(ids[cat][: cfg.num_prompts if b == 1 else b])}
        for t in cfg.temperatures
        for cat in prompts
        for b in sorted({1, *cfg.batch})
        if b == 1 or len(ids[cat]) >= b
    ]

    def one(method: str, case: dict) -> dict | None:
        temp, batch, chosen = case["temperature"], case["batch"], ids[case["category"]][: case["prompts"]]
        if batch > 1 and method in FOREIGN:
            return None
        if method.startswith("hf-"):
            assistant = draft if method == "hf-assisted" else None
            tok, sec, calls = _hf_generate(target, assistant, chosen, temp, cfg.max_new_tokens, cfg.seed)
            return _rates(dict(tokens=tok, seconds=sec, tau=tok / calls if calls else None), len(chosen))
        if method.startswith("llamacpp-"):
            args = (target.gguf, chosen, temp, cfg.max_new_tokens, cfg.seed, method == "llamacpp-lookup")
            return _rates(_llamacpp_generate(*args), len(chosen))
        costs = draft_steps.get(method, {}).get(batch), curves[batch]
        return _rates(_measure_verispec(gens[method], method, chosen, batch, temp, cfg, costs), len(chosen))

    return side_by_side(cases, methods, one, log)


def _rates(rec: dict, prompts: int) -> dict:
    """tokens/s, and after the prefill where it was measured (the prefill's forward gives each row its first token)."""
    rec["tokens_per_s"] = rec["tokens"] / rec["seconds"] if rec["seconds"] else None
    if rec.get("prefill_s") is not None and rec["seconds"] > rec["prefill_s"]:
        rec["decode_tokens_per_s"] = (rec["tokens"] - prompts) / (rec["seconds"] - rec["prefill_s"])
    return rec


def compare(records: list[dict]) -> None:
    """Each record's speedups over verispec-plain at the same temperature, category and batch (with the prefill and
    after it), measured over theory, and its ratios to HF assisted and llama.cpp plain at batch 1."""
    same, plain = ("temperature", "category", "batch"), {"method": "verispec-plain"}
    ratio_to(records, plain, "tokens_per_s", same, "speedup")
    ratio_to(records, plain, "decode_tokens_per_s", same, "decode_speedup")
    for r in records:  # the theory prices decoding steps, not the prefill
        if r.get("theory_speedup") and r["decode_speedup"]:
            r["measured_over_theory"] = r["decode_speedup"] / r["theory_speedup"]
    ratio_to(records, {"method": "hf-assisted", "batch": 1}, "tokens_per_s", same[:2], "vs_hf_assisted")
    for value, out in (("tokens_per_s", "vs_llamacpp_plain"), ("decode_tokens_per_s", "vs_llamacpp_plain_decode")):
        ratio_to(records, {"method": "llamacpp-plain", "batch": 1}, value, same[:2], out)


def _mark_variants(records: list[dict], variants: dict[str, dict[int, str]]) -> None:
    """Each oracle variant's record gains `oracle_of` (the gamma-auto methods it is a fixed choice of) and `gamma`."""
    for auto, names in variants.items():
        for g, name in names.items():
            for r in (r for r in records if r["method"] == name):
                r.setdefault("oracle_of", []).append(auto)
                r["gamma"] = g


def best_fixed(choices) -> tuple[int, float] | None:
    """The fastest of (gamma, tokens/s) choices (gamma 0: plain decoding), the first of equals; None where no
    choice was measured (tokens/s None)."""
    best = None
    for g, rate in choices:
        if rate is not None and (best is None or rate > best[1]):
            best = (g, rate)
    return best


def oracle(records: list[dict]) -> None:
    """Each gamma-auto method's record (one that records' `oracle_of` name) gains its cell's plain tokens/s
    (`plain_tokens_per_s`), the best fixed choice among plain decoding and its variants there (`oracle`: "plain" or
    "gamma=G"; `oracle_gamma`: 0 or G; `oracle_tokens_per_s`) and its tokens/s over the oracle's (`vs_oracle`; over
    plain's: `speedup`). Ties go to plain, then to the smaller gamma."""
    cell = lambda r: (r["temperature"], r["category"], r["batch"])  # noqa: E731
    plain = {cell(r): r.get("tokens_per_s") for r in records if r["method"] == "verispec-plain"}
    fixed: dict[tuple, list] = defaultdict(list)  # (cell, auto method) -> [(gamma, tokens/s)]
    for r in records:
        for auto in r.get("oracle_of") or ():
            fixed[cell(r), auto].append((r["gamma"], r.get("tokens_per_s")))
    autos = {auto for _, auto in fixed}
    for r in (r for r in records if r["method"] in autos):
        choices = [(0, plain.get(cell(r))), *sorted(fixed[cell(r), r["method"]], key=lambda c: c[0])]
        g, rate = best_fixed(choices) or (None, None)
        r |= dict(plain_tokens_per_s=plain.get(cell(r)), oracle_gamma=g, oracle_tokens_per_s=rate)
        r["oracle"] = None if g is None else "plain" if g == 0 else f"gamma={g}"
        r["vs_oracle"] = r["tokens_per_s"] / rate if rate and r.get("tokens_per_s") is not None else None


def run_e2e(target: LoadedModel, draft, prompts: dict[str, list[str]], cfg: E2EConfig, log=print, drafts=None) -> dict:
    """Every method of cfg at every temperature, category and batch size; drafts: the models methods name with
    model=PATH (path -> LoadedModel, `method_models`)."""
    result = started()  # the code, date and command at the start of the run
    methods, gens = build_methods(target, draft, cfg, log, drafts)
    curves, draft_steps = calibrate(gens, cfg, log)
    records = measure(target, draft, gens, methods, prompts, cfg, curves, draft_steps, log)
    compare(records)
    _mark_variants(records, oracle_variants(cfg.methods, cfg))
    oracle(records)
    config = cfg.__dict__ | {"temperatures": list(cfg.temperatures), "methods": list(cfg.methods)}
    config["oracle"] = list(cfg.oracle)
    result |= dict(config=config, target=target.name, draft=draft.name if draft else None)
    result["method_drafts"] = {path: m.name for path, m in (drafts or {}).items()}
    result |= {"cost_curve_s": curves[1], "cost_curves_s": {str(b): c for b, c in curves.items()}}  # B -> T(1..n)
    result["draft_step_s"] = draft_steps.get("verispec-draft", {}).get(1, 0.0)
    result["draft_steps_s"] = {m: {str(b): t for b, t in d.items()} for m, d in draft_steps.items()}
    return result | {"runner": type(gens["verispec-plain"].core.runner).__name__, "records": records}


COLUMNS = [("T", "temperature", "g"), "category", "batch", "method", ("tok/s", "tokens_per_s", ".2f")]
COLUMNS += [("tok/s after prefill", "decode_tokens_per_s", ".2f"), ("speedup", "speedup", ".2f")]
COLUMNS += [("speedup after prefill", "decode_speedup", ".2f"), ("vs HF assisted", "vs_hf_assisted", ".2f")]
COLUMNS += [("vs llama.cpp plain (incl. / after prefill)", ("vs_llamacpp_plain", "vs_llamacpp_plain_decode"), ".2f")]
COLUMNS += [("tau", "tau", ".2f"), ("drafted / step", "drafted_per_step", ".1f"), ("alpha", "alpha", ".2f")]
COLUMNS += [("per-position (trees: per-depth) acceptance", "per_position", ".2f")]
COLUMNS += [("theory speedup", "theory_speedup", ".2f"), ("measured / theory", "measured_over_theory", ".2f")]


ORACLE_COLUMNS = [("T", "temperature", "g"), "category", "batch", ("gamma auto method", "method")]
ORACLE_COLUMNS += [("plain tok/s", "plain_tokens_per_s", ".2f"), ("best fixed", "oracle")]
ORACLE_COLUMNS += [("best fixed tok/s", "oracle_tokens_per_s", ".2f"), ("auto tok/s", "tokens_per_s", ".2f")]
ORACLE_COLUMNS += [("auto / plain", "speedup", ".2f"), ("auto / best fixed", "vs_oracle", ".2f")]
ORACLE_COLUMNS += [("steps drafting", "drafting_share", ".2f"), ("drafts / drafting step", "mean_gamma", ".1f")]
ORACLE_COLUMNS += [("probes", "probes", ".0f"), ("probe s", "probe_cost_s", ".3f")]


def _oracle_lines(result: dict) -> list[str]:
    """The gamma-auto methods against plain decoding and their oracle, one row per cell ([] without --oracle)."""
    recs = [r for r in result["records"] if "oracle" in r]
    if not recs:
        return []
    gammas = ", ".join(map(str, result["config"].get("oracle") or ORACLE))
    count = lambda field, goal: sum(r.get(field) is not None and r[field] >= goal for r in recs)  # noqa: E731
    low = lambda field: fmt(min((r[field] for r in recs if r.get(field) is not None), default=None))  # noqa: E731
    return [
        f"gamma auto against plain decoding and the best fixed choice of the same cell (the oracle: plain or gamma "
        f"{gammas}, run beside it), tokens/s including the prefill. auto >= 0.97x plain in {count('speedup', 0.97)} "
        f"of {len(recs)} cells (lowest {low('speedup')}); >= 0.9x the oracle in {count('vs_oracle', 0.9)} of "
        f"{len(recs)} (lowest {low('vs_oracle')}):",
        "",
        *table(recs, ORACLE_COLUMNS),
        "",
    ]


def _curve_lines(result: dict) -> list[str]:
    drafts, lines = result.get("draft_steps_s", {}), []
    for b, c in (result.get("cost_curves_s") or {"1": result["cost_curve_s"]}).items():
        steps = ", ".join(f"{m} {d[b]:.3f}" for m, d in drafts.items() if b in d) or "-"
        curve = ", ".join(f"{t:.3f}" for t in c)
        lines.append(
            f"- batch {b}: T(1..{len(c)}) = {curve}; T(n)/T(1) at n = {len(c)}: {c[-1] / c[0]:.2f}; draft step {steps}"
        )
    return lines


def to_markdown(result: dict) -> str:
    cfg = result["config"]
    head = report_head(
        result,
        f"target: {result['target']}; draft: {result['draft']}; torch {result['torch']}, {result['threads']} threads; "
        f"max_new_tokens {cfg['max_new_tokens']}; gamma {cfg['gamma']}",
        f"verispec runner: {result.get('runner', 'HFRunner')}; cost curves T_B(n), seconds of one target forward "
        "over n new tokens per row at batch B, and the draft step at B (theory at batch B prices steps with these):",
        "",
        *_curve_lines(result),
    )
    return "\n".join(head + _oracle_lines(result) + table(result["records"], COLUMNS))


def plot(result: dict, path) -> None:
    recs = [r for r in result["records"] if r["batch"] == 1]
    title, ylabel = (lambda t: f"temperature {t:g}, batch 1"), "speedup over verispec-plain (tokens/s)"
    bars(path, recs, "temperature", "category", "method", "speedup", title=title, ylabel=ylabel)
