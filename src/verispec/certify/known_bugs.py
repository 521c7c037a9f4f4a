"""Known bugs (`verispec certify known-bugs`): small samplers that each reproduce a distribution bug a public engine
shipped, through `certify_kernel` (chain-step / chain-sequence laws) or `tail_test` (a categorical draw), next to
verispec's own samplers: every bug must FAIL, every control PASS. A chain bug's `stated_power` at its default size is
estimated from a run at 5x (`estimated_power`; sizes, references, the tail test's derivation: docs/guides/certify.md).
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

from ..sampling.block import verify_block
from ..sampling.chain import sample_from_weights, verify_chain
from ..sampling.coupling import gumbel_verifier, race_winner
from ..sampling.lossy import spec_rl_verifier
from ..sampling.positional import positional_verifier
from .bugs import BUGS, EXP_FLOOR, broken_block_verifier, broken_verifier, fp32_exponential_race
from .kernel import POWER, CaseError, TestRow, _cell, certify_kernel, default_cases, require, select, write_md_json

__all__ = ["KINDS", "KNOWN_BUGS", "TAIL", "TAIL_DRAWS", "KnownBug", "KnownBugRow", "KnownBugsReport", "TailSpec"]
__all__ += ["binomial_power", "estimated_power", "run_known_bugs", "select_entries", "tail_test", "write_report"]

KINDS = ("chain-step", "chain-sequence", "tail")
TAIL_DRAWS = 53_000  # races per tail-test sampler: exact binomial power 0.9927 to FAIL the floored race at 0.01


@dataclass(frozen=True)
class TailSpec:
    """One head token of weight 1, then `tail` tokens of weight `ratio` each, below the race's `floor` (the
    floored race gives the tail e^-c - e^(-c (1 + Tr)) / (1 + Tr) with c = floor / ratio: 9% of its exact mass)."""

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
    return sample_from_weights(weights, torch.rand(weights.shape[0], dtype=torch.float64, device=weights.device))


def race_fp64_control(weights: Tensor) -> Tensor:
    """verispec.sampling.coupling.race_winner with float64 Exp(1) noise (-log U, U a float64 uniform)."""
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


_GH = "https://github.com/"
# name | kind | the default cases it runs ("-": the tail test) | default size ("-": TAIL_DRAWS) | engine | reference |
# what (the report's columns); a reference "GH:" is a GitHub path, "; " separates two; engine verispec: a control
_TABLE = """
resample_from_p | chain-step | random-k1 | 500 | textbook mistake | seed tutorial §8 (shared/DESIGN.md) | at a rejection, a fresh draw from p instead of the residual (p - q)+ / Z
resample_from_abs_diff | chain-step | random-k1 | 500 | textbook mistake | seed tutorial §8 (shared/DESIGN.md) | at a rejection, a draw from |p - q| instead of (p - q)+
q_before_temperature | chain-step | random-k1,equal-k4 | 1000 | vLLM; HF transformers | GH:vllm-project/vllm/issues/9834 ; GH:huggingface/transformers/issues/32867 | drafts sampled at temperature 0.7, the verifier given q at temperature 1 (q^0.7 renormalized)
le_zero_uniform | chain-step | onehot-k4,sparse-disjoint-zeros-k4 | 1000 | SGLang | GH:sgl-project/sglang/issues/35771 | `u * q <= p` with a uniform that can be exactly 0: a draft with p = 0 can be accepted
bonus_ignores_temperature | chain-step | equal-k4,random-k1 | 1000 | EAGLE | EAGLE reference code, 2024-25 (bonus token sampled without the request's temperature/top-p) | the bonus token (every draft accepted) drawn from p before temperature 0.7 (p^0.7 renormalized)
wrong_q_raw_logits | chain-step | truncated-k4 | 1000 | HF transformers | GH:huggingface/transformers/issues/47932 (fix: PR #47961) | drafts sampled from the top-k-processed q, the verifier given the raw q (ratio inflated by 1 / Z)
block_plain_residual | chain-sequence | small-vocab-k2 | 15000 | vllm-ascend | GH:vllm-project/vllm-ascend/issues/7807 | block verification's decision, then the token-wise residual (p - q)+ instead of (rho p - q)+
spec_rl | chain-step | random-k1 | 500 | SPEC-RL | SPEC-RL rollout reuse (Liu et al. 2025), l = 1 | accept an old rollout's token with min(1, p / q), at a rejection a fresh draw from p
spec_rl_lenient | chain-step | random-k1 | 500 | SPEC-RL | SPEC-RL rollout reuse (Liu et al. 2025), its scripts' lenience l = e^0.5 | accept with min(1, l p / q), l = e^0.5 ~ 1.65, at a rejection a fresh draw from p
fp32_exponential_race | tail | - | - | vLLM | GH:vllm-project/vllm/pull/43150 | exponential-race sampling with float32 Exp(1) noise that never falls below 2^-24: the far tail is lost
verify_chain | chain-step | random-k1,equal-k4,onehot-k4,sparse-disjoint-zeros-k4,truncated-k4 | 1000 | verispec | verispec.sampling.chain.verify_chain | control: the exact token-wise rule, on the chain bugs' cases
verify_block | chain-sequence | small-vocab-k2,random-k4,ragged-high-entropy-k4 | 15000 | verispec | verispec.sampling.block.verify_block | control: block verification against the sequence laws
gumbel_verifier | chain-sequence | small-vocab-k2,random-k4,ragged-high-entropy-k4 | 15000 | verispec | verispec.sampling.coupling.gumbel_verifier | control: Gumbel-coupled verification against the sequence laws
positional_verifier | chain-sequence | small-vocab-k2,random-k4,ragged-high-entropy-k4 | 15000 | verispec | verispec.sampling.positional.positional_verifier | control: position-seeded verification against the sequence laws
sample_from_weights | tail | - | - | verispec | verispec.sampling.chain.sample_from_weights | control: inverse-CDF sampling with float64 uniforms, on the tail test
race_winner_fp64 | tail | - | - | verispec | verispec.sampling.coupling.race_winner | control: the exponential race with float64 Exp(1) noise, on the tail test
"""
_MAKE: dict[str, Callable[[], Callable]] = {  # entry -> its sampler, built when the entry runs
    **{bug: functools.partial(broken_verifier, bug) for bug in BUGS},
    "block_plain_residual": functools.partial(broken_block_verifier, "block_plain_residual"),
    "spec_rl": functools.partial(spec_rl_verifier, 1.0),
    "spec_rl_lenient": functools.partial(spec_rl_verifier, math.exp(0.5)),
    "fp32_exponential_race": lambda: fp32_exponential_race,
    "verify_chain": lambda: verify_chain,
    "verify_block": lambda: verify_block,
    "gumbel_verifier": lambda: gumbel_verifier,
    "positional_verifier": lambda: positional_verifier,
    "sample_from_weights": lambda: sample_from_weights_control,
    "race_winner_fp64": lambda: race_fp64_control,
}


def _entry(row: str) -> KnownBug:
    """A line of _TABLE as the registry's entry: a control must PASS, a bug FAIL (a chain bug's default size with
    the stated power 0.9999, module docstring)."""
    name, kind, cases, size, engine, reference, what = row.replace("GH:", _GH).split(" | ")
    tail, control = kind == "tail", engine == "verispec"
    sizes = dict(samples=TAIL_DRAWS, full_samples=4 * TAIL_DRAWS) if tail else dict(samples=int(size))
    fixed = dict(cases=None if tail else tuple(cases.split(",")), expected="PASS" if control else "FAIL")
    power = None if control or tail else 0.9999
    return KnownBug(name, engine, reference, what, _MAKE[name], kind, **fixed, **sizes, stated_power=power)


KNOWN_BUGS: tuple[KnownBug, ...] = tuple(_entry(row) for row in _TABLE.strip().splitlines())


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
    require({f"the tail test needs >= 1 draw, got {draws}": draws >= 1})
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
    p0, p1 = spec.exact_mass, spec.floored_mass
    return dict(
        hits=hits,
        draws=draws,
        exact_mass=p0,
        floored_mass=p1,
        expected_hits=draws * p0,
        expected_hits_floored=draws * p1,
        pvalue=float(stats.binomtest(hits, draws, p0).pvalue),
        power=binomial_power(draws, p0, p1, level),
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
        require({"estimated_power of a list of tests needs samples= (the size they were run at)": samples is not None})
        tests, n_big, lvl = list(source), samples, level
    lvl = lvl if level is None else level
    if lvl is None or not tests:
        return 0.0
    per_test, best = lvl / len(tests), 0.0
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
            sp = r.stated_power
            power = "-" if sp is None else "≥ 0.9999" if sp >= 0.9999 else f"{sp:.4f}"
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
        if head.startswith(_GH) and len(bits) >= 7 and bits[-1].isdigit():
            part = f"[{bits[3]}/{bits[4]}#{bits[-1]}]({head})" + (f" {rest}" if rest else "")
        out.append(part)
    return "; ".join(out)


def pvalue_cell(r: KnownBugRow) -> str:
    p = r.min_holm_pvalue
    return "-" if not math.isfinite(p) else "0" if p == 0 else f"{p:.2g}"


def _count(n: int, what: str) -> str:
    return f"{n} {what}{'' if n == 1 else 's'}"


def select_entries(only: Sequence[str] | str | None) -> list[KnownBug]:
    """The registry's entries named in `only` (a list, or comma-separated), in registry order; every one if None."""
    names = select(only, [b.name for b in KNOWN_BUGS], "known-bugs entry", "known-bugs entries")
    return [b for b in KNOWN_BUGS if b.name in names]


def _row(bug: KnownBug, n: int, level: float, t0: float, verdict: str, pvalue: float, ok: bool, **more) -> KnownBugRow:
    """The entry's row: what the registry says of it, and what its run found."""
    about = (bug.name, bug.engine, bug.reference, bug.what, bug.kind, bug.expected)
    return KnownBugRow(*about, verdict, pvalue, n, time.perf_counter() - t0, ok, level, **more)


def _run_tail(bug: KnownBug, n: int, level: float, seed: int) -> KnownBugRow:
    """The tail test of the entry's sampler; a crash fails the entry (not ok: the bug was not caught), with why."""
    t0 = time.perf_counter()
    try:
        t = tail_test(bug.make(), n, seed=seed, level=level)
    except Exception as e:
        return _row(bug, n, level, t0, "FAIL", math.nan, False, errors=[str(CaseError.raised(e))])
    verdict = "FAIL" if t["pvalue"] < level else "PASS" if t["power"] >= POWER else "INCONCLUSIVE"
    power = t["power"] if bug.expected == "FAIL" else None  # exact, at this size
    return _row(bug, n, level, t0, verdict, t["pvalue"], verdict == bug.expected, tail=t, stated_power=power)


def _run_chain(bug: KnownBug, n: int, level: float, seed: int, full: bool, progress) -> KnownBugRow:
    """The kernel certificate of the entry's verifier on its cases (every default case with `full`)."""
    t0 = time.perf_counter()
    cases = [c for c in default_cases() if full or bug.cases is None or c.name in bug.cases]
    laws, each = "step" if bug.kind == "chain-step" else "sequence", (lambda c: progress(f"{bug.name}: {c}"))
    options = dict(cases=cases, samples=n, level=level, seed=seed, name=bug.name, laws=laws)
    report = certify_kernel(bug.make(), **options, progress=each if progress else None)
    holm = min((t.holm_pvalue for t in report.tests), default=float("nan"))
    ok = report.verdict == bug.expected and not report.errors  # a FAIL must be statistical, not a crash
    tv = report.headline_tv()
    more = dict(cases=[c.name for c in cases], tests=report.tests, errors=report.errors)
    return _row(bug, n, level, t0, report.verdict, holm, ok, detectable_tv=tv if math.isfinite(tv) else None, **more)


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
        The report: each entry's verdict against its expectation (`ok` when every bug FAILED and every control PASSED).
    """
    require(
        {
            f"level must lie in (0, 1), got {level}": 0 < level < 1,
            f"samples must be >= 100 per case, got {samples}": samples is None or samples >= 100,
            f"tail_draws must be >= 1, got {tail_draws}": tail_draws is None or tail_draws >= 1,
            f"scale must be > 0, got {scale}": scale > 0,
        }
    )
    chosen = select_entries(only)
    t0 = time.perf_counter()
    rows = []
    for bug in chosen:
        if progress:
            progress(bug.name)
        override = tail_draws if bug.kind == "tail" else samples  # races for the tail test, else steps per case
        n = override if override is not None else round((bug.full_samples if full else bug.samples) * scale)
        row = _run_tail(bug, n, level, seed) if bug.kind == "tail" else _run_chain(bug, n, level, seed, full, progress)
        if bug.stated_power is not None and not full and n == bug.samples and row.expected == "FAIL":
            row.stated_power = bug.stated_power
        rows.append(row)
    overridden = samples is not None or tail_draws is not None
    sizes = "overridden" if overridden else "full" if full else "default" if scale == 1 else f"x{scale:g}"
    return KnownBugsReport(rows=rows, level=level, seed=seed, seconds=time.perf_counter() - t0, sizes=sizes)


def write_report(report: KnownBugsReport, out) -> tuple:
    return write_md_json(report, out, "known-bugs")
