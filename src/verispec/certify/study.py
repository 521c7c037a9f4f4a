"""`verispec certify study`: the seed's failure modes (VARIANTS), measured on real models: the mean over real
contexts of TV(law of a step's first emitted token, p_fp32), the acceptance alpha = mean sum_x min(p, q), and the
`certify generate` verdict when asked. SPEC-RL (Liu et al. 2025) accepts with min(1, l p / q) and redraws from p at a
rejection, at l = 1 and at its scripts' l = e^0.5 (`--bias 0.5`: accept iff log u <= log(p / q) + 0.5)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from ..engine.config import SpecConfig
from ..sampling import SamplingParams, probs_from_logits
from ..sampling.lossy import (
    one_step_law_lenient,
    one_step_law_mismatched_q,
    one_step_law_spec_rl,
    one_step_law_typical,
)
from .bugs import _Q_TEMPERATURE
from .generate import certify_generate, draw_samples
from .kernel import select
from .methods import MethodSpec, _load

__all__ = ["SPEC_RL_LENIENCE", "VARIANTS", "StudyRow", "run_study", "study_markdown"]

SPEC_RL_LENIENCE = math.exp(0.5)  # SPEC-RL's scripts: --bias 0.5, i.e. accept iff log u <= log(p / q) + 0.5
_MISMATCH = "temperature mismatch: q taken before temperature 0.7 (drafts sampled after it)"
_SPEC_RL_E = "SPEC-RL rollout reuse, l = e^0.5 ~ 1.65 (its scripts' --bias 0.5)"
# name -> (description, lossless by construction, MethodSpec overrides)
VARIANTS: dict[str, tuple[str, bool, dict]] = {
    "exact": ("verispec, exact rule (control)", True, {}),
    "temperature-mismatch": (_MISMATCH, False, {"verifier": "q_before_temperature"}),
    "draft-bf16": ("draft model run in bf16 (q = what the bf16 draft sampled from)", True, {"draft_dtype": "bfloat16"}),
    "target-bf16": ("target probabilities computed in bf16", False, {"dtype": "bfloat16", "runner": "hf"}),
    "target-fp16": ("target probabilities computed in fp16", False, {"dtype": "float16", "runner": "hf"}),
    "lenient-0.5": ("lenient acceptance, l = 0.5", False, {"verifier": "lenient:0.5"}),
    "typical": ("typical acceptance (Medusa, eps 0.3, delta 0.09)", False, {"verifier": "typical"}),
    "spec-rl": ("SPEC-RL rollout reuse, l = 1 (rejection: fresh draw from p)", False, {"verifier": "spec-rl"}),
    "spec-rl-lenient-e0.5": (_SPEC_RL_E, False, {"verifier": f"spec-rl:{SPEC_RL_LENIENCE!r}"}),
}


@dataclass
class StudyRow:
    variant: str
    description: str
    lossless_by_construction: bool
    mean_tv: float  # mean over contexts of TV(one-step output law, p_fp32)
    max_tv: float
    alpha: float  # mean acceptance probability at the first draft position
    verdict: str  # PASS / FAIL / "-" (not certified)
    detectable_tv: float  # the first-token test's detectable TV (power 0.99), nan when not certified
    min_holm_p: float


@torch.no_grad()
def _probs(
    model, prompts: list[list[int]], samples: list[list[list[int]]], params: SamplingParams, vocab: int
) -> torch.Tensor:
    """Processed distributions at every context prompt + s[:t] (t = 0..len(s)-1), one forward per continuation:
    [contexts, vocab] float64, in (prompt, sample, position) order."""
    out = []
    for prompt, group in zip(prompts, samples):
        for s in group:
            if not s:
                continue
            ids = torch.tensor([prompt + s[:-1]])
            logits = model(input_ids=ids, logits_to_keep=len(s)).logits[0, -len(s) :, :vocab].float()
            out.append(probs_from_logits(logits, params).double())
    return torch.cat(out)


def _variant_law(name: str, p32: torch.Tensor, q32: torch.Tensor, probs_of) -> tuple[torch.Tensor, torch.Tensor]:
    """(law of the token a step of variant `name` emits at its first position, the q it drafts from): [n, V] each.
    probs_of("target" | "draft", dtype) gives that model's processed distributions at the study's contexts."""
    if name == "exact":
        return one_step_law_mismatched_q(p32, q32, q32), q32
    if name == "temperature-mismatch":
        q_used = q32.pow(_Q_TEMPERATURE)  # the bug's q: before temperature 0.7 (exact when T = 0.7)
        return one_step_law_mismatched_q(p32, q32, q_used / q_used.sum(-1, keepdim=True)), q32
    if name == "draft-bf16":
        q = probs_of("draft", "bfloat16")
        return one_step_law_mismatched_q(p32, q, q), q
    if name in ("target-bf16", "target-fp16"):
        return probs_of("target", VARIANTS[name][2]["dtype"]), q32
    if name == "lenient-0.5":
        return one_step_law_lenient(p32, q32, 0.5), q32
    if name == "typical":
        return one_step_law_typical(p32, q32), q32
    if name in ("spec-rl", "spec-rl-lenient-e0.5"):
        return one_step_law_spec_rl(p32, q32, 1.0 if name == "spec-rl" else SPEC_RL_LENIENCE), q32
    raise ValueError(f"no one-step law for variant {name!r}")


def run_study(
    target: str | None,
    draft: str,
    prompts: list[list[int]],
    params: SamplingParams,
    *,
    variants: list[str] | None = None,
    contexts: int = 16,
    length: int = 8,
    certify_samples: int = 0,
    certify_length: int = 8,
    gamma: int = 4,
    level: float = 0.01,
    seed: int = 0,
    show_progress: bool = True,
) -> list[StudyRow]:
    """Measure how far classic mistakes move the output on real contexts (`verispec certify study`).

    Args:
        target: The target's path or hub id (None: the default model).
        draft: The draft model's path or hub id (sharing the target's tokenizer).
        prompts: The prompts as token ids.
        params: How to sample (temperature > 0).
        variants: The variants to run, by name (default: all of VARIANTS).
        contexts: Target continuations per prompt used as contexts.
        length: Positions per continuation.
        certify_samples: > 0: also run the generator certificate on each variant with this many samples.
        certify_length: The certificate's tokens per continuation.
        gamma: Drafts per step.
        level: The certificate's family-wise significance level.
        seed: The random seed.
        show_progress: Show progress bars.

    Returns:
        One row per variant: its deviation (mean and max TV), acceptance, and the certificate's verdict when run.
    """
    names = _check(params, variants)
    probs_of = _contexts(target, draft, prompts, params, contexts, length, seed, show_progress)
    p32, q32 = probs_of("target", "float32"), probs_of("draft", "float32")  # [contexts, V]
    certify = dict(samples=certify_samples, length=certify_length, level=level, seed=seed, show_progress=show_progress)
    rows = []
    for name in names:
        law, q = _variant_law(name, p32, q32, probs_of)
        tv = 0.5 * (law - p32).abs().sum(-1)  # [contexts]
        alpha = torch.minimum(p32 if not name.startswith("target") else law, q).sum(-1)
        verdict, det, min_p = "-", float("nan"), float("nan")
        if certify_samples > 0:  # the generator certificate's verdict, first-token detectable TV, smallest Holm p
            spec = _variant_spec(name, target, draft, gamma)
            rep = certify_generate(spec, prompts, params, reference=_load(spec.target, "float32"), **certify)
            det = max(t.detectable for t in rep.tests if t.kind == "first-token")
            verdict, min_p = rep.verdict, min(t.holm_pvalue for t in rep.tests)
        desc, lossless, _ = VARIANTS[name]
        found = (float(tv.mean()), float(tv.max()), float(alpha.mean()), verdict, det, min_p)
        rows.append(StudyRow(name, desc, lossless, *found))
    return rows


def _check(params: SamplingParams, variants: list[str] | None) -> list[str]:
    """The variants to run (all by default), the request checked."""
    if params.temperature == 0:
        raise ValueError("the study needs temperature > 0 (at temperature 0 every variant here is exact)")
    return select(variants, list(VARIANTS), "variant(s)")


def _contexts(target, draft, prompts, params, contexts: int, length: int, seed: int, show_progress: bool):
    """probs_of(role, dtype): the target's or the draft's processed distributions at the study's contexts (the
    positions of `contexts` continuations of `length` tokens per prompt drawn from the fp32 target), [n, V]."""
    ref = _load(target, "float32")
    vocab = min(len(ref.tokenizer), ref.model.get_output_embeddings().weight.shape[0])
    label = "contexts (plain decoding)"
    plain = MethodSpec(method="plain", target=target)
    samples, _, _ = draw_samples(
        plain, prompts, params, contexts, length, seed + 4_242_000, show_progress=show_progress, label=label
    )
    paths = {"target": target, "draft": draft}

    def probs_of(role: str, dtype: str) -> torch.Tensor:
        return _probs(_load(paths[role], dtype).model, prompts, samples, params, vocab)

    return probs_of


def _variant_spec(name: str, target, draft: str, gamma: int) -> MethodSpec:
    """The variant as a method the certificate runs: verispec with its draft model, the stream randomness (the
    variants' verifiers see p itself; auto would couple the seeded samples: one-hot) and its overrides."""
    overrides = dict(VARIANTS[name][2])
    runner = {"runner": overrides.pop("runner")} if "runner" in overrides else {}  # a SpecConfig key
    speculation = SpecConfig(draft="model", model=draft, gamma=gamma, random="stream", **runner)
    return replace(MethodSpec(target=target, config=speculation), **overrides)


def study_markdown(rows: list[StudyRow], header: str) -> str:
    lines = [
        header,
        "",
        "| variant | lossless by construction | mean TV per step (max) | alpha | certificate | smallest Holm p | "
        "detectable TV (first token) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.description} | {'yes' if r.lossless_by_construction else 'no'} | {r.mean_tv:.2e} "
            f"({r.max_tv:.2e}) | {r.alpha:.3f} | {r.verdict} | {r.min_holm_p:.3g} | {r.detectable_tv:.3f} |"
        )
    return "\n".join(lines) + "\n"
