"""Scoring a generator's samples under the target, and the generator certificate's tests: the exact tests (first
token, first-m-token sequence, PIT uniformity, log-likelihood), the two-sample tests, each test's sizing, where a
rejected test deviates, and the logprob-parity table. With a constraint the exact law is the constrained one: p at
output position t is processed with the grammar's mask after x_<t (`probs_from_logits(..., allowed=...)`), read
along each scored prefix (`GrammarState.mask(x_<t)`); a sample ends at its EOS, scored like any token.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from ..sampling import SamplingParams, probs_from_logits
from .kernel import samples_needed
from .report import TestResult
from .stats import (
    chisquare_gof,
    chisquare_two_sample,
    detectable_tv,
    holm,
    loglik_test,
    pit_uniformity,
    tolerant_tv_test,
)

__all__ = ["PARITY_THRESHOLD", "Scores", "exact_sequence_law", "logprob_parity", "score", "top_deviations"]

PARITY_THRESHOLD = 1e-3  # logprob parity: the fraction of tokens whose |difference| exceeds this is reported


@dataclass
class Scores:
    """Per emitted token, flattened over samples and positions (in sample order)."""

    logp: list[float] = field(default_factory=list)  # log p_t(x_t)
    raw_logp: list[float] = field(default_factory=list)  # log softmax(logits_t)(x_t): temperature 1, no truncation
    key: list[tuple] = field(default_factory=list)  # (the sample's key: (prompt, sample index), position)
    expected: list[float] = field(default_factory=list)  # sum_x p_t(x) log p_t(x)
    variance: list[float] = field(default_factory=list)  # Var_{x ~ p_t}[log p_t(x)]
    pit: list[float] = field(default_factory=list)  # randomized PIT value
    position: list[int] = field(default_factory=list)


@torch.no_grad()
def score(
    model,
    prompt: list[int],
    samples: list[list[int]],
    params: SamplingParams,
    rng: np.random.Generator,
    out: Scores,
    chunk: int = 8,
    keys=None,
    eos: Sequence[int] = (),
    grammar=None,
    on_scored=None,
):
    """Score samples of one prompt under the processed target; returns p(. | prompt) [V] (float64).
    on_scored(k): called after each batch of k samples (a progress display).
    keys: each sample's key (recorded in out.key with each token's position; default 0, 1, ...). eos: an EOS set
    scored as one outcome, eos[0] (the probabilities of the others moved onto it). grammar: a structured-output
    `GrammarState` at the start of the output (None: unconstrained); p at position t is masked after s[:t]."""
    dev = next(model.parameters()).device
    first = None
    by_len: dict[int, list[tuple[int, list[int]]]] = {}
    for key, s in zip(range(len(samples)) if keys is None else keys, samples):
        by_len.setdefault(len(s), []).append((key, s))
    for length, keyed in by_len.items():
        if length == 0:
            continue
        for i in range(0, len(keyed), chunk):
            part = [s for _, s in keyed[i : i + chunk]]
            out.key += [(key, t) for key, _ in keyed[i : i + chunk] for t in range(length)]
            ids = torch.tensor([prompt + s[:-1] for s in part], device=dev)  # [b, P + L - 1]
            logits = model(input_ids=ids, logits_to_keep=length).logits[:, -length:].float()  # [b, L, V]
            allowed = grammar_masks(grammar, part, length, logits.shape[-1], dev)  # [b, L, V] or None
            p = _merge(probs_from_logits(logits, params, allowed=allowed).double(), eos)  # [b, L, V]
            if first is None:
                first = p[0, 0].cpu().numpy()
            tok = torch.tensor(part, device=dev).unsqueeze(-1)  # [b, L, 1]
            px = p.gather(-1, tok).squeeze(-1)
            out.raw_logp += torch.log_softmax(logits.double(), -1).gather(-1, tok).flatten().tolist()
            before = p.cumsum(-1).gather(-1, tok).squeeze(-1) - px
            logp_all = torch.where(p > 0, p.clamp_min(1e-300).log(), torch.zeros_like(p))
            e = (p * logp_all).sum(-1)
            var = (p * logp_all**2).sum(-1) - e**2
            v = torch.from_numpy(rng.random(px.shape)).to(dev)
            logpx = torch.where(px > 0, px.clamp_min(1e-300).log(), torch.full_like(px, -math.inf))
            out.logp += logpx.flatten().tolist()
            out.expected += e.flatten().tolist()
            out.variance += var.clamp_min(0).flatten().tolist()
            out.pit += (before + v * px).flatten().tolist()
            out.position += list(range(length)) * len(part)
            if on_scored is not None:
                on_scored(len(part))
    if first is None:
        logits = model(input_ids=torch.tensor([prompt], device=dev), logits_to_keep=1).logits[:, -1:].float()
        allowed = grammar_masks(grammar, [[]], 1, logits.shape[-1], dev)
        first = _merge(probs_from_logits(logits, params, allowed=allowed).double(), eos)[0, 0].cpu().numpy()
    return first


def grammar_masks(grammar, samples: Sequence[Sequence[int]], length: int, V: int, device):
    """[b, length, V] bool: the grammar's mask at each position t of each sample (after its tokens s[:t]); None
    without a grammar. A position where the grammar allows nothing (a prefix it cannot continue: no engine could
    have sampled past it) allows every token, so that a broken engine's output is scored instead of raising; the
    state's per-path cache is cleared after the batch (`advance(())`)."""
    if grammar is None:
        return None
    out = torch.ones((len(samples), length, V), dtype=torch.bool)
    for i, s in enumerate(samples):
        for t in range(length):
            m = grammar.mask(tuple(s[:t]))[:V]
            if bool(m.any()):
                out[i, t, : m.shape[0]] = m
    grammar.advance(())
    return out.to(device)


