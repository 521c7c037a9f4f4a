"""The lossy acceptance rules (verispec.sampling.lossy): their one-step laws, computed by hand on the seed example
p = (0.6, 0.3, 0.1), q = (0.4, 0.5, 0.1), differ from p by exactly the amount the formulas give, and the verifiers
really sample those laws (chi-square against the law, and against p, which they must fail).

Chi-square tests: level 1e-3 for "samples its law" (n = 40 000 first tokens), and "is not p" must reach p < 1e-9:
at n = 40 000 over 3 bins the test has power ~1 against TV 0.075 or more (the smallest deviation tested here), so
a failure to reject p means the rule does not deviate as stated."""

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
    one_step_law_spec_rl,
    one_step_law_typical,
    spec_rl_verifier,
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


def test_spec_rl_laws_by_hand():
    # l = 1: accepted mass min(p, q) = (0.4, 0.3, 0.1), alpha 0.8; the rejected 0.2 is redrawn from p
    # (0.12, 0.06, 0.02), not from the residual (1, 0, 0): (0.52, 0.36, 0.12), the seed's "resample from p", TV 0.08
    law = one_step_law_spec_rl(P, Q)
    torch.testing.assert_close(law, torch.tensor([0.52, 0.36, 0.12], dtype=torch.float64))
    assert _tv(law, P) == pytest.approx(0.08)
    # l = 1.5: accepted min(q, 1.5 p) = (0.4, 0.45, 0.1), rejected 0.05 redrawn from p: (0.43, 0.465, 0.105), TV 0.17
    law = one_step_law_spec_rl(P, Q, 1.5)
    torch.testing.assert_close(law, torch.tensor([0.43, 0.465, 0.105], dtype=torch.float64))
    assert _tv(law, P) == pytest.approx(0.17)
    # l = 2: q <= 2 p everywhere, every draft is accepted: the output is the old policy's q, TV(q, p) = 0.2
    torch.testing.assert_close(one_step_law_spec_rl(P, Q, 2.0), Q)
    # on this example more lenience, more bias: TV 0.08 < 0.17 < 0.2; with q = p it accepts everything and is exact
    torch.testing.assert_close(one_step_law_spec_rl(P, P), P)


def test_spec_rl_at_lenience_one_is_the_resample_from_p_bug():
    """Token for token the injected bug resample_from_p (same uniforms): SPEC-RL's rule at l = 1 is that mistake."""
    from verispec.certify.bugs import broken_verifier

    g = torch.Generator().manual_seed(3)
    n, k, v = 512, 3, 5
    p = torch.softmax(torch.randn(n, k + 1, v, generator=g), -1)
    q = torch.softmax(torch.randn(n, k, v, generator=g), -1)
    ids = torch.multinomial(q.reshape(-1, v), 1, generator=g).view(n, k)
    outs = []
    for verify in (spec_rl_verifier(1.0), broken_verifier("resample_from_p")):
        gens = [torch.Generator().manual_seed(100 + i) for i in range(n)]
        outs.append(verify(p, ids, q, generators=gens))
    torch.testing.assert_close(outs[0].token_ids, outs[1].token_ids)
    torch.testing.assert_close(outs[0].num_accepted, outs[1].num_accepted)
    assert 0 < int(outs[0].num_accepted.sum()) < n * k  # acceptances and rejections both happened


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
        (spec_rl_verifier(), one_step_law_spec_rl(P, Q)),
        (spec_rl_verifier(1.5), one_step_law_spec_rl(P, Q, 1.5)),
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


def test_spec_rl_lenience_is_checked():
    assert spec_rl_verifier().__name__ == "spec_rl_1" and spec_rl_verifier(1.5).__name__ == "spec_rl_1.5"
    for bad in (0.5, 0.999, 0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="lenience must be a finite number >= 1"):
            spec_rl_verifier(bad)
