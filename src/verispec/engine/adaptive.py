"""Draft length control: a fixed gamma, or one chosen per row and step from measured acceptance and costs ("auto").

The auto rule prices every choice with measured costs (`engine.costs.StepCosts`) and picks the best rate, plain
decoding included (drafting must beat plain by MARGIN):
  * plain: 1 token for T_B(1) seconds (B: the batch size);
  * drafting g tokens with source s (a drafter may offer several, e.g. prompt lookup and a draft model, and says
    per row what each can draft now: `drafting.Signal`): E[tokens] = 1 + sum_{j<=g} prod_{i<=j} alpha_i for
    T_B(g + 1) + g * c_s seconds (c_s: the source's seconds per drafted token).
alpha_i is the chance that draft position i is kept once positions before it were (positions 3 and deeper share one
figure), estimated from kept / reached counts with shrinkage up a hierarchy: the source's pooled record (towards
PRIOR_ALPHA), the source's signal bucket (e.g. prompt lookup's matched n-gram size and how many earlier matches agree)
towards it (or towards the signal's own prior, where the source estimates its acceptance from past data: an online
head's held-out agreement with the target, per version), the row's own record in that bucket towards that. Before T_B(1) is measured the row decodes plainly
(which measures it); unmeasured widths are priced pessimistically (`engine.costs`).

A row may instead probe: take the choice an optimistic estimate favours (the first position's alpha at the upper end
of its spread over the bucket's evidence; a width never measured at the cost of the widest measured) where it beats the estimates' best,
as long as the expected seconds probes lose against that best stay within `probe_budget` of the time decoded so far
(plus one step's worth to start). So drafts and widths that were never tried get measured, a drafter that has shown
nothing stops being tried, and probing costs a bounded share of the run.

Any gamma is lossless (every choice looks only at the past); with gamma="auto" the samples depend on timings, so
seeded outputs are reproducible only with a fixed gamma.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Hashable, Sequence

import torch

from ..drafting.base import ANY_DEPTH, Signal
from .costs import DEFAULT_SLOPE, StepCosts

__all__ = ["MAX_GAMMA", "GammaController", "check_gamma", "expected_tokens", "measure_cost_curve"]

MAX_GAMMA = 64  # drafts per step: far beyond where speculation pays (every draft costs a draft forward)
DEPTHS = 3  # acceptance is kept for draft positions 1, 2 and 3-or-deeper
PRIOR_ALPHA = 0.25  # a source's acceptance before any evidence (PRIOR_WEIGHT pseudo-observations): pessimistic
PRIOR_WEIGHT = 2.0
SHRINK = 4.0  # pseudo-observations a bucket (a row) borrows from the source (the bucket)
Z_PROBE = 1.0  # a probe's optimism: the scale of its confidence bound (`GammaController.alphas`)
PROBE_BUDGET = 0.02  # the share of the run's seconds that probes may lose, in expectation
MARGIN = 0.03  # drafting is chosen over plain only where its estimated rate is this much higher (the best of several
# noisy estimates is biased upwards; a marginal gain is not worth the risk of a loss)


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


def expected_tokens(alphas: Sequence[float], gamma: int) -> float:
    """Expected tokens of one step drafting `gamma` tokens: 1 + sum_{j<=gamma} prod_{i<=j} alphas[min(i, D) - 1]
    (alphas [D]: the chance position i is kept once the positions before it were; the last covers deeper ones)."""
    return _cumulative(alphas, gamma)[gamma]


Counts = list[float]  # [2 * DEPTHS]: kept, reached per draft position (1, 2, 3+)


def _record(table: dict, key: Hashable, drafted: int, accepted: int) -> None:
    """A step's outcome into the counts under `key`: positions 1..min(drafted, accepted + 1) were reached."""
    counts = table.setdefault(key, [0.0] * (2 * DEPTHS))
    for j in range(min(drafted, accepted + 1)):
        d = 2 * min(j, DEPTHS - 1)
        counts[d] += j < accepted
        counts[d + 1] += 1


def _shrunk(counts: Counts | None, prior: list[float], weight: float) -> list[float]:
    """Per position: (kept + weight * prior) / (reached + weight)."""
    if counts is None:
        return list(prior)
    return [(counts[2 * d] + weight * prior[d]) / (counts[2 * d + 1] + weight) for d in range(DEPTHS)]


