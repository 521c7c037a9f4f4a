"""Known bugs: small samplers that each reproduce a distribution bug a public engine shipped, run through verispec's
certificates. Every bug must FAIL, and verispec's own samplers next to them must PASS (`verispec certify
known-bugs`).

Three kinds of entry:
  chain-step      a chain verifier (verify_chain's interface) against the token-wise one-step laws
                  (verispec.certify.kernel.certify_kernel, laws="step"), on the default cases where the bug bites
  chain-sequence  the same against the completed-sequence laws every lossless rule keeps (laws="sequence"): block
                  verification, Gumbel coupling, position seeding
  tail            a categorical draw sampler(weights [B, V]) -> [B] against the tail test below

Each chain entry is a real certificate at family-wise level `level` (Holm over its chi-square tests); its verdict
is the kernel report's. Sizes are chosen per entry (small where the bug is blatant); `stated_power` is the power
of the default size to FAIL the bug, estimated as below from a run at 5x the default size (the slow tests rerun
that estimate and require >= 0.99 for every bug).

Estimated power (`estimated_power`): from a run at n_big samples per case, a test's noncentrality per sample is
lambda ~ max(0, chi2 - dof) / n_big; at n samples its power is ncx2.sf(chi2.isf(a', dof), dof, lambda n) at the
per-test level a' = level / (number of tests), Holm's first step (so the power of the whole certificate is at
least the largest of these). A test that saw m impossible outcomes (probability 0 under the law) rejects at any
level as soon as one occurs: power 1 - (1 - m / n_big)^n.

Stated power of the default sizes (estimated at 5x, seed 0; the slow tier recomputes it): every chain bug >= 0.9999.
resample_from_p, resample_from_abs_diff, spec_rl, spec_rl_lenient (random-k1, 500 steps): a recovered token the
exact residual gives probability 0, at 0.12-0.27 per step (1 - power < 1e-15); q_before_temperature (equal-k4,
1000): a rejection where p == q, 0.31 per step; le_zero_uniform (1000): an accepted p = 0 draft, 0.016 per step of
sparse-disjoint-zeros-k4 (1 - power 1.5e-7); wrong_q_raw_logits (truncated-k4, 1000): a recovered token outside
the exact residual, 0.027 per step (2e-12); bonus_ignores_temperature (equal-k4, every step reaches the bonus,
1000): chi2 1594 on 25 dof at 5000, noncentrality 314 at 1000 (1 - power < 1e-15); block_plain_residual
(small-vocab-k2, 15 000): pair0, chi2 641 on 63 dof at 75 000, power 0.9999 (1 - power 1e-4; 0.87 at half the
size); fp32_exponential_race (53 000 races): exact binomial power 0.9927.

The tail test (vLLM PR #43150: float32 exponential-race sampling never draws E below 2^-24, so "200M fp32
exponential samples had min exactly 2^-24 and zero samples below 2^-24 ... expected tail hits were 32.76; fp32
produced 0"). One head token of weight 1 and T tail tokens of weight r each, below the floor f = 2^-24 (here
r = f / 4, T = 2^14 - 1). Exactly, the tail wins with probability Tr / (1 + Tr). In the race argmax w / E a tail
token's score is r / E_i <= r / f under the floor, the head's 1 / E_head: a tail token can only win when
E_head > c = f / r (= 4), and then (E_i clamped at f still wins, since f < r E_head) with the exact conditional
probability 1 - exp(-T r E_head). So the floored race gives the tail
    P_floor = integral_c^inf e^-e (1 - e^(-T r e)) de = e^-c - e^(-c (1 + Tr)) / (1 + Tr) ~ (1 + c) e^-c T r,
0.092 of the exact mass at c = 4: 91% of the tail is lost. The test draws n races (in chunks, < 100 MB), counts
tail hits and runs an exact two-sided binomial test (scipy.stats.binomtest) against the exact mass. Default
n = TAIL_DRAWS = 53 000: 12.9 expected tail hits exactly, 1.18 under the floor; exact binomial power 0.9927 to FAIL
the floored race at level 0.01 (the power is not monotone in n, the test being discrete: 53 000 is a round size near
the smallest with power >= 0.99; 52 500 has 0.9929). Each race costs n (T + 1) = 8.7e8 exponentials, about the least that reaches
power 0.99 (the tail's information comes from E below ~f, probability ~f per token, whatever T and r are; c near 4
minimises n T): so the tail test is the slow part of the default run, 10-30 s per race on a 2-core CPU (seconds
in the report). The controls, verispec's sample_from_weights (inverse CDF with float64 uniforms; under a second)
and the exponential race with float64 exponentials (race_winner), run the same test at the same size and PASS.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
from scipy import stats
from torch import Tensor

from .bugs import EXP_FLOOR, broken_block_verifier, broken_verifier, fp32_exponential_race
from .kernel import (
    POWER,
    TestRow,
    _cell,
    certify_kernel,
    default_cases,
    verispec_block_sampler,
    verispec_sampler,
    write_md_json,
)

__all__ = [
    "KINDS",
    "KNOWN_BUGS",
    "TAIL",
    "TAIL_DRAWS",
    "KnownBug",
    "KnownBugRow",
    "KnownBugsReport",
    "TailSpec",
    "binomial_power",
    "estimated_power",
    "run_known_bugs",
    "select_entries",
    "tail_test",
    "write_report",
]

KINDS = ("chain-step", "chain-sequence", "tail")
TAIL_DRAWS = 53_000  # races per tail-test sampler by default (module docstring)


@dataclass(frozen=True)
class TailSpec:
    """One head token of weight 1, then `tail` tokens of weight `ratio` each (module docstring)."""

    tail: int = 2**14 - 1
    ratio: float = EXP_FLOOR / 4
    floor: float = EXP_FLOOR

    @property
    def vocab(self) -> int:
        return self.tail + 1

    @property
    def exact_mass(self) -> float:
        """P(a tail token wins) for an exact categorical draw: T r / (1 + T r)."""
        tr = self.tail * self.ratio
        return tr / (1 + tr)

    @property
    def floored_mass(self) -> float:
        """P(a tail token wins) in the race argmax w / max(E, floor): e^-c - e^(-c (1 + Tr)) / (1 + Tr), c = f / r."""
        tr, c = self.tail * self.ratio, self.floor / self.ratio
        return math.exp(-c) - math.exp(-c * (1 + tr)) / (1 + tr)

    def weights(self, rows: int) -> Tensor:  # [rows, vocab] float64
        w = torch.full((rows, self.vocab), self.ratio, dtype=torch.float64)
        w[:, 0] = 1.0
        return w


TAIL = TailSpec()


def sample_from_weights_control(weights: Tensor) -> Tensor:
    """verispec.sampling.chain.sample_from_weights with float64 uniforms from torch's global generator."""
    from ..sampling.chain import sample_from_weights

    return sample_from_weights(weights, torch.rand(weights.shape[0], dtype=torch.float64, device=weights.device))


