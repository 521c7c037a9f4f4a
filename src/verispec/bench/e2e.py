"""`verispec bench e2e`: end-to-end decoding speed, every method side by side in one process and one run.

Methods (same target, prompts, max_new_tokens, temperature and seeds) — every verispec method is a `SpecConfig`,
named `verispec:SPEC` (its string form, e.g. verispec:draft=model,gamma=4,verify=block; keys it leaves out come from
the run: `E2EConfig.spec`, gamma, runner, and draft_quant / self_quant for a draft model / the self-draft), or by one
of the names below, kept as aliases of specs (`alias_spec`):
    verispec-plain    plain decoding through verispec's loop (the baseline speedups are relative to)
    verispec-draft    verispec with the draft model
    verispec-ngram    verispec with prompt lookup
    verispec-self     verispec with the target's own weights, int4-quantized, as the draft (`self_quant`)
    hf-plain          HF transformers generate()
    hf-assisted       HF transformers generate(assistant_model=draft); a draft with another tokenizer: universal
                      assisted generation (also tokenizer= and assistant_tokenizer=)
    llamacpp-plain    llama.cpp (llama-cpp-python's `Llama.generate`) on the target's GGUF file
    llamacpp-lookup   the same with llama-cpp-python's prompt-lookup speculation (`LlamaPromptLookupDecoding`)
  and, named with an argument:
    verispec-draft@G              the draft model with a fixed draft length G (chains of several lengths side by side)
    verispec-draft[@G]/MODE       the same chains with MODE = block (block verification), position (seeding by
                                  position: gamma-invariant seeded output) or gumbel (Gumbel coupling), side by side
    verispec-tree@SHAPE[/RULE]    draft-model trees: SHAPE = widths per depth (4-2-2-1) or dynamic-D-K-M, RULE =
                                  deterministic (default), iid or without_replacement
    verispec-ngram-tree@SHAPE     prompt-lookup tries (SHAPE's first width = branches, its depth = length)
at each temperature, at batch 1 (all methods) and at each batch size of `batch` (verispec methods). Every run
generates exactly max_new_tokens per prompt (EOS ignored by verispec, suppressed by min_new_tokens in HF) so token
counts match. Per prompt category it reports tokens/s, speedup over verispec-plain at the same temperature and
batch (with the prefill, and after it: the decoding steps alone), tau (tokens per target pass; HF's counted with a
forward hook), alpha, per-position acceptance, and the theoretical speedup from the measured alpha and the cost
curves measured at the start of the run at that batch size (the draft step and the target's T_B(n) over n tokens
per row at batch B). Measured / theory compares the speedup after prefill with it (the theory prices steps only).
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch

from ..engine.adaptive import measure_cost_curve
from ..engine.config import SpecConfig, SpecError, parse_items
from ..engine.generator import SpeculativeGenerator
from ..heads import LoadedHead
from ..model.fast import fast_path_unsupported
from ..model.loading import LoadedModel
from ..sampling import SamplingParams
from ..sampling.theory import expected_tokens_per_pass
from ._provenance import provenance, provenance_lines

__all__ = [
    "E2EConfig",
    "alias_spec",
    "build_methods",
    "calibrate",
    "check_method",
    "compare",
    "load_prompts",
    "measure",
    "method_config",
    "plot",
    "run_e2e",
    "to_markdown",
]


@dataclass(frozen=True)
class E2EConfig:
    max_new_tokens: int = 64
    temperatures: tuple[float, ...] = (0.0, 1.0)
    num_prompts: int = 2  # per category at batch 1
    batch: tuple[int, ...] = (4,)  # batched verispec runs, each on the first `batch` prompts of each category
    # a benchmark fixes the draft length by default (generators default to "auto"): with a fixed gamma a seed gives
    # the same tokens run after run, so methods and runs compare on one workload; "auto" follows timings
    gamma: int | str = 4  # of every verispec method that does not name its own
    seed: int = 0
    chat: bool = True
    runner: str = "auto"  # verispec's model forward (see verispec.model.fast.make_runner)
    draft_quant: str | None = None  # weight-only quantization of the draft model (verispec-draft)
    self_quant: str = "int4"  # quantization of the self-draft (verispec-self)
    methods: tuple[str, ...] = (
        "verispec-plain",
        "verispec-draft",
        "verispec-ngram",
        "verispec-self",
        "hf-plain",
        "hf-assisted",
    )
    spec: str = ""  # keys every verispec method takes unless it names them, e.g. "random=gumbel,max_gamma=16"

    def __post_init__(self):
        fixed = [k for k in parse_items(self.spec) if k in SET_ELSEWHERE]
        if fixed:
            raise ValueError(
                f"{', '.join(fixed)}: not keys of the run's spec: a method names its drafter (draft, tree), the run's "
                "gamma, runner, draft_quant and self_quant are fields of their own"
            )
        for m in self.methods:
            method_config(m, self)


SET_ELSEWHERE = ("draft", "model", "quant", "tree", "gamma", "runner")  # keys E2EConfig.spec does not take


def load_prompts(paths: list[str]) -> dict[str, list[str]]:
    """JSONL files with {"prompt": ..., "category": ...} per line -> category -> prompts (file order)."""
    out: dict[str, list[str]] = defaultdict(list)
    for path in paths:
        with open(path) as fh:
            for n, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                    out[rec.get("category") or Path(path).stem].append(rec["prompt"])
                except (json.JSONDecodeError, KeyError, TypeError):
                    raise ValueError(f"{path}:{n}: expected a JSON object with a 'prompt' field") from None
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


class _CallCounter:
    def __init__(self, module):
        self.calls = 0
        self.handle = module.register_forward_pre_hook(self._hook)

    def _hook(self, *_):
        self.calls += 1

    def close(self):
        self.handle.remove()


def _gguf_path(target: LoadedModel) -> Path | None:
    return getattr(target, "gguf", None)


def _llamacpp_generate(
    path: Path, prompts_ids: list[list[int]], temperature: float, max_new: int, seed: int, lookup: bool
) -> tuple[int, float, float]:
    """(tokens, seconds, prefill seconds) for llama-cpp-python's own decoding over prompts one at a time: exactly
    max_new tokens each (`Llama.generate` does not stop at EOS), neutral sampling knobs (top-k off, top-p 1, min-p
    0, no repeat penalty), its prompt cache reset before each prompt."""
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    llm = Llama(
        model_path=str(path),
        n_ctx=max(len(i) for i in prompts_ids) + max_new + 16,
        n_threads=torch.get_num_threads(),
        n_threads_batch=torch.get_num_threads(),
        draft_model=LlamaPromptLookupDecoding() if lookup else None,
        seed=seed,
        verbose=False,
    )
    tokens, seconds, prefill = 0, 0.0, 0.0
    for i, ids in enumerate(prompts_ids):
        llm.reset()
        llm.set_seed(seed + i)
        t0 = time.perf_counter()
        stream = llm.generate(ids, temp=temperature, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.0)
        for n, _ in enumerate(stream, 1):
            if n == 1:
                prefill += time.perf_counter() - t0
            if n == max_new:
                break
        seconds += time.perf_counter() - t0
        tokens += max_new
    return tokens, seconds, prefill


def _hf_generate(
    target: LoadedModel,
    draft: LoadedModel | None,
    prompts_ids: list[list[int]],
    temperature: float,
    max_new: int,
    seed: int,
) -> tuple[int, float, int]:
    """(tokens, seconds, target forward calls) for HF generate over prompts one at a time; with a draft, its
    assisted generation (universal assisted generation when the draft's tokenizer differs)."""
    from ..certify.methods import hf_assistant_kwargs
    from ..crossvocab import same_tokenizer

    same = draft is None or same_tokenizer(target, draft)
    tokens = calls = 0
    seconds = 0.0
    counter = _CallCounter(target.model)
    try:
        for i, ids in enumerate(prompts_ids):
            torch.manual_seed(seed + i)
            kwargs = dict(
                max_new_tokens=max_new,
                min_new_tokens=max_new,
                do_sample=temperature > 0,
                pad_token_id=target.tokenizer.pad_token_id or target.tokenizer.eos_token_id,
            )
            if temperature > 0:
                kwargs.update(temperature=temperature, top_k=None, top_p=None)
            if draft is not None:  # different tokenizers: universal assisted generation (hf_assistant_kwargs)
                kwargs |= hf_assistant_kwargs(target, draft, sample=temperature > 0, same=same)
            x = torch.tensor([ids], device=target.device)
            t0 = time.perf_counter()
            with torch.inference_mode():
                out = target.model.generate(x, attention_mask=torch.ones_like(x), **kwargs)
            seconds += time.perf_counter() - t0
            tokens += out.shape[1] - x.shape[1]
        calls = counter.calls
    finally:
        counter.close()
    return tokens, seconds, calls


FOREIGN = ("hf-", "llamacpp-")  # other engines' methods: batch 1 only
FOREIGN_METHODS = ("hf-plain", "hf-assisted", "llamacpp-plain", "llamacpp-lookup")
MODES = {"block": {"verify": "block"}, "position": {"random": "position"}, "gumbel": {"random": "gumbel"}}
KNOWN = (
    f"{', '.join(E2EConfig.methods)}, verispec:SPEC (a SpecConfig string, e.g. verispec:draft=model,gamma=4), "
    f"verispec-draft[@G][/{'|'.join(MODES)}], verispec-tree@SHAPE[/RULE], verispec-ngram-tree@SHAPE, llamacpp-plain, "
    "llamacpp-lookup"
)


def alias_spec(name: str) -> dict | None:
    """The spec keys of an old verispec method name (None for any other name): verispec-plain = draft=none,
    verispec-ngram = draft=ngram, verispec-self = draft=self, verispec-draft[@G][/MODE] = draft=model[,gamma=G]
    [,verify=block | random=position | random=gumbel], verispec-tree@SHAPE[/RULE] = draft=model,tree=SHAPE,
    gamma=auto[,verify=RULE], verispec-ngram-tree@SHAPE = draft=ngram,tree=SHAPE,gamma=auto."""
    simple = {"verispec-plain": "none", "verispec-ngram": "ngram", "verispec-self": "self"}
    if name in simple:
        return {"draft": simple[name]}
    head, _, mode = name.rpartition("/")
    if name.startswith("verispec-draft") and mode in MODES:  # verispec-draft[@G]/MODE
        return _draft_alias(head, name) | MODES[mode]
    if name == "verispec-draft" or name.startswith("verispec-draft@"):
        return _draft_alias(name, name)
    base, _, arg = name.partition("@")
    if base in ("verispec-tree", "verispec-ngram-tree"):
        if not arg:
            raise ValueError(f"{base} needs a shape: {base}@4-2-2-1")
        shape, _, rule = arg.partition("/")
        items = {"draft": "model" if base == "verispec-tree" else "ngram", "tree": shape, "gamma": "auto"}
        return items | ({"verify": rule} if rule else {})
    return None


def _draft_alias(head: str, name: str) -> dict:
    base, at, g = head.partition("@")
    if base != "verispec-draft":
        raise ValueError(f"unknown method {name!r}; choose from {KNOWN}")
    if at and not g.isdigit():
        raise ValueError(f"verispec-draft@G needs an integer draft length, got {name!r}")
    return {"draft": "model"} | ({"gamma": int(g)} if at else {})


def method_config(name: str, cfg: E2EConfig) -> SpecConfig | None:
    """The SpecConfig of a verispec method (None for another engine's): its own keys (`verispec:SPEC`, or an old
    name's, `alias_spec`) over the run's — cfg.spec, then gamma and runner, and the quantization of its drafter
    (draft_quant for the draft model, self_quant for the self-draft). ValueError for a name run_e2e does not know."""
    if name in FOREIGN_METHODS:
        return None
    try:
        items = parse_items(name.removeprefix("verispec:")) if name.startswith("verispec:") else alias_spec(name)
    except SpecError as e:
        raise ValueError(f"method {name!r}: {e}") from None
    if items is None:
        raise ValueError(f"unknown method {name!r}; choose from {KNOWN}")
    draft = items.get("draft", SpecConfig.draft)
    if draft not in ("none", "ngram", "model", "self"):
        raise ValueError(
            f"method {name!r}: bench e2e runs draft=none, ngram, model (the --draft model, or its own model=PATH) or self"
        )
    # random=stream unless named: every request is seeded, and auto (SpecConfig's default) would couple them all
    base = {"random": "stream"} | parse_items(cfg.spec) | {"runner": cfg.runner}
    base |= {"gamma": cfg.gamma} if draft != "none" else {}
    base |= {"quant": cfg.draft_quant} if draft == "model" else {"quant": cfg.self_quant} if draft == "self" else {}
    try:
        return SpecConfig(**(base | items))
    except SpecError as e:
        under = f" under the run's spec {cfg.spec!r}" if e.key not in items and cfg.spec else ""
        raise ValueError(f"method {name!r}{under}: {e}") from None


def check_method(name: str, cfg: E2EConfig | None = None) -> None:
    """Raise ValueError for a method name run_e2e does not know (see the module docstring)."""
    method_config(name, cfg if cfg is not None else E2EConfig(methods=()))


def _needs_draft(method: str, config: SpecConfig | None) -> bool:
    """Whether a method drafts with the run's --draft model (a method naming its own model= does not)."""
    return method == "hf-assisted" or (config is not None and config.drafter.model and config.model is None)


def method_models(methods, cfg: E2EConfig) -> list[str]:
    """The draft models methods name themselves (`verispec:draft=model,model=PATH`), each once, to load beside --draft."""
    configs = [method_config(m, cfg) for m in methods]
    return list(dict.fromkeys(c.model for c in configs if c is not None and c.drafter.model and c.model))


def _generator(target: LoadedModel, draft: LoadedModel | None, config: SpecConfig, drafts=None) -> SpeculativeGenerator:
    """A method's generator; its draft model: its own model= (loaded into `drafts`, path -> model) or the run's."""
    if config.model and config.model not in (drafts or {}):
        raise ValueError(f"a method names model={config.model}, which was not loaded (pass it in drafts)")
    model = drafts[config.model] if config.model else draft
    return SpeculativeGenerator(target, model if config.drafter.model else None, config=config)


def _batches(cfg: E2EConfig) -> list[int]:
    return sorted({1, *cfg.batch})


def run_e2e(
    target: LoadedModel,
    draft: LoadedModel | None,
    prompts: dict[str, list[str]],
    cfg: E2EConfig,
    log=print,
    drafts: dict[str, LoadedModel] | None = None,
) -> dict:
    """Every method of cfg at every temperature, category and batch size (see the module docstring): build the
    generators, calibrate the cost curves, measure, compare with verispec-plain and the other engines. drafts: the
    models methods name with model=PATH (path -> LoadedModel, `method_models`)."""
    origin = provenance()  # the code, date and command at the start of the run
    methods, gens = build_methods(target, draft, cfg, log, drafts)
    curves, draft_steps = calibrate(gens, cfg, log)
    records = measure(target, draft, gens, methods, prompts, cfg, curves, draft_steps, log)
    compare(records)
    return {
        **origin,  # commit, dirty, date, command, verispec, python, torch, threads
        "config": cfg.__dict__ | {"temperatures": list(cfg.temperatures), "methods": list(cfg.methods)},
        "target": target.name,
        "draft": draft.name if draft else None,
        "method_drafts": {path: m.name for path, m in (drafts or {}).items()},
        "cost_curve_s": curves[1],  # batch 1
        "cost_curves_s": {str(b): c for b, c in curves.items()},  # batch size -> T(1..n)
        "draft_step_s": draft_steps.get("verispec-draft", {}).get(1, 0.0),
        "draft_steps_s": {m: {str(b): t for b, t in d.items()} for m, d in draft_steps.items()},
        "runner": type(gens["verispec-plain"].runner).__name__,
        "records": records,
    }


def build_methods(
    target: LoadedModel, draft: LoadedModel | None, cfg: E2EConfig, log, drafts=None
) -> tuple[list[str], dict[str, SpeculativeGenerator]]:
    """The methods this run can run (cfg.methods' order, less those without their model or engine) and a generator
    for each verispec one, plus "verispec-plain" always (the baseline: calibration and prompt encoding)."""
    configs = {m: method_config(m, cfg) for m in cfg.methods}  # every name checked; None: another engine's
    methods = [m for m in cfg.methods if draft is not None or not _needs_draft(m, configs[m])]
    methods = _runnable(methods, target, log)
    if isinstance(draft, LoadedHead) and "hf-assisted" in methods:
        methods.remove("hf-assisted")
        log(f"hf-assisted skipped: the draft is a hidden-state head ({draft.kind}), not a model HF generate runs")
    for m in [m for m in methods if configs[m] is not None and configs[m].drafter.target_weights]:
        hf = configs[m].runner == "hf"
        why = "and runner='hf' was asked for" if hf else fast_path_unsupported(target.model)
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


def _draft_model_chains(gen: SpeculativeGenerator) -> bool:
    """Whether a generator drafts chains with a draft model (or the self-draft): its draft step is calibrated."""
    return gen.config.drafter.uses_model and gen.tree is None


def calibrate(gens: dict[str, SpeculativeGenerator], cfg: E2EConfig, log) -> tuple[dict, dict]:
    """The target's cost curves T_B(1..n) at every batch size B, up to the widest verification of any method, and
    the draft step of every draft-model chain method at each B: ({B: curve}, {method: {B: seconds}}). Generators
    with gamma auto start from them."""
    plain = gens["verispec-plain"]
    widest = max(
        [cfg.gamma if isinstance(cfg.gamma, int) else 8]
        + [g.controller.max_gamma for g in gens.values() if g.proposer is not None and g.tree is None]
        + [g.tree.max_nodes for g in gens.values() if g.tree is not None]
    )
    batches = _batches(cfg)
    log(f"calibrating the cost curves at batch {', '.join(map(str, batches))} ...")
    curves = {b: measure_cost_curve(plain.runner, plain.vocab_size, min(widest, 64) + 1, b) for b in batches}
    draft_steps = {
        m: {b: measure_cost_curve(g.proposer.runner, plain.vocab_size, 1, b)[0] for b in batches}
        for m, g in gens.items()
        if _draft_model_chains(g)
    }
    for m, gen in gens.items():  # gamma auto starts from the measured costs at every batch size
        if gen.proposer is not None and gen.controller.fixed is None:
            for b in batches:
                gen.controller.seed_costs(b, curves[b], draft_steps.get(m, {}).get(b))
    for b in batches:
        log(
            f"batch {b}: T(n) target seconds: "
            + ", ".join(f"{t:.3f}" for t in curves[b])
            + "; draft step "
            + ", ".join(f"{m} {t[b]:.3f}s" for m, t in draft_steps.items())
        )
    return curves, draft_steps


def measure(target, draft, gens, methods, prompts, cfg: E2EConfig, curves, draft_steps, log) -> list[dict]:
    """One record per temperature, category, batch size and method (batch 1: the first num_prompts prompts of a
    category; batch B: its first B, verispec methods only, skipped where a category has fewer)."""
    records = []
    encode = gens["verispec-plain"].encode
    for temp in cfg.temperatures:
        for cat, texts in prompts.items():
            ids = [encode(t, chat=cfg.chat) for t in texts]
            for batch in _batches(cfg):
                chosen = ids[: cfg.num_prompts] if batch == 1 else ids[:batch]
                if batch > 1 and len(chosen) < batch:
                    continue
                for method in methods:
                    if batch > 1 and method.startswith(FOREIGN):
                        continue
                    rec = {"temperature": temp, "category": cat, "batch": batch, "method": method}
                    rec["prompts"] = len(chosen)
                    if method.startswith("hf-"):
                        assistant = draft if method == "hf-assisted" else None
                        tok, sec, calls = _hf_generate(target, assistant, chosen, temp, cfg.max_new_tokens, cfg.seed)
                        rec.update(tokens=tok, seconds=sec, tau=tok / calls if calls else None)
                    elif method.startswith("llamacpp-"):
                        lookup = method == "llamacpp-lookup"
                        args = (_gguf_path(target), chosen, temp, cfg.max_new_tokens, cfg.seed, lookup)
                        tok, sec, pre = _llamacpp_generate(*args)
                        rec.update(tokens=tok, seconds=sec, prefill_s=pre)
                    else:
                        costs = draft_steps.get(method, {}).get(batch), curves[batch]
                        rec.update(_measure_verispec(gens[method], method, chosen, batch, temp, cfg, costs))
                    _rates(rec, len(chosen))
                    records.append(rec)
                    log(
                        f"T={temp} {cat:5s} batch {batch} {method:15s} {rec['tokens_per_s']:.2f} tok/s"
                        + (f" tau {rec['tau']:.2f}" if rec.get("tau") else "")
                    )
    return records


def _measure_verispec(gen, method: str, chosen, batch: int, temp: float, cfg: E2EConfig, costs) -> dict:
    """A verispec method's figures over the chosen prompts in chunks of `batch`; costs: (the measured draft step or
    None, the target's cost curve) at this batch size, for the theory of chains that drafted."""
    params = [SamplingParams(temperature=temp, seed=cfg.seed + i) for i in range(len(chosen))]
    tok, sec = 0, 0.0
    stats = None
    for start in range(0, len(chosen), batch):
        gen.generate(
            chosen[start : start + batch],
            params[start : start + batch],
            max_new_tokens=cfg.max_new_tokens,
            ignore_eos=True,
        )
        s = gen.last_stats
        tok += s.output_tokens
        sec += s.wall_time
        if stats is None:
            stats = s
        else:
            stats.merge(s)
    tree = gen.tree is not None
    out = {"prefill_s": _prefill_seconds(gen, chosen, batch)}
    out.update(
        tokens=tok,
        seconds=sec,
        tau=stats.tau,
        alpha=None if tree else stats.acceptance_rate,  # a tree's alpha is not one number: per-depth is per_position
        per_position=stats.per_position_acceptance,
        drafted=stats.drafted,
        steps=stats.target_passes,
        draft_s=stats.draft_time,
        verify_s=stats.verify_time,
        nodes=stats.nodes,
        drafted_per_step=stats.nodes / max(stats.target_passes, 1),
    )
    if method != "verispec-plain" and stats.drafted and not tree:
        measured, curve = costs
        draft_step = measured if measured is not None else stats.draft_time / max(stats.drafted, 1)
        out["theory_speedup"] = theory_speedup(stats.acceptance_rate, stats.steps_by_drafted, draft_step, curve)
    return out


def _rates(rec: dict, prompts: int) -> None:
    """tokens/s, and after the prefill where it was measured (the prefill's forward gives each row its first token)."""
    rec["tokens_per_s"] = rec["tokens"] / rec["seconds"] if rec["seconds"] else None
    if rec.get("prefill_s") is not None and rec["seconds"] > rec["prefill_s"]:
        rec["decode_tokens_per_s"] = (rec["tokens"] - prompts) / (rec["seconds"] - rec["prefill_s"])


def compare(records: list[dict]) -> None:
    """Each record's speedups over verispec-plain at the same temperature, category and batch (with the prefill and
    after it), measured over theory, and its ratios to HF assisted and llama.cpp plain at batch 1."""
    for rec in records:
        base = next(
            (
                r
                for r in records
                if r["method"] == "verispec-plain"
                and r["temperature"] == rec["temperature"]
                and r["category"] == rec["category"]
                and r["batch"] == rec["batch"]
            ),
            None,
        )
        rec["speedup"] = rec["tokens_per_s"] / base["tokens_per_s"] if base and base["tokens_per_s"] else None
        dec, base_dec = rec.get("decode_tokens_per_s"), base.get("decode_tokens_per_s") if base else None
        rec["decode_speedup"] = dec / base_dec if dec and base_dec else None  # the steps alone, prefill excluded
        if rec.get("theory_speedup") and rec["decode_speedup"]:  # the theory prices decoding steps, not the prefill
            rec["measured_over_theory"] = rec["decode_speedup"] / rec["theory_speedup"]
        hf = _find(records, "hf-assisted", rec["temperature"], rec["category"])
        if hf and hf["tokens_per_s"]:
            rec["vs_hf_assisted"] = rec["tokens_per_s"] / hf["tokens_per_s"]
        lc = _find(records, "llamacpp-plain", rec["temperature"], rec["category"])
        if lc and lc.get("decode_tokens_per_s") and rec.get("decode_tokens_per_s"):
            rec["vs_llamacpp_plain"] = rec["tokens_per_s"] / lc["tokens_per_s"]
            rec["vs_llamacpp_plain_decode"] = rec["decode_tokens_per_s"] / lc["decode_tokens_per_s"]


def _find(records: list[dict], method: str, temperature: float, category: str) -> dict | None:
    """The batch-1 record of a method at a temperature and category."""
    match = (method, temperature, category, 1)
    return next((r for r in records if (r["method"], r["temperature"], r["category"], r["batch"]) == match), None)


def _runnable(methods: list[str], target: LoadedModel, log) -> list[str]:
    """The methods this target can run: HF's need a torch model, llama.cpp's a GGUF file and llama-cpp-python."""
    from ..model.llamacpp import llamacpp_available

    keep = []
    for m in methods:
        if m.startswith("hf-") and not isinstance(target.model, torch.nn.Module):
            log(f"{m} skipped: the target runs on llama.cpp (HF generate needs a torch model)")
        elif m.startswith("llamacpp-") and (_gguf_path(target) is None or not llamacpp_available()):
            log(f"{m} skipped: it needs a .gguf target and llama-cpp-python (pip install -e '.[llamacpp]')")
        else:
            keep.append(m)
    return keep


def _prefill_seconds(gen: SpeculativeGenerator, prompts: list[list[int]], batch: int) -> float:
    """Seconds of the prompts' prefill (and first token) in verispec: a one-token run per chunk of `batch`."""
    seconds = 0.0
    for start in range(0, len(prompts), batch):
        chunk = prompts[start : start + batch]
        gen.generate(chunk, [SamplingParams(seed=i) for i in range(len(chunk))], max_new_tokens=1, ignore_eos=True)
        seconds += gen.last_stats.wall_time
    return seconds


def _fmt(x, spec=".2f"):
    return "-" if x is None else format(x, spec)


def _curve_lines(result: dict) -> list[str]:
    curves = result.get("cost_curves_s") or {"1": result["cost_curve_s"]}
    drafts = result.get("draft_steps_s", {})
    return [
        f"- batch {b}: T(1..{len(c)}) = "
        + ", ".join(f"{t:.3f}" for t in c)
        + f"; T(n)/T(1) at n = {len(c)}: {c[-1] / c[0]:.2f}; draft step "
        + (", ".join(f"{m} {d[b]:.3f}" for m, d in drafts.items() if b in d) or "-")
        for b, c in curves.items()
    ]


def to_markdown(result: dict) -> str:
    lines = [
        *provenance_lines(result),
        f"target: {result['target']}; draft: {result['draft']}; torch {result['torch']}, "
        f"{result['threads']} threads; max_new_tokens {result['config']['max_new_tokens']}; "
        f"gamma {result['config']['gamma']}",
        f"verispec runner: {result.get('runner', 'HFRunner')}; cost curves T_B(n), seconds of one target forward "
        "over n new tokens per row at batch B, and the draft step at B (theory at batch B prices steps with these):",
        "",
        *_curve_lines(result),
        "",
        "| T | category | batch | method | tok/s | tok/s after prefill | speedup | speedup after prefill | vs HF assisted "
        "| vs llama.cpp plain (incl. / after prefill) | tau | drafted / step | alpha "
        "| per-position (trees: per-depth) acceptance | theory speedup | measured / theory |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["records"]:
        pp = r.get("per_position")
        lines.append(
            f"| {r['temperature']:g} | {r['category']} | {r['batch']} | {r['method']} | {_fmt(r['tokens_per_s'])} | "
            f"{_fmt(r.get('decode_tokens_per_s'))} | {_fmt(r.get('speedup'))} | {_fmt(r.get('decode_speedup'))} | "
            f"{_fmt(r.get('vs_hf_assisted'))} | "
            f"{_fmt(r.get('vs_llamacpp_plain'))} / {_fmt(r.get('vs_llamacpp_plain_decode'))} | {_fmt(r.get('tau'))} | "
            f"{_fmt(r.get('drafted_per_step'), '.1f')} | "
            f"{_fmt(r.get('alpha'))} | {' '.join(_fmt(x) for x in pp) if pp else '-'} | "
            f"{_fmt(r.get('theory_speedup'))} | {_fmt(r.get('measured_over_theory'))} |"
        )
    return "\n".join(lines)


def plot(result: dict, path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = [r for r in result["records"] if r["batch"] == 1]
    temps = sorted({r["temperature"] for r in recs})
    cats = list(dict.fromkeys(r["category"] for r in recs))
    methods = list(dict.fromkeys(r["method"] for r in recs))
    fig, axes = plt.subplots(1, len(temps), figsize=(6 * len(temps), 4), squeeze=False)
    width = 0.8 / len(methods)
    for ax, temp in zip(axes[0], temps):
        for i, m in enumerate(methods):
            vals = [
                next(
                    (
                        r["speedup"] or 0
                        for r in recs
                        if r["temperature"] == temp and r["category"] == c and r["method"] == m
                    ),
                    0,
                )
                for c in cats
            ]
            ax.bar([x + i * width for x in range(len(cats))], vals, width, label=m)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks([x + width * (len(methods) - 1) / 2 for x in range(len(cats))], cats)
        ax.set_title(f"temperature {temp:g}, batch 1")
        ax.set_ylabel("speedup over verispec-plain (tokens/s)")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
