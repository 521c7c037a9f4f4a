"""`verispec bench acceptance`: what each verification rule keeps, on real models, measured without sampling noise.

A speculative run with a draft model at a fixed gamma records, at every verification step and for the drafts it
actually made, the *exact* expected number of kept drafts under each rule given those drafts:
    token  E[a | x] = sum_i prod_{j <= i} min(1, p_j(x_j) / q_j(x_j))
    block  E[tau | x] = sum_i i P(tau = i | x)                      (sampling.block.block_stop_law)
Both are conditional on the same drafts, so their difference is a paired, Rao-Blackwellised estimate of the gain
of block verification (block >= token holds in expectation over the drafts, not for every draft block) (an average over steps of exact conditional expectations; no variance from the
acceptance uniforms, and none from comparing two different samples). At every drafted position it also records
TV(p, q): the optimal rules accept a draft with probability 1 - TV at one position, the Gumbel coupling at least
(1 - TV) / (1 + TV) (Daliri et al.); the coupling's realised acceptance comes from a coupled run of the same
prompts (its drafts kept / drafted). Per category: steps, mean E[a] token and block, their ratio, 1 - TV, the
coupling bound, the coupling's measured per-draft acceptance and token-wise's.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch

from ..engine.generator import SpeculativeGenerator
from ..model.loading import LoadedModel
from ..sampling import SamplingParams, verify_chain
from ..sampling.block import block_stop_law
from ._provenance import provenance, provenance_lines
from .config import ModelBenchConfig
from .table import markdown_table

__all__ = ["AcceptanceConfig", "run_acceptance", "to_markdown"]


@dataclass(frozen=True)
class AcceptanceConfig(ModelBenchConfig):
    num_prompts: int = 2
    max_new_tokens: int = 64
    gamma: int = 4
    temperature: float = 1.0

    def __post_init__(self):
        if not self.temperature > 0:
            raise ValueError(
                f"temperature must be > 0 (a greedy target makes every exact rule exact match), got {self.temperature}"
            )


class _Recorder:
    """verify_chain's interface: records the exact expectations of the module docstring, then verifies token-wise."""

    def __init__(self):
        self.token: list[float] = []
        self.block: list[float] = []
        self.tv: list[float] = []

    def __call__(
        self, target_probs, draft_token_ids, draft_probs=None, num_draft_tokens=None, generators=None, *, check=True
    ):
        if draft_probs is not None and draft_token_ids.shape[1] > 0:
            self._record(target_probs, draft_token_ids, draft_probs, num_draft_tokens)
        return verify_chain(target_probs, draft_token_ids, draft_probs, num_draft_tokens, generators, check=check)

    def _record(self, p, ids, q, nd):
        k = ids.shape[1]
        real = torch.arange(k, device=ids.device) < nd.unsqueeze(1)  # [B, k]
        safe = ids.clamp(min=0).unsqueeze(-1)
        ratio = (p[:, :k].gather(-1, safe).squeeze(-1).double() / q.gather(-1, safe).squeeze(-1).double()).clamp(max=1)
        token = torch.where(real, ratio, 0.0).cumprod(1).sum(1)  # [B]
        block = (block_stop_law(p, ids, q, nd) * torch.arange(k + 1, device=ids.device)).sum(1)
        tv = 0.5 * (p[:, :k].double() - q.double()).abs().sum(-1)  # [B, k]
        rows = nd > 0
        self.token += token[rows].tolist()
        self.block += block[rows].tolist()
        self.tv += tv[real].tolist()


def _run(gen: SpeculativeGenerator, prompts: list[list[int]], cfg: AcceptanceConfig):
    params = [SamplingParams(temperature=cfg.temperature, seed=cfg.seed + i) for i in range(len(prompts))]
    for ids, sp in zip(prompts, params):  # batch 1: what a row sees does not depend on the others
        gen.generate([ids], sp, max_new_tokens=cfg.max_new_tokens)
    return gen.stats