def race_fp64_control(weights: Tensor) -> Tensor:
    """verispec.sampling.coupling.race_winner with float64 Exp(1) noise (-log U, U a float64 uniform)."""
    from ..sampling.coupling import race_winner

    exps = torch.empty(weights.shape, dtype=torch.float64, device=weights.device).uniform_().log_().neg_()
    return race_winner(weights, exps)


@dataclass(frozen=True)
class KnownBug:
    name: str
    engine: str
    reference: str  # issue / PR URL or paper
    what: str  # one line
    make: Callable[[], Callable]  # -> the sampler (chain: verify_chain's interface; tail: weights [B, V] -> [B])
    kind: str  # one of KINDS
    cases: tuple[str, ...] | None = None  # default_cases names where it bites (None: every case)
    expected: str = "FAIL"
    samples: int = 2000  # default size: speculative steps per case (tail: races)
    full_samples: int = 20_000  # the slow tier's size (--full; chain entries then run every default case)
    stated_power: float | None = None  # power of the default size to FAIL the bug (module docstring)


def _spec_rl(lenient: bool):
    from ..sampling.lossy import spec_rl_verifier

    if not lenient:
        return spec_rl_verifier(1.0)
    from .study import SPEC_RL_LENIENCE

    return spec_rl_verifier(SPEC_RL_LENIENCE)


def _gumbel():
    from ..sampling.coupling import gumbel_verifier

    return gumbel_verifier


