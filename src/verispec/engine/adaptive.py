"""Draft length control: a fixed gamma, or one chosen each step from measured acceptance and costs.

The adaptive rule maximises the expected speedup of `verispec.sampling.theory.speedup_cost_curve`, with
  * alpha per row: (accepted + m * a0) / (accepted + rejections + m) over the row's steps (a step: its accepted
    drafts as successes, a rejection as one failure), shrunk towards a0, the acceptance pooled over all rows so far
    (m = 4 pseudo-observations; a0 starts optimistic at 0.75);
  * draft cost: the measured seconds of one draft forward (EMA);
  * verify cost T(n): measured seconds of a target pass over n tokens per row (EMA per n), interpolated.
Both costs are kept per batch size (a batch size not measured yet borrows the nearest one's). When no draft length
is expected to pay — judged once `min_evidence` acceptance observations and T(1) are measured — the row decodes
plainly and drafts again every `probe_every` steps to keep alpha measured. Any gamma is lossless; with gamma="auto"
the samples depend on timings, so seeded outputs are reproducible only with a fixed gamma.
"""

from __future__ import annotations

import statistics
import time

import torch

from ..sampling.theory import optimal_gamma_cost_curve, speedup_cost_curve

__all__ = ["MAX_GAMMA", "GammaController", "check_gamma", "measure_cost_curve"]

MAX_GAMMA = 64  # drafts per step: far beyond where speculation pays (every draft costs a draft forward)


@torch.inference_mode()
def measure_cost_curve(
    runner, vocab: int, max_n: int, batch: int = 1, context: int = 64, repeats: int = 5
) -> list[float]:
    """Median seconds of one forward of `runner` over n = 1..max_n new tokens per row after `context` cached
    (random) tokens, for `batch` rows: the cost curve T_batch(n) that prices a speculative step at that batch size.
    Leaves the runner's cache in use (a hidden-state head's: its target runner's too): call it before generating,
    never during."""
    runner.start(batch, context + max_n + 1)
    g = torch.Generator().manual_seed(0)
    pool = getattr(runner, "calibration_ids", None)  # a cross-vocabulary draft: ids it reads as one token each
    pool = torch.arange(vocab) if pool is None else pool  # [P]: the ids timed

    def draw(n: int) -> list[int]:
        return pool[torch.randint(0, len(pool), (n,), generator=g)].tolist()

    prompts = [draw(context) for _ in range(batch)]
    target = getattr(getattr(runner, "features", None), "target", None)
    if target is not None:  # a hidden-state head reads its target's hidden states: the target holds the context too
        target.start(batch, context + 1)
        target.prefill(prompts)
    runner.prefill(prompts)
    curve = []
    for n in range(1, max_n + 1):
        times = []
        for _ in range(repeats):
            toks = [draw(n) for _ in range(batch)]
            t0 = time.perf_counter()
            runner.forward(toks)
            times.append(time.perf_counter() - t0)
            runner.truncate([context] * batch)
        curve.append(statistics.median(times))
    return curve


