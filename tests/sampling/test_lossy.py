"""The lossy acceptance rules (verispec.sampling.lossy): their one-step laws, computed by hand on the seed example
p = (0.6, 0.3, 0.1), q = (0.4, 0.5, 0.1), differ from p by exactly the amount the formulas give, and the verifiers
really sample those laws (chi-square against the law, and against p, which they must fail)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from verispec.certify.stats import chisquare_gof
from verispec.sampling.lossy import (
    lenient_verifier,
    one_step_law_lenient,
    one_step_law_mismatched_q,
    one_step_law_typical,
    typical_verifier,
)

P = torch.tensor([0.6, 0.3, 0.1], dtype=torch.float64)
Q = torch.tensor([0.4, 0.5, 0.1], dtype=torch.float64)


def _tv(a, b) -> float:
    return 0.5 * float((a - b).abs().sum())


def test_lenient_laws_by_hand():
    # l = 1 is the exact rule
    torch.testing.assert_close(one_step_law_lenient(P, Q, 1.0), P)
    # l = 0.8: a = min(1, p / (0.8 q)) = (1, 0.75, 1); accepted mass (0.4, 0.375, 0.1); rejected 0.125 goes to the
    # residual (p - q)+ / Z = (1, 0, 0)
    law = one_step_law_lenient(P, Q, 0.8)
    torch.testing.assert_close(law, torch.tensor([0.525, 0.375, 0.1], dtype=torch.float64))
    assert _tv(law, P) == pytest.approx(0.075)
    # l = 0.5: every draft is accepted (p / (0.5 q) >= 1 for all three): the output is q itself, TV(q, p) = 0.2
    torch.testing.assert_close(one_step_law_lenient(P, Q, 0.5), Q)
    assert _tv(one_step_law_lenient(P, Q, 0.5), P) == pytest.approx(0.2)


def test_typical_laws_by_hand():
    h = -(0.6 * math.log(0.6) + 0.3 * math.log(0.3) + 0.1 * math.log(0.1))  # 0.898 nats
    # defaults eps 0.3, delta 0.09: threshold min(0.3, 0.09 e^-H) = 0.037 < every p: all accepted, the output is q
    assert 0.09 * math.exp(-h) == pytest.approx(0.0367, abs=1e-4)
    torch.testing.assert_close(one_step_law_typical(P, Q), Q)
    # eps 0.2, delta 0.9: threshold min(0.2, 0.367) = 0.2: cat and dog accepted, fish (p = 0.1) rejected; its q mass
    # 0.1 is redrawn from p: (0.4 + 0.06, 0.5 + 0.03, 0 + 0.01)
    law = one_step_law_typical(P, Q, eps=0.2, delta=0.9)
    torch.testing.assert_close(law, torch.tensor([0.46, 0.53, 0.01], dtype=torch.float64))
    assert _tv(law, P) == pytest.approx(0.23)


def test_mismatched_q_laws_by_hand():
    torch.testing.assert_close(one_step_law_mismatched_q(P, Q, Q), P)  # verified with the q it was drawn from
    # verified as if drawn from p: every draft accepted (min(1, p / p) = 1), so the output is what was drawn, q
    torch.testing.assert_close(one_step_law_mismatched_q(P, Q, P), Q)
    # q_used = (0.5, 0.4, 0.1): a = (1, 0.75, 1); accepted (0.4, 0.375, 0.1); residual (p - q_used)+ = (1, 0, 0)
    law = one_step_law_mismatched_q(P, Q, torch.tensor([0.5, 0.4, 0.1], dtype=torch.float64))
    torch.testing.assert_close(law, torch.tensor([0.525, 0.375, 0.1], dtype=torch.float64))


def _first_tokens(verify, n: int = 40_000) -> np.ndarray:
    """Counts of the first emitted token over n one-draft steps of the seed example (drafts drawn from q)."""
    g = torch.Generator().manual_seed(0)
    p, q = P.float(), Q.float()
    ids = torch.multinomial(q, n, replacement=True, generator=g).view(n, 1)
    torch.manual_seed(1)
    out = verify(p.expand(n, 2, 3).contiguous(), ids, q.view(1, 1, 3).expand(n, 1, 3).contiguous())
    return np.bincount(out.token_ids[:, 0].numpy(), minlength=3)


@pytest.mark.statistical
@pytest.mark.parametrize(
    "verify, law",
    [
        (lenient_verifier(0.8), one_step_law_lenient(P, Q, 0.8)),
        (lenient_verifier(0.5), Q),
        (typical_verifier(eps=0.2, delta=0.9), one_step_law_typical(P, Q, eps=0.2, delta=0.9)),
    ],
)
def test_verifiers_sample_their_stated_law_not_p(verify, law):
    counts = _first_tokens(verify)
    assert chisquare_gof(counts, law.numpy()).pvalue > 1e-3  # the law computed above
    assert chisquare_gof(counts, P.numpy()).pvalue < 1e-9  # and not the target's: these rules are lossy


@pytest.mark.statistical
def test_lenience_one_is_lossless_and_bad_lenience_raises():
    assert chisquare_gof(_first_tokens(lenient_verifier(1.0)), P.numpy()).pvalue > 1e-3
    assert lenient_verifier(0.25).__name__ == "lenient_0.25"
    for bad in (0.0, -0.5, 1.5):
        with pytest.raises(ValueError, match="lenience"):
            lenient_verifier(bad)