def _positional():
    from ..sampling.positional import positional_verifier

    return positional_verifier


_VLLM_TEMPERATURE = "https://github.com/vllm-project/vllm/issues/9834"
_HF_TEMPERATURE = "https://github.com/huggingface/transformers/issues/32867"
_SEED = "seed tutorial §8 (shared/DESIGN.md)"
_CHAIN_CONTROL_CASES = ("random-k1", "equal-k4", "onehot-k4", "sparse-disjoint-zeros-k4", "truncated-k4")
_SEQUENCE_CONTROL_CASES = ("small-vocab-k2", "random-k4", "ragged-high-entropy-k4")


def _chain_bug(name: str, engine: str, reference: str, what: str, cases, samples: int, make=None, kind="chain-step"):
    """A chain bug's entry: broken_verifier's bug `name` unless `make` says otherwise, FAILED at `samples` steps
    per case with the stated power 0.9999 (module docstring)."""
    make = functools.partial(broken_verifier, name) if make is None else make
    return KnownBug(name, engine, reference, what, make, kind, cases, samples=samples, stated_power=0.9999)


def _control(name: str, reference: str, what: str, make, kind: str, cases=None, samples: int = TAIL_DRAWS):
    """One of verispec's own samplers next to the bugs, through the same tests: it must PASS."""
    sizes = dict(samples=samples, full_samples=4 * TAIL_DRAWS) if kind == "tail" else dict(samples=samples)
    return KnownBug(name, "verispec", reference, what, make, kind, cases, expected="PASS", **sizes)


KNOWN_BUGS: tuple[KnownBug, ...] = (
    _chain_bug(
        "resample_from_p",
        "textbook mistake",
        _SEED,
        "at a rejection, a fresh draw from p instead of the residual (p - q)+ / Z",
        ("random-k1",),
        500,
    ),
    _chain_bug(
        "resample_from_abs_diff",
        "textbook mistake",
        _SEED,
        "at a rejection, a draw from |p - q| instead of (p - q)+",
        ("random-k1",),
        500,
    ),
    _chain_bug(
        "q_before_temperature",
        "vLLM; HF transformers",
        f"{_VLLM_TEMPERATURE} ; {_HF_TEMPERATURE}",
        "drafts sampled at temperature 0.7, the verifier given q at temperature 1 (q^0.7 renormalized)",
        ("random-k1", "equal-k4"),
        1000,
    ),
    _chain_bug(
        "le_zero_uniform",
        "SGLang",
        "https://github.com/sgl-project/sglang/issues/35771",
        "`u * q <= p` with a uniform that can be exactly 0: a draft with p = 0 can be accepted",
        ("onehot-k4", "sparse-disjoint-zeros-k4"),
        1000,
    ),
    _chain_bug(
        "bonus_ignores_temperature",
        "EAGLE",
        "EAGLE reference code, 2024-25 (bonus token sampled without the request's temperature/top-p)",
        "the bonus token (every draft accepted) drawn from p before temperature 0.7 (p^0.7 renormalized)",
        ("equal-k4", "random-k1"),
        1000,
    ),
    _chain_bug(
        "wrong_q_raw_logits",
        "HF transformers",
        "https://github.com/huggingface/transformers/issues/47932 (fix: PR #47961)",
        "drafts sampled from the top-k-processed q, the verifier given the raw q (ratio inflated by 1 / Z)",
        ("truncated-k4",),
        1000,
    ),
    _chain_bug(
        "block_plain_residual",
        "vllm-ascend",
        "https://github.com/vllm-project/vllm-ascend/issues/7807",
        "block verification's decision, then the token-wise residual (p - q)+ instead of (rho p - q)+",
        ("small-vocab-k2",),
        15_000,
        make=functools.partial(broken_block_verifier, "block_plain_residual"),
        kind="chain-sequence",
    ),
    _chain_bug(
        "spec_rl",
        "SPEC-RL",
        "SPEC-RL rollout reuse (Liu et al. 2025), l = 1",
        "accept an old rollout's token with min(1, p / q), at a rejection a fresh draw from p",
        ("random-k1",),
        500,
        make=functools.partial(_spec_rl, False),
    ),
    _chain_bug(
        "spec_rl_lenient",
        "SPEC-RL",
        "SPEC-RL rollout reuse (Liu et al. 2025), its scripts' lenience l = e^0.5",
        "accept with min(1, l p / q), l = e^0.5 ~ 1.65, at a rejection a fresh draw from p",
        ("random-k1",),
        500,
        make=functools.partial(_spec_rl, True),
    ),
    KnownBug(
        "fp32_exponential_race",
        "vLLM",
        "https://github.com/vllm-project/vllm/pull/43150",
        "exponential-race sampling with float32 Exp(1) noise that never falls below 2^-24: the far tail is lost",
        lambda: fp32_exponential_race,
        "tail",
        samples=TAIL_DRAWS,
        full_samples=4 * TAIL_DRAWS,
    ),
    # controls: verispec's own samplers, next to the bugs (the same tests; they must PASS)
    _control(
        "verify_chain",
        "verispec.sampling.chain.verify_chain",
        "control: the exact token-wise rule, on the chain bugs' cases",
        lambda: verispec_sampler,
        "chain-step",
        _CHAIN_CONTROL_CASES,
        1000,
    ),
    _control(
        "verify_block",
        "verispec.sampling.block.verify_block",
        "control: block verification against the sequence laws",
        lambda: verispec_block_sampler,
        "chain-sequence",
        _SEQUENCE_CONTROL_CASES,
        15_000,
    ),
    _control(
        "gumbel_verifier",
        "verispec.sampling.coupling.gumbel_verifier",
        "control: Gumbel-coupled verification against the sequence laws",
        _gumbel,
        "chain-sequence",
        _SEQUENCE_CONTROL_CASES,
        15_000,
    ),
    _control(
        "positional_verifier",
        "verispec.sampling.positional.positional_verifier",
        "control: position-seeded verification against the sequence laws",
        _positional,
        "chain-sequence",
        _SEQUENCE_CONTROL_CASES,
        15_000,
    ),
    _control(
        "sample_from_weights",
        "verispec.sampling.chain.sample_from_weights",
        "control: inverse-CDF sampling with float64 uniforms, on the tail test",
        lambda: sample_from_weights_control,
        "tail",
    ),
    _control(
        "race_winner_fp64",
        "verispec.sampling.coupling.race_winner",
        "control: the exponential race with float64 Exp(1) noise, on the tail test",
        lambda: race_fp64_control,
        "tail",
    ),
)


