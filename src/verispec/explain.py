"""`verispec explain`: one speculative step on a small vocabulary, in exact rational arithmetic.

For each token x: p(x), q(x), the acceptance probability a(x) = min(1, p/q), the accept mass
min(p, q) = q(x) a(x), the residual mass (p - q)+, and P(output = x) = min(p, q) + (p - q)+ = p(x).
`wrong=True` adds the two classic mistakes: on rejection resample from p, or from |p - q| / sum |p - q|.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

__all__ = ["ExplainResult", "TokenRow", "explain", "format_fraction", "parse_distribution"]


@dataclass(frozen=True)
class TokenRow:
    """One token of `explain`'s table, in exact fractions.

    Attributes:
        label: The token's name.
        p: Its target probability.
        q: Its draft probability.
        accept_prob: min(1, p/q); None where q = 0 (the draft never proposes it).
        accept_mass: min(p, q): the probability it is drafted and accepted.
        residual_mass: (p - q)+: its share of the residual.
        output_prob: P(output = x) = accept_mass + P(reject) * residual(x): equal to p.
    """

    label: str
    p: Fraction
    q: Fraction
    accept_prob: Fraction | None
    accept_mass: Fraction
    residual_mass: Fraction
    output_prob: Fraction


@dataclass(frozen=True)
class ExplainResult:
    """What `explain` returns.

    Attributes:
        tokens: One row per token.
        p_accept: alpha = sum min(p, q), the probability the draft is accepted.
        z: sum (p - q)+ = 1 - alpha, the residual's mass (the probability of a rejection).
        wrong: With `wrong=True`: mistake -> token label -> output probability, for "resample_from_p" and
            "resample_from_abs_diff"; else None.
    """

    tokens: list[TokenRow]
    p_accept: Fraction
    z: Fraction
    wrong: dict[str, dict[str, Fraction]] | None


def parse_distribution(text: str, name: str) -> list[Fraction]:
    """'0.6,0.3,0.1' -> exact fractions; raises ValueError with a one-line reason."""
    parts = [s.strip() for s in text.split(",")]
    if not parts or any(s == "" for s in parts):
        raise ValueError(f"--{name}: expected comma-separated probabilities, got {text!r}")
    try:
        values = [Fraction(s) for s in parts]
    except (ValueError, ZeroDivisionError):
        raise ValueError(f"--{name}: {text!r} is not a list of numbers") from None
    if any(v < 0 for v in values):
        raise ValueError(f"--{name}: probabilities must be >= 0, got {text}")
    total = sum(values, Fraction(0))
    if total != 1:
        raise ValueError(f"--{name}: probabilities must sum to exactly 1, they sum to {format_fraction(total)}")
    return values


def format_fraction(x: Fraction) -> str:
    """Exact decimal string when the fraction terminates in base 10 ('0.52'), else 'n/d'."""
    den = x.denominator
    twos = fives = 0
    while den % 2 == 0:
        den //= 2
        twos += 1
    while den % 5 == 0:
        den //= 5
        fives += 1
    if den != 1:
        return f"{x.numerator}/{x.denominator}"
    digits = max(twos, fives)
    if digits == 0:
        return str(x.numerator)
    scaled = abs(x.numerator) * 10**digits // x.denominator
    s = f"{scaled // 10**digits}.{scaled % 10**digits:0{digits}d}".rstrip("0").rstrip(".")
    return ("-" if x < 0 else "") + s


def explain(
    p: list[Fraction], q: list[Fraction], labels: list[str] | None = None, wrong: bool = False
) -> ExplainResult:
    """One speculative step in exact rational arithmetic: why accept-with-min(1, p/q) plus resampling from the
    residual (p - q)+ emits exactly p (`verispec explain`).

    ```python
    from fractions import Fraction as F
    r = explain([F(6, 10), F(3, 10), F(1, 10)], [F(4, 10), F(5, 10), F(1, 10)], ["cat", "dog", "fish"])
    [row.output_prob for row in r.tokens]      # [Fraction(3, 5), Fraction(3, 10), Fraction(1, 10)]: p
    ```

    Args:
        p: The target distribution (exact fractions summing to 1; `parse_distribution` reads '0.6,0.3,0.1').
        q: The draft distribution, as long as p.
        labels: Token names (default t0, t1, ...).
        wrong: Also compute two classic mistakes: on a rejection, resample from p, or from |p - q| / sum |p - q|.

    Returns:
        Every token's acceptance probability, accept mass, residual mass and output probability, with
        P(accept) and Z.

    Raises:
        ValueError: p, q and labels differ in length.
    """
    if len(p) != len(q):
        raise ValueError(f"p and q must have the same length, got {len(p)} and {len(q)}")
    labels = [f"t{i}" for i in range(len(p))] if labels is None else labels
    if len(labels) != len(p):
        raise ValueError(f"--labels has {len(labels)} names for {len(p)} tokens")
    accept = [min(pi, qi) for pi, qi in zip(p, q)]
    resid = [max(pi - qi, Fraction(0)) for pi, qi in zip(p, q)]
    p_accept = sum(accept, Fraction(0))

    def output(weights: list[Fraction]) -> list[Fraction]:  # a rejection (probability 1 - p_accept) draws by weights
        total = sum(weights, Fraction(0))
        if total == 0:  # p == q: never rejected, the resampling rule is never used
            return list(accept)
        return [a + (1 - p_accept) * w / total for a, w in zip(accept, weights)]

    rows = [
        TokenRow(lab, pi, qi, None if qi == 0 else min(Fraction(1), pi / qi), a, r, o)
        for lab, pi, qi, a, r, o in zip(labels, p, q, accept, resid, output(resid))
    ]
    wrong_out = None
    if wrong:
        wrong_out = {
            "resample_from_p": dict(zip(labels, output(list(p)))),
            "resample_from_abs_diff": dict(zip(labels, output([abs(pi - qi) for pi, qi in zip(p, q)]))),
        }
    return ExplainResult(tokens=rows, p_accept=p_accept, z=sum(resid, Fraction(0)), wrong=wrong_out)


def to_json(result: ExplainResult) -> dict:
    """The result with every fraction as `format_fraction`'s string (`verispec explain --json`)."""

    def f(x):
        return None if x is None else format_fraction(x) if isinstance(x, Fraction) else x

    doc: dict = {"tokens": [{k: f(v) for k, v in vars(r).items()} for r in result.tokens]}
    doc.update(p_accept=f(result.p_accept), z=f(result.z))
    if result.wrong is not None:
        doc["wrong"] = {name: {lab: f(v) for lab, v in dist.items()} for name, dist in result.wrong.items()}
    return doc
