"""`verispec bench rollout`: a GRPO-shaped rollout workload, every drafting method side by side in one run.

Per category: the first `num_prompts` prompts, G samples each (one `RolloutEngine.generate` call: a batch of
num_prompts * G rows), temperature 1, `max_new_tokens` per sample (EOS ignored so every method produces the same
number of tokens), for `epochs` epochs over the same prompts. Between epochs the target's weights are perturbed
as a stand-in for an optimizer step: every floating-point tensor with two or more dimensions gets Gaussian noise
of `noise` times its RMS (seeded by epoch), sent to every engine through `update_weights` (the first engine writes
it, the others write the same values and rebuild what they derived: their int4 self-drafts are re-quantized).

Methods (one engine each, all over the same target object; they keep their history across epochs):
    plain           plain batched decoding (the baseline)
    draft           the draft model (quantized with `draft_quant`), chains of `gamma`
    self            the target's own weights quantized (`self_quant`), chains of `gamma` (re-quantized after updates)
    history         suffix decoding over the group's siblings and earlier epochs' rollouts (exact trie)
    history+self    history branches beside a sampled self-draft chain in one tree (rule "mixed")
    history+draft   history branches beside a sampled draft-model chain
    history/self    per row and step, the history trie alone where it is at least `choose_depth` deep, else the
    history/draft   self-draft's / draft model's chain alone
Reported per method, epoch and category: rollout tokens/s, the ratio to plain (same epoch and category), tau
(tokens per target pass), accepted tokens per draft source, and the update and re-quantization times.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch

from ..drafting import TreeSpec
from ..model.loading import LoadedModel
from ..rollout import RolloutEngine
from ..sampling import SamplingParams
from ._provenance import provenance, provenance_lines
from .config import SelfDraftBenchConfig

__all__ = [
    "METHODS",
    "RolloutBenchConfig",
    "RolloutWorkloadConfig",
    "engine_options",
    "perturbed",
    "plot",
    "run_rollout_bench",
    "timed_generate",
    "to_markdown",
]

METHODS = {  # name -> (draft: None / "self" / "model", history, one part per row: CombinedProposer's choose_depth)
    "plain": (None, False, False),
    "draft": ("model", False, False),
    "self": ("self", False, False),
    "history": (None, True, False),
    "history+self": ("self", True, False),
    "history+draft": ("model", True, False),
    "history/self": ("self", True, True),
    "history/draft": ("model", True, True),
}


@dataclass(frozen=True)
class RolloutWorkloadConfig(SelfDraftBenchConfig):
    """The GRPO-shaped workload of the rollout benchmarks (bench rollout, bench replicas) and how their engines draft."""

    group: int = 8  # G samples per prompt
    num_prompts: int = 1  # per category
    max_new_tokens: int = 128
    temperature: float = 1.0
    gamma: int = 4


@dataclass(frozen=True)
class RolloutBenchConfig(RolloutWorkloadConfig):
    epochs: int = 3
    noise: float = 1e-3  # per update: each matrix + N(0, (noise * its RMS)^2)
    history_tree: str = "dynamic-8-3-16"  # the history trie's shape: depth, children per node, node budget per row
    history_min_share: float = 0.0  # a trie node needs this share of the matched continuations
    choose_depth: int = 3  # history/draft, history/self: the trie alone where it is this deep, else the chain
    methods: tuple[str, ...] = ("plain", "draft", "self", "history", "history+self")

    def __post_init__(self):
        spec = TreeSpec.parse(self.history_tree)
        if not spec.dynamic:
            raise ValueError(f"history_tree must be dynamic-D-K-M, got {self.history_tree!r}")
        if not 0.0 <= self.history_min_share <= 1.0:
            raise ValueError(f"history_min_share must be in [0, 1], got {self.history_min_share}")
        unknown = [m for m in self.methods if m not in METHODS]
        if unknown:
            raise ValueError(f"unknown rollout method(s) {', '.join(unknown)}; choose from {', '.join(METHODS)}")


@torch.no_grad()
def perturbed(model: torch.nn.Module, noise: float, seed: int) -> list[tuple[str, torch.Tensor]]:
    """New weights for every floating-point matrix of the model: W + N(0, (noise * rms(W))^2), seeded."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for name, w in model.named_parameters():
        if w.dim() >= 2 and w.is_floating_point():
            rms = w.float().pow(2).mean().sqrt()
            step = torch.randn(w.shape, generator=g, dtype=torch.float32).mul_(noise * rms)
            out.append((name, (w.float() + step).to(w.dtype)))
    return out


