"""Kernel-level certificate: does a chain-verification function (verify_chain's interface, drawing from torch's
global generator) reproduce the target distribution exactly? With per-position p[j], q[j] fixed, a step's laws are
known in closed form (emitted tokens ~ p[j], recovered ~ (p[j] - q[j])+ / Z, bonus ~ p[k], accepted counts); each gets
a chi-square test, Holm-corrected, with the TV it detects at power POWER (docs/guides/certify.md)."""

from __future__ import annotations

import functools
import importlib
import importlib.util
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from .. import strict_json
from ..sampling import SamplingParams, probs_from_logits
from .stats import GofResult, chisquare_gof, detectable_tv, holm, samples_to_detect

__all__ = ["DEFAULT_LEVEL", "DEFAULT_SAMPLES", "LAWS", "POWER", "TARGET_TV", "KernelCase", "KernelReport"]
__all__ += ["certify_kernel", "default_cases", "load_sampler", "position_tests", "run_case", "sequence_tests"]

DEFAULT_SAMPLES = 100_000  # speculative steps per case
DEFAULT_LEVEL = 0.01  # family-wise significance level of the whole certificate (Holm)
POWER = 0.99  # the power at which the detectable effect is stated
TARGET_TV = 0.05  # an INCONCLUSIVE certificate states the samples per case needed to detect this TV at POWER

Sampler = Callable[..., object]


@dataclass(frozen=True)
class KernelCase:
    name: str
    p: Tensor  # [k + 1, V] float64: target distribution per position (row k: bonus position)
    q: Tensor | None  # [k, V] float64: draft distribution per position; None = one-hot drafts `onehot_ids`
    onehot_ids: Tensor | None = None  # [k] int64: the deterministic drafts when q is None
    ragged: bool = False  # rows draw their draft count uniformly from 0..k (batch rows with different counts)
    description: str = ""

    @property
    def k(self) -> int:
        return self.p.shape[0] - 1

    @property
    def vocab(self) -> int:
        return self.p.shape[1]

    def describe(self) -> dict:  # for the report
        return dict(k=self.k, vocab=self.vocab, ragged=self.ragged, description=self.description)


def normalised(x: Tensor) -> Tensor:
    """x with its last dimension rescaled to sum to 1 (rows of a distribution table)."""
    return x / x.sum(-1, keepdim=True)


_RANDOM = [("random", 2.0, 4), ("random-low-entropy", 5.0, 4), ("random-high-entropy", 0.3, 4), ("random", 2.0, 1)]
_RANDOM += [("random", 2.0, 8)]  # (name, scale, k): p, q = softmax(scale * N(0, 1))


def default_cases(vocab: int = 32, seed: int = 0) -> list[KernelCase]:
    """The battery: random p / q at several entropies, k in {1, 4, 8}, adversarial q, sparse p and q with
    disjoint zeros, p == q, one-hot drafts (including a p = 0 draft), top-k / top-p truncation, and batches
    whose rows carry different draft counts (at low and at high acceptance)."""
    g = torch.Generator().manual_seed(seed)

    def rnd(rows: int, scale: float, V: int = vocab) -> Tensor:
        return (scale * torch.randn(rows, V, generator=g, dtype=torch.float64)).softmax(-1)

    cases = [
        KernelCase(f"{name}-k{k}", rnd(k + 1, scale), rnd(k, scale), description=f"p, q = softmax({scale} * N(0, 1))")
        for name, scale, k in _RANDOM
    ]
    return cases + _shaped_cases(g, rnd, vocab)


