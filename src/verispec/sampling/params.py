"""Sampling parameters: one frozen, validated description of the distribution to sample from.

The same `SamplingParams` is used to build the target's distribution p and the draft's distribution q
(see `verispec.sampling.processors.probs_from_logits`), which is what keeps speculative decoding lossless.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Integral, Real

__all__ = ["ParamError", "SamplingParams"]


class ParamError(ValueError):
    """A sampling parameter out of range. `field` names the SamplingParams field, so each front end can say it
    in its own words (the CLI's `--temperature`, the server's request field `temperature`)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"SamplingParams.{field} {message}")
        self.field = field
        self.message = message  # without the field name: "must be >= 0 (0 = greedy), got -1.0"


def _real(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, Real):
        raise ParamError(name, f"must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ParamError(name, f"must be finite, got {value!r}")
    return value


@dataclass(frozen=True)
class SamplingParams:
    """How to turn a model's logits into the distribution that is sampled from.

    The processing order is fixed and documented in `probs_from_logits`:
    penalties -> temperature -> top_k -> top_p -> min_p -> softmax.

    Fields (defaults give plain sampling from the model at temperature 1):
        temperature: > 0 divides the logits; 0 means greedy (a one-hot distribution on the argmax,
            ties broken towards the lowest token id).
        top_k: keep the k most probable tokens; 0 disables.
        top_p: keep the smallest set of most probable tokens whose mass reaches top_p; in (0, 1], 1 disables.
        min_p: drop tokens whose probability is below min_p times the largest one; in [0, 1], 0 disables.
        repetition_penalty: > 0; tokens seen in the prompt or the output get logit / r if positive,
            logit * r otherwise (the HF transformers / vLLM convention); 1 disables.
        presence_penalty: in [-2, 2]; subtracted once from the logit of every token already in the output.
        frequency_penalty: in [-2, 2]; subtracted once per occurrence in the output.
        seed: per-request seed for the request's own random stream; None draws from the global one.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen: normalise the validated values in place, once
        t = _real("temperature", self.temperature)
        if t < 0:
            raise ParamError("temperature", f"must be >= 0 (0 = greedy), got {t}")
        set_(self, "temperature", t)
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, Integral) or self.top_k < 0:
            raise ParamError("top_k", f"must be an integer >= 0 (0 = disabled), got {self.top_k!r}")
        set_(self, "top_k", int(self.top_k))
        top_p = _real("top_p", self.top_p)
        if not 0.0 < top_p <= 1.0:
            raise ParamError("top_p", f"must be in (0, 1], got {top_p}")
        set_(self, "top_p", top_p)
        min_p = _real("min_p", self.min_p)
        if not 0.0 <= min_p <= 1.0:
            raise ParamError("min_p", f"must be in [0, 1], got {min_p}")
        set_(self, "min_p", min_p)
        rep = _real("repetition_penalty", self.repetition_penalty)
        if rep <= 0:
            raise ParamError("repetition_penalty", f"must be > 0 (1 = disabled), got {rep}")
        set_(self, "repetition_penalty", rep)
        for name in ("presence_penalty", "frequency_penalty"):
            v = _real(name, getattr(self, name))
            if not -2.0 <= v <= 2.0:
                raise ParamError(name, f"must be in [-2, 2], got {v}")
            set_(self, name, v)
        if self.seed is not None:
            if isinstance(self.seed, bool) or not isinstance(self.seed, Integral) or not 0 <= self.seed < 2**63:
                raise ParamError("seed", f"must be None or an integer in [0, 2**63), got {self.seed!r}")
            set_(self, "seed", int(self.seed))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def uses_truncation(self) -> bool:
        """True when top_k or top_p needs a sort of the vocabulary."""
        return self.top_k > 0 or self.top_p < 1.0