def check_gamma(value, name: str = "gamma") -> int:
    """A draft length: an integer in [0, MAX_GAMMA] (0: no speculation); anything else is a ValueError."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_GAMMA:
        raise ValueError(f"{name} must be an integer in [0, {MAX_GAMMA}] (drafts per step), got {value!r}")
    return value


class GammaController:
    def __init__(
        self, gamma: int | str, max_gamma: int = 8, ema: float = 0.3, probe_every: int = 8, min_evidence: int = 32
    ):
        self.fixed = None if gamma == "auto" else check_gamma(gamma, "gamma (or 'auto')")
        if check_gamma(max_gamma, "max_gamma") < 1:
            raise ValueError(f"max_gamma must be >= 1, got {max_gamma}")
        self.max_gamma = max_gamma if self.fixed is None else max(self.fixed, 1)
        self.ema = ema
        self.probe_every = probe_every
        self.min_evidence = min_evidence  # pooled acceptance observations before a row may stop drafting
        self.draft_costs: dict[int, float] = {}  # batch size -> seconds per draft forward
        self.verify_costs: dict[int, dict[int, float]] = {}  # batch size -> n tokens per row -> seconds per pass
        self.pooled = [0, 0]  # successes, failures over every row (the prior for new rows)

    def seed_costs(self, batch: int, curve: list[float], draft_cost: float | None) -> None:
        """Measured costs at one batch size before any step runs (`SpeculativeGenerator.calibrate`): the target's
        T(1..n) at `batch` rows and the seconds of one draft forward there. Steps then refine them (EMA)."""
        self.verify_costs[batch] = {n: t for n, t in enumerate(curve, 1)}
        if draft_cost is not None:
            self.draft_costs[batch] = draft_cost

    def _blend(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.ema) * old + self.ema * new

    def observe_draft(self, seconds_per_step: float, batch: int = 1) -> None:
        self.draft_costs[batch] = self._blend(self.draft_costs.get(batch), seconds_per_step)

    def observe_verify(self, n_tokens: int, seconds: float, batch: int = 1) -> None:
        costs = self.verify_costs.setdefault(batch, {})
        costs[n_tokens] = self._blend(costs.get(n_tokens), seconds)

    @staticmethod
    def _nearest(table: dict, batch: int):
        return table[min(table, key=lambda b: (abs(b - batch), -b))] if table else None

    def draft_cost(self, batch: int = 1) -> float | None:
        return self._nearest(self.draft_costs, batch)

    def verify_cost(self, batch: int = 1) -> dict[int, float]:
        return self._nearest(self.verify_costs, batch) or {}

    def observe_acceptance(self, successes: int, failures: int) -> None:
        self.pooled[0] += successes
        self.pooled[1] += failures

    def wants_plain_probe(self, batch: int) -> bool:
        """True once per batch size, after its draft and verify costs are measured but its plain-decoding
        cost T(1) is not: the whole batch then decodes plainly for one step, so that "is drafting worth
        it at this batch size" is judged on a measured T(1), not on an optimistic extrapolation."""
        if self.fixed is not None or batch not in self.draft_costs:
            return False
        return 1 not in self.verify_costs.get(batch, {})

    def curve(self, batch: int = 1) -> list[float]:
        """T(1..max_gamma + 1): measured values where there are some; linear interpolation between
        measured n; beyond the largest measured n, that value (optimistic, so longer drafts get tried and
        measured: CPU cost curves are far from linear, e.g. M = 2, 3 slower than M = 8)."""
        pts = sorted(self.verify_cost(batch).items())
        out = []
        for n in range(1, self.max_gamma + 2):
            lo = [(m, t) for m, t in pts if m <= n]
            hi = [(m, t) for m, t in pts if m >= n]
            if lo and hi:
                (m0, t0), (m1, t1) = lo[-1], hi[0]
                out.append(t0 if m1 == m0 else t0 + (t1 - t0) * (n - m0) / (m1 - m0))
            else:
                out.append((lo[-1] if lo else hi[0])[1])
        return [max(t, 1e-9) for t in out]

    def choose(self, successes: int, failures: int, cap: int, step: int = 0, batch: int = 1) -> int:
        """gamma for one row, given its acceptance record, a cap (remaining budget, context), the row's step count
        and the current batch size (the module docstring's rule)."""
        cap = max(0, min(cap, self.max_gamma))
        if self.fixed is not None:
            return min(self.fixed, cap)
        if cap == 0:
            return 0
        draft_cost, verify = self.draft_cost(batch), self.verify_cost(batch)
        if draft_cost is None or not verify:
            return min(4, cap)  # warm-up until both costs are measured
        curve = self.curve(batch)
        s0, f0 = self.pooled
        prior = (s0 + 3) / (s0 + f0 + 4)  # optimistic before any evidence (0.75), then the pooled rate
        alpha = (successes + 4 * prior) / (successes + failures + 4)
        gamma, speedup = optimal_gamma_cost_curve(min(alpha, 0.999), draft_cost, curve, max_gamma=cap)
        evidence = s0 + f0 >= self.min_evidence and 1 in verify  # alpha and plain cost both measured
        if evidence and (gamma == 0 or speedup < 1.0) and step % self.probe_every:
            return 0  # drafting does not pay: decode plainly, except on every probe_every-th step
        if gamma == 0:  # probing, or not enough evidence yet to stop drafting: best positive length
            gamma, _ = max(
                ((g, speedup_cost_curve(min(alpha, 0.999), g, draft_cost, curve)) for g in range(1, cap + 1)),
                key=lambda gs: gs[1],
            )
        return gamma