@dataclass
class KnownBugRow:
    name: str
    engine: str
    reference: str
    what: str
    kind: str
    expected: str
    verdict: str
    min_holm_pvalue: float
    samples: int  # speculative steps per case (tail: races)
    seconds: float
    ok: bool  # verdict == expected
    level: float
    cases: list[str] = field(default_factory=list)
    tests: list[TestRow] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    tail: dict | None = None  # tail test: hits, draws, exact_mass, floored_mass, expected_hits, pvalue, power
    stated_power: float | None = None  # at the registry's default size (None when the size was overridden)
    detectable_tv: float | None = None  # chain controls: the worst first-position detectable TV (power 0.99)


def tail_test(
    sampler: Callable[[Tensor], Tensor],
    draws: int,
    *,
    spec: TailSpec = TAIL,
    seed: int = 0,
    level: float = 0.01,
    chunk_elems: int = 2**21,
) -> dict:
    """Draw `draws` races of spec's weights from `sampler` (torch's global generator seeded with `seed`), count the
    tail hits (index > 0) and test them against the exact tail mass (exact two-sided binomial test); `power` is
    the test's exact power at `level` against the floored race's mass. Chunks of chunk_elems weights (16 MB in
    float64) keep memory small."""
    if draws < 1:
        raise ValueError(f"the tail test needs >= 1 draw, got {draws}")
    torch.manual_seed(seed)
    rows = max(1, chunk_elems // spec.vocab)
    w = spec.weights(rows)
    hits, done = 0, 0
    while done < draws:
        m = min(rows, draws - done)
        tok = torch.as_tensor(sampler(w[:m])).long().cpu()
        if tuple(tok.shape) != (m,) or bool(((tok < 0) | (tok >= spec.vocab)).any()):
            raise ValueError(f"the sampler returned {tuple(tok.shape)} (or an index outside [0, {spec.vocab}))")
        hits += int((tok > 0).sum())
        done += m
    p0 = spec.exact_mass
    pvalue = float(stats.binomtest(hits, draws, p0).pvalue)
    return dict(
        hits=hits,
        draws=draws,
        exact_mass=p0,
        floored_mass=spec.floored_mass,
        expected_hits=draws * p0,
        expected_hits_floored=draws * spec.floored_mass,
        pvalue=pvalue,
        power=binomial_power(draws, p0, spec.floored_mass, level),
        tail_tokens=spec.tail,
        ratio=spec.ratio,
        floor=spec.floor,
    )


def binomial_power(n: int, p0: float, p1: float, level: float) -> float:
    """Exact power of the two-sided binomial test of H0: rate p0 (scipy.stats.binomtest, reject when p < level)
    when the true rate is p1, at n trials."""
    hi = int(n * max(p0, p1) + 12 * math.sqrt(n * max(p0, p1) + 1) + 30)
    ks = np.arange(0, min(n, hi) + 1)
    reject = np.array([stats.binomtest(int(k), n, p0).pvalue < level for k in ks])
    return float(stats.binom.pmf(ks[reject], n, p1).sum())


def estimated_power(source, n: int, *, samples: int | None = None, level: float | None = None) -> float:
    """The power at n samples per case (tail: n races) to FAIL, estimated from a run (module docstring).

    source: a KnownBugRow (its tests and size; a tail row: exact binomial power against the floored race's mass),
    a KernelReport, or a sequence of TestRow with `samples` (the n_big they were run at) and `level`."""
    if isinstance(source, KnownBugRow) and source.kind == "tail":
        t = source.tail or {}
        if "exact_mass" not in t:
            return 0.0
        return binomial_power(n, t["exact_mass"], t["floored_mass"], source.level if level is None else level)
    if isinstance(source, KnownBugRow):
        tests, n_big, lvl = source.tests, source.samples, source.level
    elif hasattr(source, "tests") and hasattr(source, "samples_per_case"):
        tests, n_big, lvl = source.tests, source.samples_per_case, source.level
    else:
        if samples is None:
            raise ValueError("estimated_power of a list of tests needs samples= (the size they were run at)")
        tests, n_big, lvl = list(source), samples, level
    lvl = lvl if level is None else level
    if lvl is None or not tests:
        return 0.0
    per_test = lvl / len(tests)
    best = 0.0
    for t in tests:
        if t.impossible > 0:
            best = max(best, 1.0 - (1.0 - min(1.0, t.impossible / n_big)) ** n)
            continue
        lam = max(0.0, t.statistic - t.dof) / n_big if math.isfinite(t.statistic) else 0.0
        if t.dof > 0 and lam > 0:
            best = max(best, float(stats.ncx2.sf(stats.chi2.isf(per_test, t.dof), t.dof, lam * n)))
    return best


@dataclass
class KnownBugsReport:
    rows: list[KnownBugRow]
    level: float
    seed: int
    seconds: float
    sizes: str  # "default", "full", "overridden", "x5" ...

    @property
    def ok(self) -> bool:
        return bool(self.rows) and all(r.ok for r in self.rows)

    @property
    def mismatches(self) -> list[KnownBugRow]:
        return [r for r in self.rows if not r.ok]

    def to_json(self) -> dict:
        return asdict(self) | {"ok": self.ok}

    def to_markdown(self) -> str:
        bugs = sum(r.expected == "FAIL" for r in self.rows)
        verdict = "**ok**" if self.ok else f"**{len(self.mismatches)} mismatch(es)**"
        lines = [
            f"# verispec certify known-bugs: {verdict}",
            "",
            f"{_count(bugs, 'bug')} (engines' and textbook mistakes, each must FAIL) and "
            f"{_count(len(self.rows) - bugs, 'control')} (verispec's own samplers, each must PASS); family-wise "
            f"level {self.level} per entry (Holm over its tests; the tail test is one exact binomial test); seed "
            f"{self.seed}; sizes: {self.sizes}; {self.seconds:.1f} s.",
            "",
            "| bug | engine | reference | expected | verdict | p-value | samples | power | s |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r in self.rows:
            mark = r.verdict if r.ok else f"**{r.verdict}** (expected {r.expected})"
            power = (
                "-" if r.stated_power is None else "≥ 0.9999" if r.stated_power >= 0.9999 else f"{r.stated_power:.4f}"
            )
            lines.append(
                f"| `{r.name}` | {_cell(r.engine)} | {_cell(_link(r.reference))} | {r.expected} | {mark} | "
                f"{pvalue_cell(r)} | {r.samples} | {power} | {r.seconds:.1f} |"
            )
        lines += [
            "",
            "p-value: the smallest Holm-adjusted p-value of the entry's tests (0: an outcome impossible under the "
            "exact law was observed, or the p-value underflows). samples: speculative steps per case (tail: races). "
            "power: the probability that the default size FAILS the bug, estimated from a run at 5x that size "
            "(the tail test: its exact binomial power at this size against the floored race; "
            "verispec.certify.known_bugs).",
            "",
        ]
        for r in self.rows:
            lines.append(f"- `{r.name}` ({r.kind}{'; ' + ', '.join(r.cases) if r.cases else ''}): {r.what}")
            if r.tail:
                t = r.tail
                lines[-1] += (
                    f" — {t['hits']} tail hits in {t['draws']} races; exact {t['expected_hits']:.2f} expected, "
                    f"{t['expected_hits_floored']:.2f} under the 2^-24 floor"
                )
            lines += [f"  - error: {e}" for e in r.errors]
        return "\n".join(lines) + "\n"


def _link(ref: str) -> str:
    """A GitHub URL as a short markdown link (owner/repo#N), anything else unchanged."""
    out = []
    for part in ref.split(" ; "):
        head, _, rest = part.partition(" ")
        bits = head.rstrip("/").split("/")
        if head.startswith("https://github.com/") and len(bits) >= 7 and bits[-1].isdigit():
            short = f"{bits[3]}/{bits[4]}#{bits[-1]}"
            part = f"[{short}]({head})" + (f" {rest}" if rest else "")
        out.append(part)
    return "; ".join(out)


def pvalue_cell(r: KnownBugRow) -> str:
    p = r.min_holm_pvalue
    return "-" if not math.isfinite(p) else "0" if p == 0 else f"{p:.2g}"


def _count(n: int, what: str) -> str:
    return f"{n} {what}{'' if n == 1 else 's'}"


def select_entries(only: Sequence[str] | str | None) -> list[KnownBug]:
    """The registry's entries named in `only` (a list, or comma-separated), in registry order; every one if None."""
    if only is None:
        return list(KNOWN_BUGS)
    names = [s.strip() for s in (only.split(",") if isinstance(only, str) else only) if s.strip()]
    known = {b.name: b for b in KNOWN_BUGS}
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise ValueError(
            f"unknown known-bugs entr{'ies' if len(unknown) > 1 else 'y'} {', '.join(unknown) or '(none given)'}; "
            f"known: {', '.join(known)}"
        )
    return [b for b in KNOWN_BUGS if b.name in names]


def _size(bug: KnownBug, samples: int | None, tail_draws: int | None, full: bool, scale: float) -> int:
    """The entry's size: the override of its kind (races for the tail test, steps per case otherwise), else its
    default or full size times `scale`."""
    override = tail_draws if bug.kind == "tail" else samples
    return override if override is not None else round((bug.full_samples if full else bug.samples) * scale)


def _run_one(bug: KnownBug, n: int, level: float, seed: int, full: bool, progress) -> KnownBugRow:
    t0 = time.perf_counter()
    sampler = bug.make()
    common = dict(
        name=bug.name,
        engine=bug.engine,
        reference=bug.reference,
        what=bug.what,
        kind=bug.kind,
        expected=bug.expected,
        samples=n,
        level=level,
    )
    if bug.kind == "tail":
        try:
            t = tail_test(sampler, n, seed=seed, level=level)
        except Exception as e:  # a crash fails the entry, with the reason
            return KnownBugRow(
                **common,
                verdict="FAIL",
                min_holm_pvalue=float("nan"),
                seconds=time.perf_counter() - t0,
                ok=False,  # a crash is not the bug being caught: no entry is ok with errors
                errors=[f"the sampler raised {type(e).__name__}: {e}"],
            )
        rejected = t["pvalue"] < level
        verdict = "FAIL" if rejected else "PASS" if t["power"] >= POWER else "INCONCLUSIVE"
        return KnownBugRow(
            **common,
            verdict=verdict,
            min_holm_pvalue=t["pvalue"],
            seconds=time.perf_counter() - t0,
            ok=verdict == bug.expected,
            tail=t,
            stated_power=t["power"] if bug.expected == "FAIL" else None,  # exact, at this size
        )
    cases = default_cases()
    if bug.cases is not None and not full:
        cases = [c for c in cases if c.name in bug.cases]
    laws = "step" if bug.kind == "chain-step" else "sequence"
    report = certify_kernel(
        sampler,
        cases=cases,
        samples=n,
        level=level,
        seed=seed,
        name=bug.name,
        laws=laws,
        progress=(lambda c: progress(f"{bug.name}: {c}")) if progress else None,
    )
    holm = [t.holm_pvalue for t in report.tests]
    return KnownBugRow(
        **common,
        verdict=report.verdict,
        min_holm_pvalue=min(holm) if holm else float("nan"),
        seconds=time.perf_counter() - t0,
        ok=report.verdict == bug.expected and not report.errors,  # a FAIL must be statistical, not a crash
        cases=[c.name for c in cases],
        tests=report.tests,
        errors=report.errors,
        detectable_tv=report.headline_tv() if math.isfinite(report.headline_tv()) else None,
    )


def run_known_bugs(
    samples: int | None = None,
    tail_draws: int | None = None,
    level: float = 0.01,
    seed: int = 0,
    only: Sequence[str] | str | None = None,
    progress: Callable[[str], None] | None = None,
    *,
    full: bool = False,
    scale: float = 1.0,
) -> KnownBugsReport:
    """Reproduce distribution bugs that engines shipped, and check each FAILS while verispec's samplers PASS.

    Every entry (a small sampler with a known bug, or a control) runs through the kernel certificate (or, for
    float32 exponential-race noise, an exact tail test) at a size with power >= 0.99 to FAIL at level 0.01
    (`verispec certify known-bugs`).

    Args:
        samples: Speculative steps per case for every chain entry (default: each entry's own size; >= 100).
        tail_draws: The tail test's races (default TAIL_DRAWS).
        level: The family-wise significance level of each entry's certificate.
        seed: The random seed.
        only: The entries to run, by name (a list or a comma-separated string; default: all).
        progress: Called with a line of text as each entry finishes.
        full: The slow tier's sizes: chain entries on every default case.
        scale: Multiply each entry's own size (e.g. 5 for the power estimates).

    Returns:
        The report: each entry's verdict against its expectation; it passes only when every bug FAILED and every
        control PASSED.

    Raises:
        ValueError: A size or level out of range, or an unknown entry.
    """
    if not 0 < level < 1:
        raise ValueError(f"level must lie in (0, 1), got {level}")
    if samples is not None and samples < 100:
        raise ValueError(f"samples must be >= 100 per case, got {samples}")
    if tail_draws is not None and tail_draws < 1:
        raise ValueError(f"tail_draws must be >= 1, got {tail_draws}")
    if scale <= 0:
        raise ValueError(f"scale must be > 0, got {scale}")
    chosen = select_entries(only)
    t0 = time.perf_counter()
    rows = []
    for bug in chosen:
        if progress:
            progress(bug.name)
        n = _size(bug, samples, tail_draws, full, scale)
        row = _run_one(bug, n, level, seed, full, progress)
        if bug.stated_power is not None and not full and n == bug.samples and row.expected == "FAIL":
            row.stated_power = bug.stated_power
        rows.append(row)
    overridden = samples is not None or tail_draws is not None
    sizes = "overridden" if overridden else "full" if full else "default" if scale == 1 else f"x{scale:g}"
    return KnownBugsReport(rows=rows, level=level, seed=seed, seconds=time.perf_counter() - t0, sizes=sizes)


def write_report(report: KnownBugsReport, out) -> tuple:
    return write_md_json(report, out, "known-bugs")
