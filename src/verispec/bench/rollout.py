"""`verispec bench rollout`: a GRPO-shaped rollout workload over epochs with weight updates, every drafting method
(METHODS) side by side in one run; what it measures: docs/benchmarks.md, "What each benchmark measures"."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from ..drafting import TreeSpec
from ..engine.config import DRAFTERS, SpecConfig
from ..model.loading import LoadedModel
from ..rollout import RolloutEngine
from ..sampling import SamplingParams
from .harness import SelfDraftBenchConfig, bars, ratio_to, report_head, side_by_side, started, table, timed
from .runner import measure_curve

__all__ = ["METHODS", "RolloutBenchConfig", "RolloutWorkloadConfig", "method_config", "perturbed", "plot"]
__all__ += ["run_rollout_bench", "timed_generate", "to_markdown"]

METHODS = {"plain": "none", "draft": "model", "self": "self", "history": "history"}  # name -> SpecConfig's draft
METHODS |= {"history+self": "self+history", "history+draft": "model+history"}  # one tree: branches beside a chain
METHODS |= {"history/self": "self+history", "history/draft": "model+history"}  # per row and step, one (choose_depth)


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
        if not TreeSpec.parse(self.history_tree).dynamic:
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


def method_config(method: str, cfg: RolloutWorkloadConfig, trie: RolloutBenchConfig | None = None) -> SpecConfig:
    """A method's SpecConfig under `cfg` (RL's: a fixed gamma run to its end, random=stream); the history trie's
    shape from `trie` (default: cfg itself)."""
    draft, trie = METHODS[method], cfg if trie is None else trie
    items = dict(draft=draft, gamma=cfg.gamma, stop_below=None, random="stream", runner=cfg.runner)
    if DRAFTERS[draft].history:
        items |= dict(tree=trie.history_tree, min_share=trie.history_min_share)
        items |= {"choose_depth": trie.choose_depth} if "/" in method else {}
    return SpecConfig(**items, **cfg.quant_keys(draft))


def run_rollout_bench(target: LoadedModel, draft, prompts: dict[str, list[str]], cfg: RolloutBenchConfig, log=print):
    """Every method's engine over every epoch and category (see the module docstring)."""
    result = started()  # the code, date and command at the start of the run
    rows = cfg.group * cfg.num_prompts
    engines = {}
    for m in cfg.methods:
        config = method_config(m, cfg)
        engines[m] = RolloutEngine(target, draft if config.drafter.model else None, config=config, max_batch_size=rows)
    first = next(iter(engines.values())).gen.core
    ids = {c: [first.encode(p, cfg.chat) for p in ps[: cfg.num_prompts]] for c, ps in prompts.items()}
    per_row = [1, 2, 3, 5, 9, 17]
    seconds = measure_curve({"target": first.runner}, first.vocab_size, per_row, repeats=3, batch=rows)["target"]
    curve = [dict(batch=rows, tokens_per_row=n, seconds=s) for n, s in zip(per_row, seconds)]
    log(f"T_B(n) at batch {rows}: " + ", ".join(f"{c['tokens_per_row']}: {c['seconds']:.3f}s" for c in curve))
    records, updates = [], []
    for epoch in range(cfg.epochs):
        updates += _update(engines, target, epoch, cfg, log) if epoch else []
        measure = lambda m, case: _measure(engines[m], case["epoch"], ids[case["category"]], cfg)  # noqa: E731
        records += side_by_side([dict(epoch=epoch, category=c) for c in ids], cfg.methods, measure, log)
    ratio_to(records, {"method": "plain"}, "tokens_per_s", ("epoch", "category"), "ratio_to_plain")
    extra = dict(config=asdict(cfg), target=target.name, draft=draft.name if draft else None, cost_curve=curve)
    return result | extra | dict(records=records, updates=updates)