def _shaped_cases(g: torch.Generator, rnd: Callable[..., Tensor], V: int) -> list[KernelCase]:
    """default_cases' cases with a shape of their own (drawn after the random ones, in this order)."""
    p = rnd(5, 2.0)
    cases = [KernelCase("adversarial-k4", p, normalised(1 / p[:4]), description="q proportional to 1 / p")]
    p, q = rnd(5, 2.0), rnd(4, 2.0)
    p[:, : V // 2] = 0  # p lives on the upper half, q on the lower three quarters
    q[:, 3 * V // 4 :] = 0
    sparse = "p = 0 on half the tokens, q = 0 on another quarter"
    cases.append(KernelCase("sparse-disjoint-zeros-k4", normalised(p), normalised(q), description=sparse))
    p = rnd(5, 2.0)
    cases.append(KernelCase("equal-k4", p, p[:4].clone(), description="p == q (Z = 0 everywhere)"))
    p = rnd(5, 2.0)
    p[1, 3] = 0
    p = normalised(p)
    ids = torch.tensor([int(p[0].argmax()), 3, int(p[2].argmin()), int(p[3].argmax())])
    onehot = "deterministic drafts: likely, p = 0, unlikely, likely"
    cases.append(KernelCase("onehot-k4", p, None, ids, description=onehot))
    params = SamplingParams(temperature=0.8, top_k=max(2, V // 4), top_p=0.9)
    pt = probs_from_logits(2 * torch.randn(1, 5, V, generator=g), params)[0].double()
    qt = probs_from_logits(2 * torch.randn(1, 4, V, generator=g), params)[0].double()
    truncated = "temperature 0.8, top-k, top-p 0.9 on both"
    cases.append(KernelCase("truncated-k4", normalised(pt), normalised(qt), description=truncated))
    ragged = "rows with 0..8 drafts in one batch"
    cases.append(KernelCase("ragged-k8", rnd(9, 2.0), rnd(8, 2.0), ragged=True, description=ragged))
    onehot = "one-hot drafts, rows with 0..4 drafts"
    cases.append(KernelCase("ragged-onehot-k4", p, None, ids, ragged=True, description=onehot))
    high = "p, q = softmax(0.5 * N(0, 1)), rows with 0..4 drafts"  # a short row's last threshold (block verification)
    cases.append(KernelCase("ragged-high-entropy-k4", rnd(5, 0.5), rnd(4, 0.5), ragged=True, description=high))
    small = max(4, V // 4)  # few tokens, so each law is tested finely (block verification's residual)
    small_case = KernelCase(
        "small-vocab-k2", rnd(3, 1.0, small), rnd(2, 1.0, small), description=f"V = {small}, p, q = softmax(N(0, 1))"
    )
    return cases + [small_case]


def _call(sampler: Sampler, target: Tensor, ids: Tensor, q: Tensor | None, nd: Tensor) -> tuple[Tensor, Tensor]:
    out = sampler(target, ids, q, nd)
    if isinstance(out, tuple) and len(out) == 2:
        tok, na = out
    elif hasattr(out, "token_ids") and hasattr(out, "num_accepted"):
        tok, na = out.token_ids, out.num_accepted
    else:
        raise TypeError(
            f"the sampler returned {type(out).__name__}; expected an object with .token_ids and "
            ".num_accepted, or a tuple (token_ids, num_accepted)"
        )
    tok, na = torch.as_tensor(tok).long().cpu(), torch.as_tensor(na).long().cpu()
    B, k1 = ids.shape[0], ids.shape[1] + 1
    if tuple(tok.shape) != (B, k1) or tuple(na.shape) != (B,):
        raise ValueError(
            f"the sampler returned token_ids {tuple(tok.shape)} and num_accepted {tuple(na.shape)}; "
            f"expected [{B}, {k1}] and [{B}]"
        )
    return tok, na


def run_case(
    sampler: Sampler, case: KernelCase, n: int, seed: int = 0, chunk: int = 50_000, dtype: torch.dtype = torch.float32
) -> tuple[Tensor, Tensor, Tensor]:
    """n independent speculative steps of `case` from `sampler` (in chunks of `chunk` rows): token_ids [n, k + 1],
    num_accepted [n], num_draft [n] (int64, CPU). Drafts come from a generator seeded with `seed`, the sampler's
    randomness from torch's global generator seeded with `seed + 1`."""
    k, V = case.k, case.vocab
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed + 1)
    toks, nas, nds = [], [], []
    for start in range(0, n, chunk):
        m = min(chunk, n - start)
        if case.q is not None:
            ids = (
                torch.stack([torch.multinomial(case.q[j], m, replacement=True, generator=gen) for j in range(k)], 1)
                if k
                else torch.empty((m, 0), dtype=torch.int64)
            )
            q = case.q.to(dtype).unsqueeze(0).expand(m, k, V).contiguous()
        else:
            ids = case.onehot_ids.unsqueeze(0).expand(m, k).contiguous()
            q = None
        nd = torch.randint(0, k + 1, (m,), generator=gen) if case.ragged else torch.full((m,), k)
        target = case.p.to(dtype).unsqueeze(0).expand(m, k + 1, V).contiguous()
        tok, na = _call(sampler, target, ids, q, nd)
        _check_structure(case, ids, nd, tok, na)
        toks.append(tok)
        nas.append(na)
        nds.append(nd)
    return torch.cat(toks), torch.cat(nas), torch.cat(nds)


class StructureError(AssertionError):
    """The sampler's output breaks the rules of a speculative step regardless of statistics."""


def _check_structure(case: KernelCase, ids: Tensor, nd: Tensor, tok: Tensor, na: Tensor) -> None:
    k, V = case.k, case.vocab
    if bool(((na < 0) | (na > nd)).any()):
        b = int(((na < 0) | (na > nd)).nonzero()[0])
        raise StructureError(f"row {b}: num_accepted {int(na[b])} outside [0, num_draft = {int(nd[b])}]")
    pos = torch.arange(k + 1)
    accepted = pos[:k] < na.unsqueeze(1)
    if bool((accepted & (tok[:, :k] != ids)).any()):
        b = int((accepted & (tok[:, :k] != ids)).any(1).nonzero()[0])
        raise StructureError(f"row {b}: an accepted position holds a token other than the draft")
    final = tok.gather(1, na.unsqueeze(1)).squeeze(1)
    if bool(((final < 0) | (final >= V)).any()):
        b = int(((final < 0) | (final >= V)).nonzero()[0])
        raise StructureError(f"row {b}: the recovered / bonus token {int(final[b])} is outside [0, {V})")


def position_tests(
    case: KernelCase, token_ids: Tensor, num_accepted: Tensor, num_draft: Tensor
) -> dict[str, tuple[GofResult, np.ndarray]]:
    """Chi-square goodness of fit, each with the exact law it tests against:
    posJ: token at every emitted position J vs p[J]; recoveredJ: token drawn at a rejection at J vs the residual;
    bonus: token after all k drafts were accepted vs p[k]; num_accepted: accepted drafts (rows with k drafts)."""
    p = case.p.double()
    k, V = case.k, case.vocab
    q = case.q.double() if case.q is not None else torch.nn.functional.one_hot(case.onehot_ids, V).double()
    tok, na, nd = token_ids.numpy(), num_accepted.numpy(), num_draft.numpy()
    emitted = na + 1
    out: dict[str, tuple[GofResult, np.ndarray]] = {}
    for j in range(k + 1):
        rows = emitted > j
        law = p[j].numpy()
        out[f"pos{j}"] = (chisquare_gof(np.bincount(tok[rows, j], minlength=V), law), law)
        if j < k:
            rec, r = (na == j) & (nd > j), (p[j] - q[j]).clamp_min(0)
            if rec.sum() > 0 and float(r.sum()) > 1e-12:
                law = (r / r.sum()).numpy()
                out[f"recovered{j}"] = (chisquare_gof(np.bincount(tok[rec, j], minlength=V), law), law)
    bonus = (na == nd) & (nd == k)
    out["bonus"] = (chisquare_gof(np.bincount(tok[bonus, k], minlength=V), p[k].numpy()), p[k].numpy())
    if k > 0:
        alpha = torch.minimum(p[:k], q).sum(-1).clamp(max=1.0).numpy()  # [k]
        law = np.array([np.prod(alpha[:m]) * (1 - alpha[m]) for m in range(k)] + [np.prod(alpha)])
        law = np.clip(law, 0, None)
        law = law / law.sum()
        full = nd == k
        out["num_accepted"] = (chisquare_gof(np.bincount(na[full], minlength=k + 1), law), law)
    return out


LAWS = ("step", "sequence")  # which exact laws certify_kernel tests (see sequence_tests)
_LAWS_NOTE = {
    "step": "Laws tested: token-wise verification's exact one-step laws (emitted, recovered and bonus tokens, "
    "accepted count).",
    "sequence": "Laws tested: the completed sequence's (each step's output completed by sampling p at the "
    "positions it did not emit follows prod_j p[j]; tests pos0, seqJ, pairJ), which every lossless rule keeps.",
    "tree": "Laws tested: each tree step's output, completed to a fixed length by sampling p, follows p's law "
    "given the context (see verispec.certify.tree_kernel).",
}


def sequence_tests(
    case: KernelCase, token_ids: Tensor, num_accepted: Tensor, num_draft: Tensor, seed: int = 0
) -> dict[str, tuple[GofResult, np.ndarray]]:
    """The laws every lossless rule keeps, token-wise or not (block verification): each step's output, completed to
    k + 1 tokens by sampling p[j] where it emitted nothing, follows prod_j p[j]. pos0: the first emitted token vs
    p[0]; seqJ (J >= 1): completed token J vs p[J]; pairJ: completed tokens J and J + 1 vs p[J] x p[J + 1]."""
    p = case.p.double()
    k, V = case.k, case.vocab
    n = token_ids.shape[0]
    gen = torch.Generator().manual_seed(seed + 2)
    emitted = (num_accepted + 1).unsqueeze(1)  # [n, 1]
    fill = torch.stack([torch.multinomial(p[j], n, replacement=True, generator=gen) for j in range(k + 1)], 1)
    seq = torch.where(torch.arange(k + 1) < emitted, token_ids, fill).numpy()  # [n, k + 1]
    out: dict[str, tuple[GofResult, np.ndarray]] = {}
    for j in range(k + 1):
        law = p[j].numpy()
        out["pos0" if j == 0 else f"seq{j}"] = (chisquare_gof(np.bincount(seq[:, j], minlength=V), law), law)
    for j in range(k):
        law = np.outer(p[j].numpy(), p[j + 1].numpy()).ravel()
        out[f"pair{j}"] = (chisquare_gof(np.bincount(seq[:, j] * V + seq[:, j + 1], minlength=V * V), law), law)
    return out


@dataclass
class TestRow:
    case: str
    test: str
    n: int
    statistic: float
    dof: int
    pvalue: float
    impossible: int
    detectable_tv: float  # smallest TV deviation detected with power POWER at the per-test level
    holm_pvalue: float = float("nan")


def require(checks: dict[str, bool]) -> None:
    """ValueError with the first message whose check is False (a request's checks, in order)."""
    failed = [message for message, ok in checks.items() if not ok]
    if failed:
        raise ValueError(failed[0])


def select(wanted: Sequence[str] | str | None, known: Sequence[str], one: str, many: str | None = None) -> list[str]:
    """The names in `wanted` (a list, or comma-separated; None: all), in the order of `known`; a ValueError names the
    unknown ones as `one` (`many` when there are several)."""
    if wanted is None:
        return list(known)
    names = [w.strip() for w in (wanted.split(",") if isinstance(wanted, str) else wanted) if w.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        what = many if many and len(unknown) > 1 else one
        raise ValueError(f"unknown {what} {', '.join(unknown) or '(none given)'}; known: {', '.join(known)}")
    return [k for k in known if k in names]


def has_power(detectable: float) -> bool:
    """A test has power when some deviation smaller than the largest possible one (TV 1) is detected."""
    return math.isfinite(detectable) and detectable < 1.0


def is_first_position(test: str) -> bool:
    """The chain's `pos0` and the tree's `pos0 | context`: the law of the first emitted token."""
    return test.split(" ")[0] == "pos0"


def _cell(x) -> str:  # a markdown table cell: a literal pipe would split it
    return str(x).replace("|", "\\|")


class Verdict:
    """A certificate report's verdict (a dataclass with `errors`, `tests` with `holm_pvalue`, `level`, `power`,
    `samples_needed` and `conclusive`): FAIL on an error or a rejected test, else PASS when conclusive."""

    @property
    def rejected(self) -> bool:
        """An error or a rejected test: the sampler or method is shown not to reproduce the target (FAIL)."""
        return bool(self.errors) or any(t.holm_pvalue < self.level for t in self.tests)

    @property
    def passed(self) -> bool:
        return not self.rejected and self.conclusive

    @property
    def verdict(self) -> str:
        return "FAIL" if self.rejected else "PASS" if self.conclusive else "INCONCLUSIVE"

    def needed_note(self, samples: str, where: str = "") -> str:
        """'; about SAMPLES would detect TV TARGET_TV with power P WHERE' when samples_needed is known, else ''."""
        if not self.samples_needed:
            return ""
        return f"; about {samples} would detect TV {TARGET_TV} with power {self.power}{where}"

    def json_with_verdict(self) -> dict:
        return asdict(self) | {"verdict": self.verdict}


@dataclass
class KernelReport(Verdict):
    sampler: str
    level: float
    power: float
    samples_per_case: int
    seed: int
    cases: list[dict]  # name, k, vocab, ragged, description, seconds
    tests: list[TestRow]
    errors: list[str]  # structural violations or crashes (each fails the certificate)
    seconds: float
    samples_needed: int | None = None  # INCONCLUSIVE: samples per case to detect TARGET_TV in every case
    laws: str = "step"  # "step": token-wise one-step laws; "sequence": the completed sequence's; "tree"

    @property
    def conclusive(self) -> bool:
        """Every case's first-position law is tested with power (a deviation below TV 1 is detectable)."""
        return has_power(self.headline_tv())

    @property
    def failing(self) -> list[TestRow]:
        return [t for t in self.tests if t.holm_pvalue < self.level]

    def headline_tv(self) -> float:
        """Worst (largest) detectable TV over the first-position tests of every case: each case's position-0
        law is checked at least this finely (inf when a case has none: nothing is stated about it)."""
        first = {t.case: t.detectable_tv for t in self.tests if is_first_position(t.test)}
        if not first or any(c["name"] not in first for c in self.cases):
            return float("inf")
        return max(first.values())

    def power_note(self) -> str:
        """One line on the certificate's strength: what a PASS detects, or why it is INCONCLUSIVE."""
        if self.conclusive:
            return (
                f"detects any deviation of the first-position law with TV >= {self.headline_tv():.4f} "
                f"(power {self.power}, every case)"
            )
        weak = sorted(t.case for t in self.tests if is_first_position(t.test) and not has_power(t.detectable_tv))
        need = self.needed_note(f"{self.samples_needed} samples per case", " in every case")
        return (
            f"INCONCLUSIVE: with {self.samples_per_case} samples per case the first-position test of "
            f"{', '.join(weak) or 'some case'} has no power (it cannot detect any deviation){need}"
        )

    def to_json(self) -> dict:
        return self.json_with_verdict() | {"headline_detectable_tv": self.headline_tv()}

    def to_markdown(self) -> str:
        lines = [
            f"# verispec certify kernel: **{self.verdict}**",
            "",
            f"sampler `{self.sampler}`; {len(self.cases)} cases x {self.samples_per_case} speculative steps; "
            f"{len(self.tests)} chi-square tests, Holm-corrected at family-wise level {self.level}; seed "
            f"{self.seed}; {self.seconds:.1f} s.",
            "",
            _LAWS_NOTE[self.laws],
            "",
            f"Detectable effect: {self.power_note()}. Worst case over cases and directions of deviation; per "
            f"test below, at the Bonferroni level {self.level / max(1, len(self.tests)):.2g} ('no power': "
            "too few samples reached the test to detect anything).",
            "",
        ]
        if self.errors:
            lines += ["## Errors", ""] + [f"- {e}" for e in self.errors] + [""]
        lines += [
            "| case | test | n | chi2 | dof | p-value | Holm p | detectable TV | verdict |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for t in self.tests:
            mark = "**reject**" if t.holm_pvalue < self.level else "ok" if has_power(t.detectable_tv) else "no power"
            imp = f" ({t.impossible} impossible)" if t.impossible else ""
            lines.append(
                f"| {_cell(t.case)} | {_cell(t.test)} | {t.n} | {t.statistic:.1f}{imp} | {t.dof} | "
                f"{t.pvalue:.3g} | {t.holm_pvalue:.3g} | {t.detectable_tv:.4f} | {mark} |"
            )
        lines += ["", "## Cases", ""] + [
            f"- `{c['name']}` (k = {c['k']}, V = {c['vocab']}{', ragged' if c['ragged'] else ''}): {c['description']}"
            for c in self.cases
        ]
        return "\n".join(lines) + "\n"


def samples_needed(laws: Sequence[tuple[np.ndarray, float]], samples: int, per_test: float, power: float) -> int | None:
    """The sample size (in the unit of `samples`) at which every test of `laws` — (law, the n it is tested at now,
    with `samples`) — detects TARGET_TV with `power` at level per_test; None when some never would."""
    needed = [samples_to_detect(law, TARGET_TV, per_test, power) * samples / max(n, 1) for law, n in laws]
    return math.ceil(max(needed)) if needed and all(map(math.isfinite, needed)) else None


def assess(
    rows: list[TestRow], laws: list[tuple[np.ndarray, float]], samples: int, level: float, power: float
) -> int | None:
    """Fill in each row's Holm p-value and detectable TV (from its law and n_law); the samples per case at which every
    first-position test detects TARGET_TV when one has no power now (else None)."""
    per_test = level / max(1, len(rows))
    for r, a, (law, n_law) in zip(rows, holm([r.pvalue for r in rows]), laws):
        r.holm_pvalue = float(a)
        r.detectable_tv = detectable_tv(law, n_law, per_test, power)
    first = [(r, law, n_law) for r, (law, n_law) in zip(rows, laws) if is_first_position(r.test)]
    if all(has_power(r.detectable_tv) for r, _, _ in first):
        return None
    return samples_needed([(law, n_law) for _, law, n_law in first], samples, per_test, power)


class CaseError(Exception):
    """The sampler crashed on a valid case or broke the structure of a step (fails the certificate, with why)."""

    @classmethod
    def raised(cls, e: Exception) -> CaseError:
        return cls(f"the sampler raised {type(e).__name__}: {e}")


# A case's tests: (test, n, statistic, dof, p-value, impossible, the law for the detectable effect, its n)
CaseTests = list[tuple[str, int, float, int, float, int, np.ndarray, float]]


@dataclass(frozen=True)
class Battery:
    """What tells the chain certificate from the tree certificate (run_battery runs either)."""

    run: Callable[[Sampler, object, int, int], CaseTests]  # (sampler, case, samples, seed) -> tests; CaseError: FAIL
    seed_stride: int  # case i runs at seed + seed_stride * i
    laws: str  # the law set, for the report (_LAWS_NOTE)


def run_battery(
    sampler: Sampler,
    cases: Sequence,
    battery: Battery,
    samples: int,
    level: float = DEFAULT_LEVEL,
    power: float = POWER,
    seed: int = 0,
    name: str | None = None,
    progress=None,
):
    """A kernel certificate: each case's tests (a CaseError fails the case, with the reason), Holm-corrected and
    sized (assess)."""
    require(
        {
            f"level must lie in (0, 1), got {level}": 0 < level < 1,
            f"power must lie in (0, 1), got {power}": 0 < power < 1,
            f"samples must be >= 100 per case, got {samples}": samples >= 100,
        }
    )
    t0 = time.perf_counter()
    found: dict[str, list] = dict(cases=[], tests=[], errors=[])
    laws: list[tuple[np.ndarray, float]] = []  # each test's (law, n_law)
    for i, case in enumerate(cases):
        if progress:
            progress(case.name)
        t1 = time.perf_counter()
        try:
            tests = battery.run(sampler, case, samples, seed + battery.seed_stride * i)
        except CaseError as e:
            found["errors"].append(f"{case.name}: {e}")
            continue
        for test, n, stat, dof, pv, imp, law, n_law in tests:
            found["tests"].append(TestRow(case.name, test, n, stat, dof, pv, imp, 0.0))
            laws.append((law, n_law))
        found["cases"].append(dict(name=case.name, **case.describe(), seconds=time.perf_counter() - t1))
    needed = assess(found["tests"], laws, samples, level, power)
    qualname = getattr(sampler, "__qualname__", getattr(sampler, "__name__", repr(sampler)))
    head = (name or f"{getattr(sampler, '__module__', '?')}:{qualname}", level, power, samples, seed)
    return KernelReport(*head, **found, seconds=time.perf_counter() - t0, samples_needed=needed, laws=battery.laws)


def _chain_tests(sampler: Sampler, case: KernelCase, samples: int, seed: int, laws: str = "step") -> CaseTests:
    """Draw the case's steps (run_case) and test them (position_tests, or sequence_tests for laws="sequence")."""
    try:
        tok, na, nd = run_case(sampler, case, samples, seed=seed)
    except StructureError as e:
        raise CaseError(str(e)) from None
    except Exception as e:  # a sampler that crashes on a valid case fails the certificate, with the reason
        raise CaseError.raised(e) from None
    found = position_tests(case, tok, na, nd) if laws == "step" else sequence_tests(case, tok, na, nd, seed)
    tests = found.items()
    return [(test, r.n, r.statistic, r.dof, r.pvalue, r.impossible, law, r.n) for test, (r, law) in tests]


def certify_kernel(
    sampler: Sampler,
    *,
    cases: Sequence[KernelCase] | None = None,
    samples: int = DEFAULT_SAMPLES,
    level: float = DEFAULT_LEVEL,
    power: float = POWER,
    seed: int = 0,
    name: str | None = None,
    progress: Callable[[str], None] | None = None,
    laws: str = "step",
) -> KernelReport:
    """Certify a chain verification function against exactly known laws (`verispec certify kernel`).

    ```python
    report = certify_kernel(verify_chain)
    report.verdict, report.headline_tv()  # "PASS", the TV every case's first position is pinned to
    ```

    Args:
        sampler: A function with verify_chain's interface: `(target_probs [B, k+1, V], draft_token_ids [B, k],
            draft_probs [B, k, V] or None, num_draft_tokens [B])` returning an object with `.token_ids` and
            `.num_accepted` (or that tuple), drawing its randomness from torch's global generator.
        cases: The cases (default: `default_cases()`, 14 of them).
        samples: Speculative steps per case.
        level: The family-wise significance level.
        power: The power at which each test's detectable deviation is stated.
        seed: The random seed.
        name: The sampler's name in the report (default: its qualified name).
        progress: Called with a line of text as each case finishes.
        laws: "step": token-wise verification's exact one-step laws; "sequence": the completed sequence's laws,
            which any lossless rule keeps (block verification, coupled rules).

    Returns:
        The report: `verdict` ("PASS", "FAIL" or "INCONCLUSIVE"), every test, the detectable effects.
    """
    if laws not in LAWS:
        raise ValueError(f"laws must be one of {', '.join(LAWS)}, got {laws!r}")
    cases = list(default_cases() if cases is None else cases)
    battery = Battery(functools.partial(_chain_tests, laws=laws), 1000, laws)
    return run_battery(sampler, cases, battery, samples, level, power, seed, name, progress)


def load_sampler(spec: str) -> Sampler:
    """`module:function` or `path/to/file.py:function` -> the callable (a clear error otherwise)."""
    mod_name, colon, attr = spec.rpartition(":")
    if not colon:
        raise ValueError(f"--sampler must look like module:function or file.py:function, got {spec!r}")
    if mod_name.endswith(".py") and not Path(mod_name).is_file():
        raise ValueError(f"sampler file not found: {mod_name}")
    try:
        if mod_name.endswith(".py"):
            found = importlib.util.spec_from_file_location(Path(mod_name).stem, mod_name)
            module = importlib.util.module_from_spec(found)
            found.loader.exec_module(module)
        else:
            module = importlib.import_module(mod_name)
    except ImportError as e:
        raise ValueError(f"cannot import {mod_name!r}: {e}") from None
    fn = functools.reduce(lambda obj, part: getattr(obj, part, None), attr.split("."), module)
    if fn is None:
        raise ValueError(f"{mod_name!r} has no attribute {attr!r}")
    if not callable(fn):
        raise ValueError(f"{spec!r} is not callable")
    return fn


def write_report(report: KernelReport, out: str | Path) -> tuple[Path, Path]:
    return write_md_json(report, out, "kernel-certificate")


def write_md_json(report, out: str | Path, stem: str) -> tuple[Path, Path]:
    """out/STEM.md (report.to_markdown()) and out/STEM.json (report.to_json(), strict: no NaN / Infinity)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    md, js = out / f"{stem}.md", out / f"{stem}.json"
    md.write_text(report.to_markdown())
    strict_json.write(js, report.to_json())
    return md, js