def _merge(p, eos: Sequence[int]):
    """p [..., V] with the probabilities of eos[1:] moved onto eos[0] (one outcome, "the sequence ended")."""
    if len(eos) <= 1:
        return p
    rest = list(eos[1:])
    p[..., eos[0]] += p[..., rest].sum(-1)
    p[..., rest] = 0
    return p


@torch.no_grad()
def exact_sequence_law(
    model, prompt: list[int], params: SamplingParams, m: int, grammar=None, eos: Sequence[int] = ()
) -> np.ndarray:
    """P(x_1..x_m | prompt) under the processed target, flattened over V^m sequences (small V only). grammar: the
    constrained law (each prefix's mask); a sequence ended by an id of `eos` is padded with eos[0] (the samples'
    padding in _exact_tests), so its mass stays on one sequence of length m."""
    dev = next(model.parameters()).device
    joint = torch.ones(1, dtype=torch.float64, device=dev)
    prefixes = torch.empty((1, 0), dtype=torch.int64, device=dev)
    V = None
    for _ in range(m):
        n = prefixes.shape[0]
        ids = torch.cat([torch.tensor(prompt, device=dev).expand(n, -1), prefixes], 1)
        logits = model(input_ids=ids, logits_to_keep=1).logits[:, -1].float()
        rows = prefixes.tolist()
        allowed = None if grammar is None else grammar_masks(grammar, rows, len(rows[0]) + 1, logits.shape[-1], dev)
        p = probs_from_logits(logits, params, allowed=None if allowed is None else allowed[:, -1]).double()
        if grammar is not None and eos:
            ended = torch.tensor([any(t in eos for t in r) for r in rows], device=dev)
            p[ended] = 0.0
            p[ended, eos[0]] = 1.0
        V = p.shape[-1]
        joint = (joint.unsqueeze(1) * p).reshape(-1)
        prefixes = torch.cat([prefixes.repeat_interleave(V, 0), torch.arange(V, device=dev).repeat(n).unsqueeze(1)], 1)
    return joint.cpu().numpy()


def _exact_tests(
    model, prompts, got, params, rng, sc: Scores, m: int, tolerance=0.0, eos=(), grammar=None, on_scored=None
):
    """Score every sample into `sc`; per prompt the first-token test (of TV <= tolerance, when given) and, for small
    vocabularies without a tolerance or an EOS set, the first-m-token sequence test (samples that ended at EOS padded
    with eos[0]). Returns the tests, (test, law, n) per chi-square test and (test, ToleranceResult) per tolerance test."""
    V = model.get_output_embeddings().weight.shape[0]
    tests: list[TestResult] = []
    laws, tolerant = [], []
    for j, group in enumerate(got):
        keys = [(j, i) for i, s in enumerate(group) if s]
        kept = [s for s in group if s]
        first = score(
            model, prompts[j], kept, params, rng, sc, keys=keys, eos=eos, grammar=grammar, on_scored=on_scored
        )
        first = first / first.sum()
        counts = np.bincount([s[0] for s in group if s], minlength=V)[:V]
        if tolerance:
            r = tolerant_tv_test(counts, first, tolerance)
            name, effect = f"prompt{j}/first-token-tv<={tolerance:g}", f"TV over {r.bins} bins"
            tests.append(TestResult(name, "first-token", r.tv, r.pvalue, r.n, 0.0, effect))
            tolerant.append((tests[-1], r))
        else:
            g = chisquare_gof(counts, first)
            tests.append(TestResult(f"prompt{j}/first-token", "first-token", g.statistic, g.pvalue, g.n, 0.0, "TV"))
            laws.append((tests[-1], first, g.n))
        tests[-1].deviations = top_deviations(counts, first)
        seqs = group if grammar is None else [_pad_ended(s, m, eos) for s in group]
        if not tolerance and len(eos) <= 1 and m >= 2 and V**m <= 4096 and all(len(s) >= m for s in seqs):
            law = exact_sequence_law(model, prompts[j], params, m, grammar, eos)
            idx = np.array([sum(t * V ** (m - 1 - i) for i, t in enumerate(s[:m])) for s in seqs])
            g = chisquare_gof(np.bincount(idx, minlength=V**m), law / law.sum())
            tests.append(TestResult(f"prompt{j}/first-{m}-tokens", "sequence", g.statistic, g.pvalue, g.n, 0.0, "TV"))
            laws.append((tests[-1], law / law.sum(), g.n))
    return tests, laws, tolerant