def _update(engines: dict, target: LoadedModel, epoch: int, cfg: RolloutBenchConfig, log) -> list[dict]:
    """The perturbed weights of an epoch, sent to every engine: one record each."""
    made, new = timed(perturbed, target.model, cfg.noise, cfg.seed * 1000 + epoch)
    out = []
    for m, eng in engines.items():
        rep = eng.update_weights(new)
        out.append(dict(epoch=epoch, method=m, noise_seconds=made, **asdict(rep)))
        log(f"epoch {epoch}: {m} update {rep.seconds:.2f}s, re-quantization {rep.requantize_seconds:.2f}s")
    return out


def timed_generate(engine, prompts, **kwargs) -> tuple[list, dict]:
    """One `generate` call of a RolloutEngine or a RolloutCluster, timed: its rollouts, and their rows, tokens,
    seconds, tokens_per_s and tau (tokens per verification pass of a row, pooled over the rows)."""
    seconds, outs = timed(engine.generate, prompts, **kwargs)
    tokens = sum(len(o.completion_token_ids) for o in outs)
    tau = tokens / max(engine.last_stats.target_passes, 1)
    return outs, dict(rows=len(outs), tokens=tokens, seconds=seconds, tokens_per_s=tokens / seconds, tau=tau)


def _measure(eng: RolloutEngine, epoch: int, ids, cfg: RolloutBenchConfig) -> dict:
    proposer = eng.gen.core.proposer
    before = dict(getattr(proposer, "accepted_by_source", {}))
    params = SamplingParams(temperature=cfg.temperature)
    kwargs = dict(n=cfg.group, params=params, max_new_tokens=cfg.max_new_tokens, seed=cfg.seed + epoch)
    outs, figures = timed_generate(eng, ids, **kwargs, ignore_eos=True)
    st = eng.last_stats
    after = getattr(proposer, "accepted_by_source", None)
    by_source = {proposer.name: st.accepted} if proposer is not None else {}
    by_source = {k: v - before.get(k, 0) for k, v in after.items()} if after is not None else by_source
    passes = max(st.target_passes, 1)
    out = dict(drafted_per_step=st.drafted / passes, nodes_per_step=st.nodes / passes, accepted=st.accepted)
    return figures | out | dict(accepted_by_source=by_source, weight_version=outs[0].weight_version)


COLUMNS = ["epoch", "category", "method", ("tokens/s", "tokens_per_s", ".2f"), ("x plain", "ratio_to_plain", ".2f")]
COLUMNS += [("tau", "tau", ".2f"), ("drafted/step", "drafted_per_step", ".2f"), ("nodes/step", "nodes_per_step", ".2f")]
COLUMNS += [("accepted by source", lambda r: ", ".join(f"{k} {v}" for k, v in r["accepted_by_source"].items()) or "-")]


def to_markdown(result: dict) -> str:
    cfg = result["config"]
    lines = report_head(
        result,
        f"bench rollout: target {result['target']}, draft {result['draft']}, G = {cfg['group']} x "
        f"{cfg['num_prompts']} prompt(s) per category, {cfg['max_new_tokens']} new tokens, temperature "
        f"{cfg['temperature']:g}, {cfg['epochs']} epochs, weights + noise {cfg['noise']:g} x RMS between epochs",
    )
    lines += table(result["records"], COLUMNS)
    curve = result.get("cost_curve") or []
    if curve:
        lines += ["", f"target cost curve at batch {curve[0]['batch']} (one forward, n new tokens per row):", ""]
        x_t1 = ("x T(1)", lambda c: c["seconds"] / curve[0]["seconds"], ".2f")
        lines += table(curve, [("n", "tokens_per_row"), ("seconds", "seconds", ".3f"), x_t1])
    if result["updates"]:
        cols = ["epoch", "method", ("update s", "seconds", ".2f"), ("re-quantization s", "requantize_seconds", ".2f")]
        lines += ["", *table(result["updates"], cols)]
    return "\n".join(lines)


def plot(result: dict, path) -> None:
    recs = [r for r in result["records"] if r["method"] != "plain"]
    title = lambda c: f"{c}: rollout tokens/s over plain, per epoch"  # noqa: E731
    bars(path, recs, "category", "epoch", "method", "ratio_to_plain", title=title, ylabel="x plain")