def engine_options(method: str, draft, cfg: RolloutWorkloadConfig, trie: RolloutBenchConfig | None = None):
    """A method's draft (None, "self" or `draft`) and its RolloutEngine keyword arguments under `cfg`; the history
    trie's options from `trie` (default: cfg itself)."""
    which, history, pick = METHODS[method]
    if which == "model" and draft is None:
        raise ValueError(f"method {method!r} needs --draft")
    trie = cfg if trie is None else trie
    kwargs = dict(
        draft_quant=cfg.draft_quant if which == "model" else cfg.self_quant if which == "self" else None,
        history=history,
        history_tree=TreeSpec.parse(trie.history_tree),
        history_min_share=trie.history_min_share,
        choose_depth=trie.choose_depth if pick else None,
        gamma=cfg.gamma,
        max_batch_size=cfg.group * cfg.num_prompts,
        runner=cfg.runner,
    )
    return (draft if which == "model" else which), kwargs


def _engine(method: str, target: LoadedModel, draft: LoadedModel | None, cfg: RolloutBenchConfig) -> RolloutEngine:
    model, kwargs = engine_options(method, draft, cfg)
    return RolloutEngine(target, model, **kwargs)


@torch.inference_mode()
def cost_curve(runner, batch: int, per_row: tuple[int, ...] = (1, 2, 3, 5, 9, 17), context: int = 64) -> list[dict]:
    """Median seconds of one target forward over `batch` rows with n new tokens each, after `context` cached ones:
    the price of verifying n - 1 drafts per row at this batch size (T_B(n) / T_B(1) is what a step must beat)."""
    g = torch.Generator().manual_seed(0)
    vocab = runner.vocab_size
    runner.start(batch, context + max(per_row) + 1)
    runner.prefill([torch.randint(0, vocab, (context,), generator=g).tolist() for _ in range(batch)])
    out = []
    for n in per_row:
        times = []
        for _ in range(3):
            toks = [torch.randint(0, vocab, (n,), generator=g).tolist() for _ in range(batch)]
            t0 = time.perf_counter()
            runner.forward(toks)
            times.append(time.perf_counter() - t0)
            runner.truncate([context] * batch)
        out.append(dict(batch=batch, tokens_per_row=n, seconds=sorted(times)[1]))
    runner.cache = None
    return out


def run_rollout_bench(
    target: LoadedModel, draft: LoadedModel | None, prompts: dict[str, list[str]], cfg: RolloutBenchConfig, log=print
) -> dict:
    origin = provenance()  # the code, date and command at the start of the run
    engines = {m: _engine(m, target, draft, cfg) for m in cfg.methods}
    first = next(iter(engines.values()))
    ids = {c: [first.gen.encode(p, cfg.chat) for p in ps[: cfg.num_prompts]] for c, ps in prompts.items()}
    params = SamplingParams(temperature=cfg.temperature)
    records, updates = [], []
    rows = cfg.group * cfg.num_prompts
    curve = cost_curve(first.gen.runner, rows)
    log(f"T_B(n) at batch {rows}: " + ", ".join(f"{c['tokens_per_row']}: {c['seconds']:.3f}s" for c in curve))
    for epoch in range(cfg.epochs):
        if epoch:
            t0 = time.perf_counter()
            new = perturbed(target.model, cfg.noise, cfg.seed * 1000 + epoch)
            made = time.perf_counter() - t0
            for m, eng in engines.items():
                rep = eng.update_weights(new)
                updates.append(dict(epoch=epoch, method=m, noise_seconds=made, **asdict(rep)))
                log(f"epoch {epoch}: {m} update {rep.seconds:.2f}s, re-quantization {rep.requantize_seconds:.2f}s")
            del new
        for cat, cat_ids in ids.items():
            for m, eng in engines.items():
                records.append(_measure(eng, m, epoch, cat, cat_ids, params, cfg))
                r = records[-1]
                log(f"epoch {epoch} {cat:5s} {m:14s} {r['tokens_per_s']:6.2f} tok/s  tau {r['tau']:.2f}")
    _ratios(records)
    return dict(
        **origin,  # commit, dirty, date, command, verispec, python, torch, threads
        config=asdict(cfg),
        target=target.name,
        draft=draft.name if draft else None,
        cost_curve=curve,
        records=records,
        updates=updates,
    )