class GammaController:
    """The draft length (and, where a drafter offers several, the source) per row and step: `fixed`, or the auto
    rule of the module docstring.

    Attributes:
        fixed: The fixed gamma (None: "auto").
        max_gamma: The most drafts a step may take.
        costs: The measured step costs.
        counters: Cumulative figures of the auto rule's choices: "decisions" (rows x steps decided), "drafting"
            (those that drafted), "gamma_sum" (drafts chosen), "probes" (of the drafting ones, probes) and
            "probe_cost_s" (the seconds the probes were expected to lose against plain decoding).
    """

    def __init__(
        self,
        gamma: int | str,
        max_gamma: int = 8,
        *,
        slope: float = DEFAULT_SLOPE,
        cost_priors: Sequence[float] = (0.0,),
        probe_budget: float = PROBE_BUDGET,
    ):
        """gamma: an integer or "auto"; slope: the target runner's prior cost of one more token per row
        (`engine.costs.prior_slope`); cost_priors: per draft source, its seconds per drafted token before any is
        measured, as a share of T_B(1); probe_budget: the share of decoding time probes may lose."""
        self.fixed = None if gamma == "auto" else check_gamma(gamma, "gamma (or 'auto')")
        if check_gamma(max_gamma, "max_gamma") < 1:
            raise ValueError(f"max_gamma must be >= 1, got {max_gamma}")
        if not 0 <= probe_budget <= 1:
            raise ValueError(f"probe_budget must be in [0, 1], got {probe_budget}")
        self.max_gamma = max_gamma if self.fixed is None else max(self.fixed, 1)
        self.costs = StepCosts(slope)
        self.cost_priors = tuple(cost_priors)
        self.probe_budget = probe_budget
        self.sources: dict[int, Counts] = {}  # source -> counts over every row
        self.buckets: dict[tuple[int, Hashable], Counts] = {}  # (source, bucket) -> counts over every row
        self.elapsed = 0.0  # seconds of steps observed
        self.counters = dict.fromkeys(("decisions", "drafting", "gamma_sum", "probes", "probe_cost_s"), 0.0)

    def seed_costs(self, batch: int, curve: list[float], draft_cost: float | None, source: int = 0) -> None:
        """Measured costs at one batch size before any step runs (`SpeculativeGenerator.calibrate`): the target's
        T(1..n) at `batch` rows and the seconds of one draft forward there. Steps then add their own."""
        self.costs.seed(batch, curve, draft_cost, source)

    def observe_draft(self, seconds: float, tokens: int, batch: int = 1, source: int = 0) -> None:
        """A step's drafting: `seconds` for at most `tokens` drafts per row by `source`."""
        self.costs.observe_draft(source, seconds / max(tokens, 1), batch)
        self.elapsed += seconds

    def observe_verify(self, n_tokens: int, seconds: float, batch: int = 1) -> None:
        self.costs.observe_verify(n_tokens, seconds, batch)
        self.elapsed += seconds

    def observe_acceptance(self, row: dict, source: int, bucket: Hashable, drafted: int, accepted: int) -> None:
        """One row's step: `drafted` tokens from `source` in `bucket`, `accepted` kept; `row`: the row's own counts
        (a dict the row keeps, `Row.evidence`)."""
        if drafted > 0:
            for table, key in ((row, (source, bucket)), (self.buckets, (source, bucket)), (self.sources, source)):
                _record(table, key, drafted, accepted)

    def alphas(
        self, row: dict, source: int, bucket: Hashable, prior: Sequence[float] | None = None
    ) -> tuple[list[float], list[float]]:
        """Per draft position (1, 2, 3+): alpha's estimate for this row, source and bucket, and the optimistic
        version a probe weighs: the first position at an upper confidence bound over the bucket's evidence n,
        mean + sqrt(2 L v / n) + L / n (v = mean (1 - mean), L = Z_PROBE ln(2 + decisions so far): UCB's optimism,
        so a bucket tried too rarely is tried again; the first position decides whether a bucket drafts at all,
        deeper ones are measured by the drafts it keeps). prior: the source's own estimate for the bucket (the
        signal's), shrunk towards instead of the source's record."""
        pooled = _shrunk(self.sources.get(source), [PRIOR_ALPHA] * DEPTHS, PRIOR_WEIGHT)
        if prior is not None:
            pooled = [float(prior[min(d, len(prior) - 1)]) for d in range(DEPTHS)]
        counts = self.buckets.get((source, bucket))
        in_bucket = _shrunk(counts, pooled, SHRINK)
        mean = _shrunk(row.get((source, bucket)), in_bucket, SHRINK)
        n = SHRINK + (counts[1] if counts else 0.0)  # the first position's evidence in the bucket
        log = Z_PROBE * math.log(2.0 + self.counters["decisions"])  # optimism grows slowly with the decisions made
        spread = math.sqrt(2 * log * mean[0] * (1 - mean[0]) / n) + log / n  # an empirical-Bernstein bound
        return mean, [min(1.0, mean[0] + spread), *mean[1:]]

    def choose(self, row: dict, signals: Sequence | None, cap: int, batch: int = 1) -> tuple[int, int]:
        """(source, gamma) for a row decoding alone (`plan` of one row)."""
        return self.plan([(row, signals, cap)], batch)[0]

    def plan(self, rows: Sequence[tuple[dict, Sequence | None, int]], batch: int, floor: int = 0) -> list:
        """(source, gamma) per row of a step.

        Args:
            rows: Per row deciding: its own counts (`Row.evidence`), what each source can draft now (per source a
                `drafting.Signal` or None; None for the whole: one source, no signal), its cap (remaining budget,
                context).
            batch: The step's batch size B (its rows, deciding or not).
            floor: The draft length other rows of the step take anyway (a request's own gamma): its width is paid.

        Returns:
            Per row, (the draft source, the number of tokens to draft).
        """
        rows = [
            (counts, [Signal(None, ANY_DEPTH)] if sig is None else list(sig), max(0, min(cap, self.max_gamma)))
            for counts, sig, cap in rows
        ]
        if self.fixed is not None:
            return [
                (next((s for s, x in enumerate(sig) if x is not None), 0), min(self.fixed, cap)) for _, sig, cap in rows
            ]
        picks = self._auto(rows, batch, floor)
        self.counters["decisions"] += len(picks)
        self.counters["drafting"] += sum(g > 0 for _, g in picks)
        self.counters["gamma_sum"] += sum(g for _, g in picks)
        return picks

    def _auto(self, rows: list, batch: int, floor: int) -> list[tuple[int, int]]:
        """The auto rule at the step's level: one width W for the batch (its pass costs T_B(W + 1) whichever rows
        fill it), each row drafting up to W from its best source; W maximises expected tokens per second (W = 0:
        plain), or a probe's W where the budget allows (the module docstring)."""
        top = max((cap for *_, cap in rows), default=0)
        curve = self.costs.curve(batch, max(top, floor) + 1) if top else None
        if curve is None:
            return [(0, 0)] * len(rows)  # nothing to draft, or T_B(1) unmeasured: a plain step measures it
        tables = [self._options(counts, sig, cap, batch) for counts, sig, cap in rows]
        costs = {s: self._draft_cost(s, batch, curve[0]) for t in tables for s, *_ in t}
        options = [self._evaluate(tables, w, curve, costs, floor, 0) for w in range(top + 1)]
        best = max(options)
        if best[0] < (1 + MARGIN) * options[0][0]:  # drafting must beat plain by a margin: estimates err upwards
            best = options[0]
        hope = self.costs.curve(batch, max(top, floor) + 1, optimistic=True)
        probe = max(self._evaluate(tables, w, hope, costs, floor, 1) for w in range(top + 1))
        if probe[0] > best[0] and probe[3] != best[3]:
            _, tokens, seconds, _ = self._evaluate(tables, 0, curve, costs, floor, 0, picks=probe[3])
            loss = max(0.0, seconds - tokens / best[0])  # seconds beyond what the best choice needs for its tokens
            if self._may_probe(loss, curve[0]):
                self.counters["probes"] += 1
                self.counters["probe_cost_s"] += loss
                return list(probe[3])
        return list(best[3])

    def _options(self, counts: dict, signals: list, cap: int, batch: int) -> list[tuple]:
        """Per source that can draft for the row: (source, depth, E[tokens] by length 0..depth with alpha's
        estimate, the same with its optimistic version)."""
        out = []
        for s, sig in enumerate(signals):
            depth = 0 if sig is None else min(cap, sig.depth)
            if depth >= 1:
                mean, upper = self.alphas(counts, s, sig.bucket, sig.prior)
                out.append((s, depth, _cumulative(mean, depth), _cumulative(upper, depth)))
        return out

    def _draft_cost(self, source: int, batch: int, step: float) -> float:
        """Seconds per drafted token of a source: measured, else its prior (a share of the decode step)."""
        measured = self.costs.draft_cost(source, batch)
        return measured if measured is not None else self.cost_priors[min(source, len(self.cost_priors) - 1)] * step

    @staticmethod
    def _evaluate(tables, width: int, curve, costs: dict, floor: int, which: int, picks=None) -> tuple:
        """(tokens per second, tokens, seconds, picks) of a step drafting up to `width` per row, each row from the
        source with the most expected tokens (`which`: 0 the estimate, 1 the optimistic one); or of given `picks`
        ((source, gamma) per row; `width` unused)."""
        chosen, tokens, deepest = [], 0.0, {}
        for b, options in enumerate(tables):
            best = (1.0, 0, 0)  # (E[tokens], source, gamma)
            for s, depth, *expected in options:
                if picks is not None:
                    if picks[b][0] == s and picks[b][1]:
                        best = (expected[which][picks[b][1]], *picks[b])
                elif expected[which][min(width, depth)] > best[0]:
                    best = (expected[which][min(width, depth)], s, min(width, depth))
            tokens += best[0]
            chosen.append(best[1:])
            if best[2]:
                deepest[best[1]] = max(deepest.get(best[1], 0), best[2])
        wide = max([floor, *deepest.values()])
        seconds = curve[wide] + sum(g * costs[s] for s, g in deepest.items())
        return tokens / seconds, tokens, seconds, tuple(chosen)

    def _may_probe(self, loss: float, step: float) -> bool:
        """Whether a probe expected to lose `loss` seconds fits the budget (one plain step's worth to start)."""
        return self.counters["probe_cost_s"] + loss <= self.probe_budget * self.elapsed + step


def _cumulative(alphas: Sequence[float], depth: int) -> list[float]:
    """E[tokens] of drafting 0..depth tokens (`expected_tokens` for every length at once)."""
    out, reach = [1.0], 1.0
    for j in range(depth):
        reach *= alphas[min(j, len(alphas) - 1)]
        out.append(out[-1] + reach)
    return out