def _pad_ended(s: list[int], m: int, eos: Sequence[int]) -> list[int]:
    """A sample that ended at an EOS-set id before m tokens, padded to m with eos[0] (else as it is)."""
    if eos and 0 < len(s) < m and s[-1] in eos:
        return s + [eos[0]] * (m - len(s))
    return s


def top_deviations(counts: np.ndarray, probs: np.ndarray, top: int = 5) -> list[dict]:
    """The `top` tokens whose observed frequency differs most from `probs` (the law, or the reference's
    frequencies), largest first: how a rejected test deviates."""
    freq = counts / max(1, counts.sum())
    order = np.argsort(-np.abs(freq - probs), kind="stable")[:top]
    return [{"token": int(i), "observed": float(freq[i]), "expected": float(probs[i])} for i in order]


def _fit_tests(sc: Scores, tests: list[TestResult]):
    """Append the PIT-uniformity and log-likelihood tests (exact equality); returns their results."""
    u = pit_uniformity(sc.pit)
    tests.append(TestResult("all/pit-uniformity", "pit", u.statistic, u.pvalue, u.n, 0.0, "KS distance"))
    ll = loglik_test(sc.logp, sc.expected, sc.variance)
    tests.append(TestResult("all/log-likelihood", "loglik", ll.z, ll.pvalue, ll.n, 0.0, "nats/token"))
    return u, ll


def _two_sample_tests(got, ref_samples, m: int, V: int, tests: list[TestResult], laws: list) -> None:
    """Tokens at positions 0..m-1 against plain decoding's, per prompt (chi-square homogeneity)."""
    for j, (a, b) in enumerate(zip(got, ref_samples)):
        for t in range(m):
            ca = np.bincount([s[t] for s in a if len(s) > t], minlength=V)[:V]
            cb = np.bincount([s[t] for s in b if len(s) > t], minlength=V)[:V]
            g = chisquare_two_sample(ca, cb)
            tests.append(
                TestResult(f"prompt{j}/two-sample-pos{t}", "two-sample", g.statistic, g.pvalue, g.n, 0.0, "TV")
            )
            tests[-1].deviations = top_deviations(ca, cb / max(1, cb.sum()))
            pooled = (ca + cb) / max(1, (ca + cb).sum())
            laws.append((tests[-1], pooled, ca.sum() * cb.sum() / max(1, ca.sum() + cb.sum())))


def _size_tests(tests: list[TestResult], laws, per_test: float, power: float, pit_loglik, tolerant=()) -> None:
    """Each test's detectable effect (from its law; the PIT and log-likelihood results' own, when run; a tolerance
    test's from its ToleranceResult) and Holm p-value."""
    for t, law, n in laws:
        t.detectable = detectable_tv(law, n, per_test, power)
    for t, r in tolerant:
        t.detectable = r.detectable(per_test, power)
    for r, kind in zip(pit_loglik or (), ("pit", "loglik")):
        tests[[t.kind for t in tests].index(kind)].detectable = r.detectable(per_test, power)
    for t, a in zip(tests, holm([t.pvalue for t in tests])):
        t.holm_pvalue = float(a)


def _samples_needed(laws, samples: int, per_test: float, power: float) -> int | None:
    """When a first-token test has no power: the continuations per prompt at which every one detects TARGET_TV."""
    first = [(t, law, n) for t, law, n in laws if t.kind == "first-token"]
    if all(t.powered for t, _, _ in first):
        return None
    return samples_needed([(law, n) for _, law, n in first], samples, per_test, power)


def logprob_parity(sc: Scores, logprobs: list[list]) -> dict | None:
    """The method's returned logprobs against the float32 recompute of the same tokens: against the raw
    log-softmax (what engines return by default) and against the processed distribution (temperature, top-k/p);
    max / mean |difference|, the fraction over PARITY_THRESHOLD, and per position. None when none were returned."""
    kept = []  # (returned, raw recompute, processed recompute, position) per compared token
    for ((j, i), t), r, q in zip(sc.key, sc.raw_logp, sc.logp):
        lp = logprobs[j][i] if j < len(logprobs) and i < len(logprobs[j]) else None
        if lp is not None and t < len(lp) and math.isfinite(lp[t]):
            kept.append((lp[t], r, q, t))
    if not kept:
        return None
    got_a, raw, proc, pos_a = (np.array(column) for column in zip(*kept))

    def summary(ref: np.ndarray) -> dict:
        d = np.abs(got_a - ref)
        d = np.where(np.isfinite(d), d, np.inf)  # a -inf recompute (a token outside the support) counts as inf
        per = [
            {"position": int(t), "max": float(d[pos_a == t].max()), "mean": float(d[pos_a == t].mean())}
            for t in np.unique(pos_a)
        ]
        over = float((d > PARITY_THRESHOLD).mean())
        return dict(max_abs=float(d.max()), mean_abs=float(d.mean()), frac_over_threshold=over, per_position=per)

    return {"tokens": len(kept), "threshold": PARITY_THRESHOLD, "raw": summary(raw), "processed": summary(proc)}