def timed_generate(engine, prompts, **kwargs) -> tuple[list, dict]:
    """One `generate` call of a RolloutEngine or a RolloutCluster, timed: its rollouts, and their rows, tokens,
    seconds, tokens_per_s and tau (tokens per verification pass of a row, pooled over the rows)."""
    t0 = time.perf_counter()
    outs = engine.generate(prompts, **kwargs)
    seconds = time.perf_counter() - t0
    tokens = sum(len(o.completion_token_ids) for o in outs)
    tau = tokens / max(engine.last_stats.target_passes, 1)
    return outs, dict(rows=len(outs), tokens=tokens, seconds=seconds, tokens_per_s=tokens / seconds, tau=tau)


def _measure(eng: RolloutEngine, method: str, epoch: int, cat: str, ids, params, cfg) -> dict:
    before = dict(getattr(eng.gen.proposer, "accepted_by_source", {}))
    kwargs = dict(n=cfg.group, params=params, max_new_tokens=cfg.max_new_tokens, seed=cfg.seed + epoch)
    outs, timed = timed_generate(eng, ids, **kwargs, ignore_eos=True)
    st = eng.last_stats
    after = getattr(eng.gen.proposer, "accepted_by_source", None)
    by_source = (
        {k: v - before.get(k, 0) for k, v in after.items()}
        if after is not None
        else {eng.gen.proposer.name: st.accepted}
        if eng.gen.proposer is not None
        else {}
    )
    return dict(
        method=method,
        epoch=epoch,
        category=cat,
        **timed,
        drafted_per_step=st.drafted / max(st.target_passes, 1),
        nodes_per_step=st.nodes / max(st.target_passes, 1),
        accepted=st.accepted,
        accepted_by_source=by_source,
        weight_version=outs[0].weight_version,
    )


def _ratios(records: list[dict]) -> None:
    plain = {(r["epoch"], r["category"]): r["tokens_per_s"] for r in records if r["method"] == "plain"}
    for r in records:
        base = plain.get((r["epoch"], r["category"]))
        r["ratio_to_plain"] = r["tokens_per_s"] / base if base else None


def to_markdown(result: dict) -> str:
    cfg = result["config"]
    lines = [
        *provenance_lines(result),
        f"bench rollout: target {result['target']}, draft {result['draft']}, G = {cfg['group']} x "
        f"{cfg['num_prompts']} prompt(s) per category, {cfg['max_new_tokens']} new tokens, temperature "
        f"{cfg['temperature']:g}, {cfg['epochs']} epochs, weights + noise {cfg['noise']:g} x RMS between epochs",
        "",
        "| epoch | category | method | tokens/s | x plain | tau | drafted/step | nodes/step | accepted by source |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["records"]:
        ratio = "-" if r["ratio_to_plain"] is None else f"{r['ratio_to_plain']:.2f}"
        src = ", ".join(f"{k} {v}" for k, v in r["accepted_by_source"].items()) or "-"
        lines.append(
            f"| {r['epoch']} | {r['category']} | {r['method']} | {r['tokens_per_s']:.2f} | {ratio} | {r['tau']:.2f} "
            f"| {r['drafted_per_step']:.2f} | {r['nodes_per_step']:.2f} | {src} |"
        )
    curve = result.get("cost_curve") or []
    if curve:
        t1 = curve[0]["seconds"]
        lines += ["", f"target cost curve at batch {curve[0]['batch']} (one forward, n new tokens per row):", ""]
        lines += ["| n | seconds | x T(1) |", "|---|---|---|"]
        lines += [f"| {c['tokens_per_row']} | {c['seconds']:.3f} | {c['seconds'] / t1:.2f} |" for c in curve]
    if result["updates"]:
        lines += ["", "| epoch | method | update s | re-quantization s |", "|---|---|---|---|"]
        for u in result["updates"]:
            lines.append(f"| {u['epoch']} | {u['method']} | {u['seconds']:.2f} | {u['requantize_seconds']:.2f} |")
    return "\n".join(lines)


def plot(result: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = result["records"]
    cats = list(dict.fromkeys(r["category"] for r in recs))
    methods = [m for m in dict.fromkeys(r["method"] for r in recs) if m != "plain"]
    fig, axes = plt.subplots(1, len(cats), figsize=(5 * len(cats), 4), squeeze=False)
    for ax, cat in zip(axes[0], cats):
        for m in methods:
            pts = [(r["epoch"], r["ratio_to_plain"] or 0) for r in recs if r["category"] == cat and r["method"] == m]
            ax.plot([e for e, _ in pts], [v for _, v in pts], marker="o", label=m)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_title(f"{cat}: rollout tokens/s over plain")
        ax.set_xlabel("epoch (weights perturbed before each)")
        ax.set_xticks(range(result["config"]["epochs"]))
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