def run_acceptance(
    target: LoadedModel, draft: LoadedModel, prompts: dict[str, list[str]], cfg: AcceptanceConfig, log=print
) -> dict:
    origin = provenance()  # the code, date and command at the start of the run
    common = dict(gamma=cfg.gamma, draft_stop_below=None, runner=cfg.runner, draft_quant=cfg.draft_quant)
    records = []
    for category, texts in prompts.items():
        rec = _Recorder()
        gen = SpeculativeGenerator(target, draft, verifier=rec, **common)
        encoded = [gen.encode(t, chat=cfg.chat) for t in texts[: cfg.num_prompts]]
        t0 = time.perf_counter()
        token_stats = _run(gen, encoded, cfg)
        coupled = _run(SpeculativeGenerator(target, draft, coupling="gumbel", **common), encoded, cfg)
        n = len(rec.token)
        mean = lambda xs: sum(xs) / len(xs) if xs else None  # noqa: E731
        tv = mean(rec.tv)
        row = dict(
            category=category,
            prompts=len(encoded),
            steps=n,
            e_token=mean(rec.token),
            e_block=mean(rec.block),
            block_gain=(mean(rec.block) / mean(rec.token)) if n and mean(rec.token) else None,
            one_minus_tv=None if tv is None else 1 - mean(rec.tv),
            coupling_bound=None if tv is None else mean([(1 - x) / (1 + x) for x in rec.tv]),
            token_acceptance=token_stats.acceptance_rate,
            coupling_acceptance=coupled.acceptance_rate,
            seconds=time.perf_counter() - t0,
        )
        log(
            f"{category}: {n} steps, E[kept] token {row['e_token']:.3f} block {row['e_block']:.3f}; "
            f"acceptance token {row['token_acceptance']:.3f}, coupled {row['coupling_acceptance']:.3f}"
        )
        records.append(row)
    return dict(
        **origin,  # commit, dirty, date, command, verispec, python, torch, threads
        config=asdict(cfg),
        target=target.name,
        draft=draft.name,
        records=records,
    )


def _f(x, spec=".3f"):
    return "-" if x is None else f"{x:{spec}}"


def to_markdown(result: dict) -> str:
    cfg = result["config"]
    lines = [
        *provenance_lines(result),
        f"target: {result['target']}; draft: {result['draft']}; gamma {cfg['gamma']} (full chains), temperature "
        f"{cfg['temperature']}, {cfg['max_new_tokens']} new tokens per prompt, batch 1; torch {result['torch']}",
        "",
        "E[kept]: exact expected kept drafts per step given the drafts made (paired: the same drafts for both rules).",
        "",
    ]
    header = [
        "category",
        "prompts",
        "steps",
        "E[kept] token",
        "E[kept] block",
        "block / token",
        "1 - TV (optimal, per position)",
        "(1 - TV) / (1 + TV) (coupling bound)",
        "acceptance token (measured)",
        "acceptance coupled (measured)",
    ]
    cells = [
        [
            r["category"],
            r["prompts"],
            r["steps"],
            _f(r["e_token"]),
            _f(r["e_block"]),
            _f(r["block_gain"]),
            _f(r["one_minus_tv"]),
            _f(r["coupling_bound"]),
            _f(r["token_acceptance"]),
            _f(r["coupling_acceptance"]),
        ]
        for r in result["records"]
    ]
    return "\n".join(lines + markdown_table(header, cells))


def plot(result: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = result["records"]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    x = range(len(recs))
    ax.bar([i - 0.2 for i in x], [r["e_token"] or 0 for r in recs], 0.4, label="token")
    ax.bar([i + 0.2 for i in x], [r["e_block"] or 0 for r in recs], 0.4, label="block")
    ax.set_xticks(list(x), [r["category"] for r in recs])
    ax.set_ylabel("exact E[kept drafts] per step")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
