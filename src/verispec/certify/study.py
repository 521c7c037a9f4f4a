"""`verispec certify study`: the seed's failure modes, measured on real models, with the certificate's verdict.

For each variant of speculative decoding the study reports
  * the measured deviation: mean over real contexts of TV(law of the token emitted at a step's first position,
    p), where p is the fp32 target's processed distribution; contexts are the positions of continuations drawn
    from the fp32 target itself. For lossless variants it is 0 up to float rounding;
  * the acceptance alpha = mean sum_x min(p, q) the variant sees;
  * the certificate (`certify generate`) verdict at the chosen N and L, and whether it is lossless by construction.

Variants: exact verispec (control); temperature mismatch (drafts sampled at the requested temperature, q reported
before it, i.e. at temperature 1); the draft run in bf16 (still lossless: q is what was sampled); the target's
probabilities computed in bf16 / fp16 (the output follows the low-precision p); lenient acceptance (l = 0.5);
Medusa's typical acceptance (eps 0.3, delta 0.09); SPEC-RL's rollout-reuse rule (Liu et al. 2025: accept with
probability min(1, l p / q), at a rejection a fresh draw from p; q plays the old policy) at l = 1 and at
l = e^0.5 ~ 1.65, the lenience its training scripts use (`--bias 0.5`, applied as accept iff log u <= log(p / q) + 0.5).
"""

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
from .methods import MethodSpec, _load

__all__ = ["SPEC_RL_LENIENCE", "VARIANTS", "StudyRow", "run_study", "study_markdown"]

SPEC_RL_LENIENCE = math.exp(0.5)  # SPEC-RL's scripts: --bias 0.5, i.e. accept iff log u <= log(p / q) + 0.5
# name -> (description, lossless by construction, MethodSpec overrides)
VARIANTS: dict[str, tuple[str, bool, dict]] = {
    "exact": ("verispec, exact rule (control)", True, {}),
    "temperature-mismatch": (
        "temperature mismatch: q taken before temperature 0.7 (drafts sampled after it)",
        False,
        {"verifier": "q_before_temperature"},
    ),
    "draft-bf16": ("draft model run in bf16 (q = what the bf16 draft sampled from)", True, {"draft_dtype": "bfloat16"}),
    "target-bf16": ("target probabilities computed in bf16", False, {"dtype": "bfloat16", "runner": "hf"}),
    "target-fp16": ("target probabilities computed in fp16", False, {"dtype": "float16", "runner": "hf"}),
    "lenient-0.5": ("lenient acceptance, l = 0.5", False, {"verifier": "lenient:0.5"}),
    "typical": ("typical acceptance (Medusa, eps 0.3, delta 0.09)", False, {"verifier": "typical"}),
    "spec-rl": ("SPEC-RL rollout reuse, l = 1 (rejection: fresh draw from p)", False, {"verifier": "spec-rl"}),
    "spec-rl-lenient-e0.5": (
        "SPEC-RL rollout reuse, l = e^0.5 ~ 1.65 (its scripts' --bias 0.5)",
        False,
        {"verifier": f"spec-rl:{SPEC_RL_LENIENCE!r}"},
    ),
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


def _tv(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:  # [n, V] x2 -> [n]
    return 0.5 * (a - b).abs().sum(-1)


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


def _certificate(spec: MethodSpec, prompts, params, ref, **options) -> tuple[str, float, float]:
    """(verdict, the first-token tests' largest detectable TV, the smallest Holm p) of the generator certificate."""
    rep = certify_generate(spec, prompts, params, reference=ref, **options)
    det = max(t.detectable for t in rep.tests if t.kind == "first-token")
    return rep.verdict, det, min(t.holm_pvalue for t in rep.tests)


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
    """Measure how far classic mistakes move the output, on real contexts (`verispec certify study`).

    For each variant (the exact rule, temperature mismatch, a bf16 draft, a bf16 / fp16 target, lenient and
    typical acceptance, SPEC-RL's rollout reuse) it measures the mean total variation of a step's first emitted
    token from the fp32 target, over `contexts` continuations (x `length` positions) per prompt drawn from the
    fp32 target.

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

    Raises:
        ValueError: Temperature 0, or an unknown variant.
    """
    if params.temperature == 0:
        raise ValueError("the study needs temperature > 0 (at temperature 0 every variant here is exact)")
    names = list(VARIANTS) if variants is None else variants
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        raise ValueError(f"unknown variant(s) {', '.join(unknown)}; known: {', '.join(VARIANTS)}")
    ref = _load(target, "float32")
    vocab = min(len(ref.tokenizer), ref.model.get_output_embeddings().weight.shape[0])
    plain = MethodSpec(method="plain", target=target)
    samples, _, _ = draw_samples(
        plain,
        prompts,
        params,
        contexts,
        length,
        seed + 4_242_000,
        show_progress=show_progress,
        label="contexts (plain decoding)",
    )
    p32 = _probs(ref.model, prompts, samples, params, vocab)  # [contexts, V]
    q32 = _probs(_load(draft, "float32").model, prompts, samples, params, vocab)
    paths = {"target": target, "draft": draft}

    def probs_of(role: str, dtype: str) -> torch.Tensor:
        return _probs(_load(paths[role], dtype).model, prompts, samples, params, vocab)

    rows = []
    for name in names:
        desc, lossless, overrides = VARIANTS[name]
        law, q = _variant_law(name, p32, q32, probs_of)
        tv = _tv(law, p32)
        alpha = torch.minimum(p32 if not name.startswith("target") else law, q).sum(-1)
        verdict, det, min_p = "-", float("nan"), float("nan")
        if certify_samples > 0:
            runner = {"runner": overrides["runner"]} if "runner" in overrides else {}  # a SpecConfig key
            # random=stream: the variants' verifiers see p itself (auto would couple the seeded samples: one-hot)
            speculation = SpecConfig(draft="model", model=draft, gamma=gamma, random="stream", **runner)
            rest = {k: v for k, v in overrides.items() if k != "runner"}
            spec = replace(MethodSpec(target=target, config=speculation), **rest)
            verdict, det, min_p = _certificate(
                spec,
                prompts,
                params,
                ref,
                samples=certify_samples,
                length=certify_length,
                level=level,
                seed=seed,
                show_progress=show_progress,
            )
        rows.append(
            StudyRow(name, desc, lossless, float(tv.mean()), float(tv.max()), float(alpha.mean()), verdict, det, min_p)
        )
    return rows


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
