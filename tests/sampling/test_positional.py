"""Position-keyed verification (verispec.sampling.positional): keyed uniforms, exact cases, the kernel certificate
(completed-sequence laws), and the invariance it exists for, on a prefix-dependent toy model: decoding with any
schedule of draft lengths gives the same tokens, which the classic rule (a bonus draw from p) does not."""

from __future__ import annotations

import random

import pytest
import torch

from verispec.certify.kernel import certify_kernel
from verispec.sampling.chain import sample_from_weights
from verispec.sampling.positional import (
    ACCEPT,
    DRAFT,
    FINAL,
    keyed_uniform,
    keyed_uniforms,
    positional_verifier,
    verify_positional,
)

from ..helpers.toy_lm import ToyLM


def test_keyed_uniforms_are_functions_of_their_key():
    a = keyed_uniform(3, 10, ACCEPT)
    assert a == keyed_uniform(3, 10, ACCEPT) and 0.0 <= a < 1.0
    assert len({a, keyed_uniform(3, 10, FINAL), keyed_uniform(3, 11, ACCEPT), keyed_uniform(4, 10, ACCEPT)}) == 4
    u = keyed_uniforms([3, 4], [[10, 11], [10, 11]], ACCEPT)
    assert u.shape == (2, 2) and float(u[0, 0]) == a


def _step(p, q, ids, fed, acc, fin, has_last=None):
    t = lambda x: torch.tensor(x, dtype=torch.float64)  # noqa: E731
    return verify_positional(
        t(p).unsqueeze(0),
        torch.tensor([ids]),
        t(q).unsqueeze(0),
        torch.tensor([fed]),
        t([acc]),
        t([fin]),
        None if has_last is None else torch.tensor([has_last]),
    )


P = [[0.6, 0.3, 0.1], [0.2, 0.5, 0.3]]
Q = [[0.4, 0.5, 0.1], [0.2, 0.3, 0.5]]


def test_every_slot_accepted_ends_with_the_last_draft():
    out = _step(P, Q, [0, 1], 1, [0.1, 0.1], [0.5, 0.5])  # cat accepted (q < p), then slot 1's draft 1 accepted
    assert out.token_ids.tolist() == [[0, 1]] and out.num_accepted.tolist() == [1]


def test_a_rejection_draws_the_residual_with_that_slots_uniform():
    out = _step(P, Q, [1, 0], 1, [0.99, 0.0], [0.0, 0.5])  # dog: u q = 0.495 >= 0.3, rejected at slot 0
    assert out.num_accepted.tolist() == [0] and out.token_ids[0, 0].item() == 0  # residual (p - q)+ is all cat
    out = _step(P, Q, [0, 2], 1, [0.0, 0.99], [0.5, 0.0])  # slot 1's draft (fish) rejected: residual at slot 1
    assert out.token_ids.tolist() == [[0, 1]]  # (p - q)+ at slot 1 = {dog: 0.2}


def test_a_missing_last_draft_is_a_bonus_draw_and_p_zero_is_never_kept():
    out = _step(P, Q, [0, -1], 1, [0.0, 0.0], [0.0, 0.99], has_last=False)
    assert out.token_ids.tolist() == [[0, 2]]  # bonus from p at slot 1 with u = 0.99: fish
    p0 = [[0.0, 0.5, 0.5], [0.2, 0.5, 0.3]]
    out = _step(p0, Q, [0, 1], 1, [0.0, 0.0], [0.0, 0.0])
    assert out.num_accepted.tolist() == [0] and out.token_ids[0, 0].item() != 0


@pytest.mark.statistical
def test_kernel_certificate_passes_the_positional_rule():
    """20k steps per case, the completed-sequence laws (family-wise level 0.01, Holm)."""
    report = certify_kernel(positional_verifier, samples=20_000, laws="sequence")
    assert report.passed, report.to_markdown()


def decode(lm: ToyLM, seed: int, length: int, schedule, positional: bool = True) -> list[int]:
    """Speculative decoding of `length` tokens from the toy model with the given draft lengths per step. positional:
    the rule of sampling.positional (every uniform keyed, the last slot drafted); else the classic rule with the
    same keyed uniforms but a bonus draw from p after the fed drafts."""
    out: list[int] = []
    steps = iter(schedule)
    while len(out) < length:
        n = next(steps)
        drafts = []
        for j in range(n + (1 if positional else 0)):  # drafts from q, keyed by their output position
            q = lm.dist(tuple(out + drafts), "q")
            drafts.append(
                int(sample_from_weights(q.unsqueeze(0), torch.tensor([keyed_uniform(seed, len(out) + j, DRAFT)])))
            )
        slots = len(drafts) if positional else n + 1
        p = torch.stack([lm.dist(tuple(out + drafts[:j]), "p") for j in range(slots)]).unsqueeze(0)
        pos = [[len(out) + j for j in range(slots)]]
        acc, fin = keyed_uniforms([seed], pos, ACCEPT), keyed_uniforms([seed], pos, FINAL)
        q = torch.stack([lm.dist(tuple(out + drafts[:j]), "q") for j in range(slots)]).unsqueeze(0)
        ids = torch.tensor([drafts + [-1] * (slots - len(drafts))])
        has_last = torch.tensor([positional])
        res = verify_positional(p, ids, q, torch.tensor([slots - 1]), acc, fin, has_last=has_last)
        a = int(res.num_accepted)
        out += res.token_ids[0, : a + 1].tolist()
    return out[:length]


def test_the_output_does_not_depend_on_the_draft_lengths():
    """40 seeds of a prefix-dependent toy model: gamma 1, 3, 8 and a random schedule (what gamma auto does) give
    the same 12 tokens under the positional rule; the classic rule with the same keyed uniforms does not."""
    lm = ToyLM(vocab=5, seed=11, scale=1.0)
    rng = random.Random(0)
    classic_differs = 0
    for seed in range(40):
        ref = decode(lm, seed, 12, iter(lambda: 1, None))
        for schedule in ([3] * 12, [8] * 12, [rng.randint(0, 8) for _ in range(12)]):
            assert decode(lm, seed, 12, schedule) == ref, (seed, schedule)
        classic_differs += decode(lm, seed, 12, [1] * 12, False) != decode(lm, seed, 12, [5] * 12, False)
    assert classic_differs >= 20, classic_differs
