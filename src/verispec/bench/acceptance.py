"""`verispec bench acceptance`: what each verification rule keeps, on real models, measured without sampling noise
(`_Recorder`; docs/benchmarks.md, "Verification rules")."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch

from ..engine.config import SpecConfig
from ..engine.generator import SpeculativeGenerator
from ..engine.verify import Verification
from ..model.loading import LoadedModel
from ..sampling import SamplingParams, verify_chain
from ..sampling.block import block_stop_law
from .harness import ModelBenchConfig, bars, report_head, started, table

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
    """verify_chain's interface: records, for the drafts actually made at each step, the exact expected kept drafts
    under each rule, token E[a | x] = sum_i prod_{j <= i} min(1, p_j(x_j) / q_j(x_j)) and block E[tau | x] =
    sum_i i P(tau = i | x) (`block_stop_law`), a paired estimate of block's gain; and TV(p, q) at every drafted
    position (optimal rules accept with 1 - TV, the Gumbel coupling at least (1 - TV) / (1 + TV)); then verifies
    token-wise."""

    def __init__(self):
        self.token, self.block, self.tv = [], [], []  # per step: E[a | x], E[tau | x]; per drafted position: TV

    def __call__(self, p, ids, q=None, num_draft_tokens=None, generators=None, *, check=True):
        if q is not None and ids.shape[1] > 0:
            nd, k = torch.as_tensor(num_draft_tokens, device=ids.device), ids.shape[1]  # [B], K
            real = torch.arange(k, device=ids.device) < nd.unsqueeze(1)  # [B, k]
            safe = ids.clamp(min=0).unsqueeze(-1)
            ratio = p[:, :k].gather(-1, safe).squeeze(-1).double() / q.gather(-1, safe).squeeze(-1).double()
            token = torch.where(real, ratio.clamp(max=1), 0.0).cumprod(1).sum(1)  # [B]
            block = (block_stop_law(p, ids, q, nd) * torch.arange(k + 1, device=ids.device)).sum(1)  # [B]
            tv = 0.5 * (p[:, :k].double() - q.double()).abs().sum(-1)  # [B, k]
            self.token += token[nd > 0].tolist()
            self.block += block[nd > 0].tolist()
            self.tv += tv[real].tolist()
        return verify_chain(p, ids, q, num_draft_tokens, generators, check=check)


def _run(gen: SpeculativeGenerator, prompts: list[list[int]], cfg: AcceptanceConfig):
    for i, ids in enumerate(prompts):  # batch 1: what a row sees does not depend on the others
        gen.generate(
            [ids], SamplingParams(temperature=cfg.temperature, seed=cfg.seed + i), max_new_tokens=cfg.max_new_tokens
        )
    return gen.stats


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def run_acceptance(target: LoadedModel, draft: LoadedModel, prompts: dict, cfg: AcceptanceConfig, log=print) -> dict:
    """Per category: the token-wise run recording its exact expectations, then a Gumbel-coupled run."""
    result = started()  # the code, date and command at the start of the run
    # the recorded run draws from each request's stream: coupled rows would hand the recorder one-hot targets
    spec = dict(draft="model", gamma=cfg.gamma, stop_below=None, runner=cfg.runner, quant=cfg.draft_quant)
    records = []
    for category, texts in prompts.items():
        rec = _Recorder()
        config = SpecConfig(**spec, random="stream")
        gen = SpeculativeGenerator(target, draft, config=config, verification=Verification(chain=rec))
        encoded = [gen.encode(t, chat=cfg.chat) for t in texts[: cfg.num_prompts]]
        t0 = time.perf_counter()
        token_stats = _run(gen, encoded, cfg)
        coupled = _run(SpeculativeGenerator(target, draft, config=SpecConfig(**spec, random="gumbel")), encoded, cfg)
        tv = _mean(rec.tv)
        row = dict(category=category, prompts=len(encoded), steps=len(rec.token))
        row |= dict(e_token=_mean(rec.token), e_block=_mean(rec.block))
        row["block_gain"] = row["e_block"] / row["e_token"] if row["e_token"] else None
        row["one_minus_tv"] = None if tv is None else 1 - tv
        row["coupling_bound"] = None if tv is None else _mean([(1 - x) / (1 + x) for x in rec.tv])
        row |= dict(token_acceptance=token_stats.acceptance_rate, coupling_acceptance=coupled.acceptance_rate)
        row["seconds"] = time.perf_counter() - t0
        log(
            f"{category}: {row['steps']} steps, E[kept] token {row['e_token']:.3f} block {row['e_block']:.3f}; "
            f"acceptance token {row['token_acceptance']:.3f}, coupled {row['coupling_acceptance']:.3f}"
        )
        records.append(row)
    return result | dict(config=asdict(cfg), target=target.name, draft=draft.name, records=records)


COLUMNS = ["category", "prompts", "steps", ("E[kept] token", "e_token", ".3f"), ("E[kept] block", "e_block", ".3f")]
COLUMNS += [("block / token", "block_gain", ".3f"), ("1 - TV (optimal, per position)", "one_minus_tv", ".3f")]
COLUMNS += [("(1 - TV) / (1 + TV) (coupling bound)", "coupling_bound", ".3f")]
COLUMNS += [("acceptance token (measured)", "token_acceptance", ".3f")]
COLUMNS += [("acceptance coupled (measured)", "coupling_acceptance", ".3f")]


def to_markdown(result: dict) -> str:
    cfg = result["config"]
    run = f"gamma {cfg['gamma']} (full chains), temperature {cfg['temperature']}, {cfg['max_new_tokens']} new tokens"
    models = f"target: {result['target']}; draft: {result['draft']}; {run} per prompt, batch 1; torch {result['torch']}"
    kept = "E[kept]: exact expected kept drafts per step given the drafts made (paired: both rules, the same drafts)."
    return "\n".join(report_head(result, models, "", kept) + table(result["records"], COLUMNS))


def plot(result: dict, path) -> None:
    rules = [r | {"rule": rule, "e": r[f"e_{rule}"]} for r in result["records"] for rule in ("token", "block")]
    ylabel = "exact E[kept drafts] per step"
    bars(path, rules, None, "category", "rule", "e", title="", ylabel=ylabel, one=False)
