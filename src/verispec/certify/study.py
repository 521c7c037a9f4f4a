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
Medusa's typical acceptance (eps 0.3, delta 0.09).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..sampling import SamplingParams, probs_from_logits
from ..sampling.lossy import one_step_law_lenient, one_step_law_mismatched_q, one_step_law_typical
from .bugs import _Q_TEMPERATURE
from .generate import MethodSpec, _load, certify_generate, draw_samples

__all__ = ["VARIANTS", "StudyRow", "run_study", "study_markdown"]

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
    """Measure each variant's deviation on `contexts` continuations (x `length` positions) per prompt drawn from
    the fp32 target; with certify_samples > 0 also run the generator certificate on each variant."""
    if params.temperature == 0:
        raise ValueError("the study needs temperature > 0 (at temperature 0 every variant here is exact)")
    names = list(VARIANTS) if variants is None else variants
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        raise ValueError(f"unknown variant(s) {', '.join(unknown)}; known: {', '.join(VARIANTS)}")
    ref = _load(target, "float32")
    vocab = min(len(ref.tokenizer), ref.model.get_output_embeddings().weight.shape[0])
    plain = MethodSpec(method="plain", target=target)
    samples, _ = draw_samples(
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
    rows = []
    for name in names:
        desc, lossless, overrides = VARIANTS[name]
        if name == "exact":
            law, q = one_step_law_mismatched_q(p32, q32, q32), q32
        elif name == "temperature-mismatch":
            q_used = q32.pow(_Q_TEMPERATURE)  # the bug's q: before temperature 0.7 (exact when T = 0.7)
            q_used = q_used / q_used.sum(-1, keepdim=True)
            law, q = one_step_law_mismatched_q(p32, q32, q_used), q32
        elif name == "draft-bf16":
            q = _probs(_load(draft, "bfloat16").model, prompts, samples, params, vocab)
            law = one_step_law_mismatched_q(p32, q, q)
        elif name in ("target-bf16", "target-fp16"):
            law = _probs(_load(target, overrides["dtype"]).model, prompts, samples, params, vocab)
            q = q32
        elif name == "lenient-0.5":
            law, q = one_step_law_lenient(p32, q32, 0.5), q32
        else:
            law, q = one_step_law_typical(p32, q32), q32
        tv = _tv(law, p32)
        alpha = torch.minimum(p32 if not name.startswith("target") else law, q).sum(-1)
        verdict, det, min_p = "-", float("nan"), float("nan")
        if certify_samples > 0:
            spec = replace(MethodSpec(target=target, draft=draft, gamma=gamma), **overrides)
            rep = certify_generate(
                spec,
                prompts,
                params,
                samples=certify_samples,
                length=certify_length,
                level=level,
                seed=seed,
                reference=ref,
                show_progress=show_progress,
            )
            verdict = rep.verdict
            det = max(t.detectable for t in rep.tests if t.kind == "first-token")
            min_p = min(t.holm_pvalue for t in rep.tests)
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
