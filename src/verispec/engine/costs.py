"""Step costs as the engine measures them, for the draft-length controller (`engine.adaptive`).

Per batch size B: the seconds of the target's pass over n new tokens per row, T_B(n), and each draft source's
seconds per drafted token. Every step that runs adds one measurement (plain steps measure T_B(1)); an estimate is a
low quantile of the last `window` measurements, so a neighbour that steals a core for a while inflates no figure for
long, and a cost that changes (load, a longer context) is followed within one window. A measurement older than STALE
passes at its batch size no longer counts: a width the controller stopped using (or a calibration taken under
another load) is priced as unmeasured again, so probes re-measure it and T_B(1) is re-measured by a plain step.
A calibration (`SpeculativeGenerator.calibrate`, `verispec bench e2e`) seeds the same windows.

Where T_B(n) was never measured, the curve is priced pessimistically: the ratio T(n) / T(1) of the nearest batch
size that measured it, else the runner's prior slope, T(n) = T(1) * (1 + slope * (n - 1)) (a compute-bound runner
such as llama.cpp's on a CPU: slope ~0.8; a memory-bound one: ~0.1). Before T_B(1) itself is measured there is no
curve: the controller then decodes plainly, which measures it at no cost.
"""

from __future__ import annotations

from collections import deque

__all__ = ["DEFAULT_SLOPE", "StepCosts", "prior_slope"]

DEFAULT_SLOPE = 1.0  # a runner that says nothing: every extra token costs a whole step (the pessimistic prior)
WINDOW = 16  # measurements kept per (batch, n) and per (source, batch)
QUANTILE = 0.25  # the estimate: this quantile of the window (robust to a busy neighbour's slow steps)
STALE = 4 * WINDOW  # a measurement older than this many passes at its batch size no longer counts


def prior_slope(runner) -> float:
    """The runner's prior for the cost of one more token per row, as a share of a decode step (`verify_slope`)."""
    slope = getattr(runner, "verify_slope", None)
    return DEFAULT_SLOPE if slope is None else float(slope)


def _low(values: deque, since: int) -> float | None:
    """The QUANTILE of the (tick, seconds) samples taken at tick `since` or later; None: none."""
    ordered = sorted(t for tick, t in values if tick >= since)
    return ordered[int(QUANTILE * (len(ordered) - 1))] if ordered else None


class StepCosts:
    """Measured step costs per batch size (the module docstring): the target's T_B(n) and per-source draft costs."""

    def __init__(self, slope: float = DEFAULT_SLOPE, window: int = WINDOW):
        if not slope >= 0:
            raise ValueError(f"slope must be >= 0, got {slope}")
        self.slope, self.window = slope, window
        self._verify: dict[int, dict[int, deque]] = {}  # batch -> n -> (tick, seconds) of recent passes
        self._draft: dict[tuple[int, int], deque] = {}  # (source, batch) -> (tick, seconds per drafted token)
        self._ticks: dict[int, int] = {}  # batch -> passes measured at that batch size (a sample's age)
        self._curves: dict[tuple, list[float] | None] = {}  # `curve`'s answers since the last measurement

    def observe_verify(self, n: int, seconds: float, batch: int) -> None:
        self._curves.clear()
        tick = self._ticks[batch] = self._ticks.get(batch, 0) + 1
        self._verify.setdefault(batch, {}).setdefault(n, deque(maxlen=self.window)).append((tick, seconds))

    def observe_draft(self, source: int, seconds_per_token: float, batch: int) -> None:
        self._curves.clear()
        sample = (self._ticks.get(batch, 0), seconds_per_token)
        self._draft.setdefault((source, batch), deque(maxlen=self.window)).append(sample)

    def seed(self, batch: int, curve: list[float], draft_cost: float | None, source: int = 0) -> None:
        """A calibration at one batch size: T_B(1..len(curve)) and a draft source's seconds per token (None: none)."""
        for n, t in enumerate(curve, 1):
            self.observe_verify(n, t, batch)
        if draft_cost is not None:
            self.observe_draft(source, draft_cost, batch)

    def measured(self, batch: int) -> dict[int, float]:
        """n -> the estimate of T_batch(n), where measured at this batch size in the last STALE passes (an older
        measurement, e.g. a calibration taken under another load, is priced as unmeasured: probes measure it)."""
        since = self._ticks.get(batch, 0) - STALE
        fresh = {n: _low(v, since) for n, v in sorted(self._verify.get(batch, {}).items())}
        return {n: t for n, t in fresh.items() if t is not None}

    def curve(self, batch: int, max_n: int, optimistic: bool = False) -> list[float] | None:
        """T_batch(1..max_n): measured values, linear between measured n, the prior beyond (module docstring);
        None while T_batch(1) is unmeasured. optimistic: beyond the largest measured n, its value (what a probe
        hopes for: a width is measured once a step runs it)."""
        key = (batch, max_n, optimistic)
        if key not in self._curves:
            self._curves[key] = self._curve(batch, max_n, optimistic)
        return self._curves[key]

    def _curve(self, batch: int, max_n: int, optimistic: bool) -> list[float] | None:
        own = self.measured(batch)
        if 1 not in own:
            return None
        t1, ratios = own[1], self._ratios(batch)
        out = []
        for n in range(1, max_n + 1):
            lo = max(m for m in own if m <= n)
            hi = min((m for m in own if m >= n), default=None)
            if hi is not None:
                t = own[lo] if hi == lo else own[lo] + (own[hi] - own[lo]) * (n - lo) / (hi - lo)
            elif optimistic:
                t = own[lo]
            elif n in ratios:
                t = max(own[lo], t1 * ratios[n])
            else:
                t = own[lo] + t1 * self.slope * (n - lo)
            out.append(max(t, 1e-9))
        return out

    def _ratios(self, batch: int) -> dict[int, float]:
        """T(n) / T(1) at the nearest other batch size that measured both (the shape borrowed for unmeasured n)."""
        others = [b for b, v in self._verify.items() if b != batch and 1 in v and len(v) > 1]
        if not others:
            return {}
        near = self.measured(min(others, key=lambda b: (abs(b - batch), -b)))
        return {n: t / near[1] for n, t in near.items()}

    def draft_cost(self, source: int, batch: int) -> float | None:
        """Seconds per drafted token of a source at this batch size (the nearest batch size measured), or None."""
        sizes = [b for s, b in self._draft if s == source]
        if not sizes:
            return None
        near = min(sizes, key=lambda b: (abs(b - batch), -b))
        return _low(self._draft[(source, near)], self._ticks.get(near, 0) - STALE)

    def batches(self) -> list[int]:
        return sorted(self._verify)
