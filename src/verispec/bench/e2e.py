"""`verispec bench e2e`: end-to-end decoding speed, every method side by side in one process and one run.

Methods (same target, prompts, max_new_tokens, temperature and seeds):
    verispec-plain    plain decoding through verispec's loop (the baseline speedups are relative to)
    verispec-draft    verispec with the draft model
    verispec-ngram    verispec with prompt lookup
    verispec-self     verispec with the target's own weights, int4-quantized, as the draft (`self_quant`)
    hf-plain          HF transformers generate()
    hf-assisted       HF transformers generate(assistant_model=draft)
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

from ..drafting import TreeSpec
from ..engine.adaptive import measure_cost_curve
from ..engine.generator import SpeculativeGenerator
from ..model.fast import fast_path_unsupported
from ..model.loading import LoadedModel
from ..sampling import SamplingParams
from ..sampling.theory import expected_tokens_per_pass

__all__ = ["E2EConfig", "load_prompts", "plot", "run_e2e", "to_markdown"]


@dataclass(frozen=True)
class E2EConfig:
    max_new_tokens: int = 64
    temperatures: tuple[float, ...] = (0.0, 1.0)
    num_prompts: int = 2  # per category at batch 1
    batch: tuple[int, ...] = (4,)  # batched verispec runs, each on the first `batch` prompts of each category
    gamma: int | str = 4
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
    """(tokens, seconds, target forward calls) for HF generate over prompts one at a time."""
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
            if draft is not None:
                kwargs["assistant_model"] = draft.model
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


BASE_METHODS = E2EConfig.methods + ("verispec-tree", "verispec-ngram-tree", "llamacpp-plain", "llamacpp-lookup")
FOREIGN = ("hf-", "llamacpp-")  # other engines' methods: batch 1 only


def check_method(name: str) -> None:
    """Raise ValueError for a method name run_e2e does not know (see the module docstring)."""

    base, at, arg = _strip_mode(name).partition("@")
    if base not in BASE_METHODS or (at and base not in ("verispec-draft", "verispec-tree", "verispec-ngram-tree")):
        raise ValueError(
            f"unknown method {name!r}; choose from {', '.join(E2EConfig.methods)}, verispec-draft[@G][/{'|'.join(MODES)}], "
            "verispec-tree@SHAPE[/RULE], verispec-ngram-tree@SHAPE"
        )
    if base in ("verispec-tree", "verispec-ngram-tree"):
        if not arg:
            raise ValueError(f"{base} needs a shape: {base}@4-2-2-1")
        shape, _, rule = arg.partition("/")
        TreeSpec.parse(shape, rule or None)
    elif at and not arg.isdigit():
        raise ValueError(f"verispec-draft@G needs an integer draft length, got {name!r}")


def _make(method: str, target: LoadedModel, draft: LoadedModel | None, cfg: E2EConfig) -> SpeculativeGenerator:
    base, _, arg = method.partition("@")
    if base.startswith("verispec-draft"):  # verispec-draft[@G][/MODE]
        mode = method.rpartition("/")[2] if _strip_mode(method) != method else None
        arg = _strip_mode(method).partition("@")[2]
        return SpeculativeGenerator(
            target,
            draft,
            gamma=int(arg) if arg else cfg.gamma,
            runner=cfg.runner,
            draft_quant=cfg.draft_quant,
            **MODES.get(mode, {}),
        )
    shape, _, rule = arg.partition("/")
    if base == "verispec-tree":
        return SpeculativeGenerator(
            target, draft, tree=shape, tree_rule=rule or None, runner=cfg.runner, draft_quant=cfg.draft_quant
        )
    return SpeculativeGenerator(target, "ngram", tree=shape, runner=cfg.runner)  # verispec-ngram-tree


MODES = {"block": dict(verify="block"), "position": dict(seeding="position"), "gumbel": dict(coupling="gumbel")}


def _strip_mode(method: str) -> str:
    """verispec-draft@4/block -> verispec-draft@4 (a draft-model chain's MODE suffix; other names unchanged)."""
    head, _, mode = method.rpartition("/")
    return head if method.startswith("verispec-draft") and mode in MODES else method


def _base(method: str) -> str:
    """verispec-draft@4/block -> verispec-draft; verispec-tree@4-2/iid -> verispec-tree."""
    return _strip_mode(method).partition("@")[0]


def run_e2e(
    target: LoadedModel, draft: LoadedModel | None, prompts: dict[str, list[str]], cfg: E2EConfig, log=print
) -> dict:
    for m in cfg.methods:
        check_method(m)
    needs_draft = ("verispec-draft", "hf-assisted", "verispec-tree")
    methods = [m for m in cfg.methods if draft is not None or _base(m) not in needs_draft]
    methods = _runnable(methods, target, log)
    if "verispec-self" in methods and (cfg.runner == "hf" or fast_path_unsupported(target.model)):
        methods.remove("verispec-self")
        log(
            "verispec-self skipped: a quantized self-draft needs the fast runner, "
            + ("and runner='hf' was asked for" if cfg.runner == "hf" else fast_path_unsupported(target.model))
        )
    gens = {"verispec-plain": SpeculativeGenerator(target, None, runner=cfg.runner)}
    if "verispec-ngram" in methods:
        gens["verispec-ngram"] = SpeculativeGenerator(target, "ngram", gamma=cfg.gamma, runner=cfg.runner)
    for m in methods:
        if _base(m) in ("verispec-draft", "verispec-tree", "verispec-ngram-tree"):
            gens[m] = _make(m, target, draft, cfg)
    if "verispec-self" in methods:
        log(f"quantizing the target's weights ({cfg.self_quant}) for the self-draft ...")
        gens["verispec-self"] = SpeculativeGenerator(
            target, "self", gamma=cfg.gamma, runner=cfg.runner, draft_quant=cfg.self_quant
        )
    vocab = gens["verispec-plain"].vocab_size
    max_gamma = cfg.gamma if isinstance(cfg.gamma, int) else 8
    widest = max(
        [max_gamma]
        + [int(_strip_mode(m).partition("@")[2]) for m in methods if m.startswith("verispec-draft@")]
        + [g.tree.max_nodes for g in gens.values() if g.tree is not None]
    )
    batches = sorted({1, *cfg.batch})
    log(f"calibrating the cost curves at batch {', '.join(map(str, batches))} ...")
    curves = {b: measure_cost_curve(gens["verispec-plain"].runner, vocab, min(widest, 64) + 1, b) for b in batches}
    draft_steps = {
        m: {b: measure_cost_curve(gens[m].proposer.runner, vocab, 1, b)[0] for b in batches}
        for m in gens
        if m.startswith(("verispec-draft", "verispec-self"))
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

    records = []
    encode = gens["verispec-plain"].encode
    for temp in cfg.temperatures:
        for cat, texts in prompts.items():
            ids = [encode(t, chat=cfg.chat) for t in texts]
            for batch in batches:
                chosen = ids[: cfg.num_prompts] if batch == 1 else ids[:batch]
                if batch > 1 and len(chosen) < batch:
                    continue
                for method in methods:
                    if batch > 1 and method.startswith(FOREIGN):
                        continue
                    rec = {
                        "temperature": temp,
                        "category": cat,
                        "batch": batch,
                        "method": method,
                        "prompts": len(chosen),
                    }
                    if method.startswith("hf-"):
                        tok, sec, calls = _hf_generate(
                            target,
                            draft if method == "hf-assisted" else None,
                            chosen,
                            temp,
                            cfg.max_new_tokens,
                            cfg.seed,
                        )
                        rec.update(tokens=tok, seconds=sec, tau=tok / calls if calls else None)
                    elif method.startswith("llamacpp-"):
                        tok, sec, pre = _llamacpp_generate(
                            _gguf_path(target), chosen, temp, cfg.max_new_tokens, cfg.seed, method == "llamacpp-lookup"
                        )
                        rec.update(tokens=tok, seconds=sec, prefill_s=pre)
                    else:
                        gen = gens[method]
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
                        rec["prefill_s"] = _prefill_seconds(gen, chosen, batch)
                        tree = gen.tree is not None
                        rec.update(
                            tokens=tok,
                            seconds=sec,
                            tau=stats.tau,
                            alpha=stats.acceptance_rate,
                            per_position=stats.per_position_acceptance,
                            drafted=stats.drafted,
                            steps=stats.target_passes,
                            draft_s=stats.draft_time,
                            verify_s=stats.verify_time,
                            nodes=stats.nodes,
                            drafted_per_step=stats.nodes / max(stats.target_passes, 1),
                        )
                        if tree:  # alpha of a tree is not one number: per-depth acceptance is per_position
                            rec["alpha"] = None
                        if method != "verispec-plain" and stats.drafted and not tree:
                            measured = draft_steps.get(method, {}).get(batch)
                            step_draft = measured if measured is not None else stats.draft_time / max(stats.drafted, 1)
                            rec["theory_speedup"] = theory_speedup(
                                stats.acceptance_rate, stats.steps_by_drafted, step_draft, curves[batch]
                            )
                    rec["tokens_per_s"] = rec["tokens"] / rec["seconds"] if rec["seconds"] else None
                    if rec.get("prefill_s") is not None and rec["seconds"] > rec["prefill_s"]:  # after the prefill
                        first = len(chosen)  # the prefill's forward also gives each row its first token
                        rec["decode_tokens_per_s"] = (rec["tokens"] - first) / (rec["seconds"] - rec["prefill_s"])
                    records.append(rec)
                    log(
                        f"T={temp} {cat:5s} batch {batch} {method:15s} {rec['tokens_per_s']:.2f} tok/s"
                        + (f" tau {rec['tau']:.2f}" if rec.get("tau") else "")
                    )
    for rec in records:  # speedups relative to verispec-plain at the same temperature, category, batch
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
    return {
        "config": cfg.__dict__ | {"temperatures": list(cfg.temperatures), "methods": list(cfg.methods)},
        "target": target.name,
        "draft": draft.name if draft else None,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "cost_curve_s": curves[1],  # batch 1
        "cost_curves_s": {str(b): c for b, c in curves.items()},  # batch size -> T(1..n)
        "draft_step_s": draft_steps.get("verispec-draft", {}).get(1, 0.0),
        "draft_steps_s": {m: {str(b): t for b, t in d.items()} for m, d in draft_steps.items()},
        "runner": type(gens["verispec-plain"].runner).__name__,
        "records": records,
    }


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
            f"{_fmt(r.get('alpha'))} | {' '.join(f'{x:.2f}' for x in pp) if pp else '-'} | "
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
