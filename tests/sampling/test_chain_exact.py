"""Exact (non-statistical) tests of verify_chain: hand-built cases, explicit uniforms, determinism, bad input."""

from __future__ import annotations

import pytest
import torch

from verispec.sampling import acceptance_rate, draw_uniforms, verify_chain, verify_chain_with_uniforms

P = torch.tensor([0.6, 0.3, 0.1])  # seed tutorial: {cat, dog, fish}
Q = torch.tensor([0.4, 0.5, 0.1])
CAT, DOG, FISH = 0, 1, 2


def seed_step(draft: int, u: float, v: float):
    target = torch.stack([P, P]).unsqueeze(0)  # [1, 2, 3]: position 0 and the bonus position
    return verify_chain_with_uniforms(
        target,
        torch.tensor([[draft]]),
        Q.view(1, 1, 3),
        torch.tensor([1]),
        torch.tensor([[u]], dtype=torch.float64),
        torch.tensor([v], dtype=torch.float64),
    )


def _first_token_law(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The law of the first token verify_chain_with_uniforms emits for one draft t ~ q, integrated exactly over its
    uniforms (u, v): (u, v) space splits into rectangles on which the rule's answer is constant — u below or above
    p(t) / q(t), v between two breakpoints of the residual's CDF — and the implementation is run once per rectangle,
    at its centre, the answer weighted by q(t) x the rectangle's area."""
    V = p.numel()
    resid = (p - q).clamp_min(0)
    breaks = torch.unique(
        torch.cat(
            [
                torch.zeros(1, dtype=torch.float64),
                (resid / resid.sum()).cumsum(0).clamp(max=1),
                torch.ones(1, dtype=torch.float64),
            ]
        )
    )
    cells = []  # (draft, u, v, weight)
    for t in range(V):
        a = min(1.0, float(p[t] / q[t]))
        for u_lo, u_hi in ((0.0, a), (a, 1.0)):
            for v_lo, v_hi in zip(breaks[:-1].tolist(), breaks[1:].tolist()):
                if u_hi > u_lo and v_hi > v_lo:
                    cells.append((t, (u_lo + u_hi) / 2, (v_lo + v_hi) / 2, float(q[t]) * (u_hi - u_lo) * (v_hi - v_lo)))
    B = len(cells)
    out = verify_chain_with_uniforms(
        torch.stack([p, p]).expand(B, 2, V),
        torch.tensor([[c[0]] for c in cells]),
        q.view(1, 1, V).expand(B, 1, V),
        torch.ones(B, dtype=torch.int64),
        torch.tensor([[c[1]] for c in cells], dtype=torch.float64),
        torch.tensor([c[2] for c in cells], dtype=torch.float64),
    )
    law = torch.zeros(V, dtype=torch.float64)
    law.index_add_(0, out.token_ids[:, 0], torch.tensor([c[3] for c in cells], dtype=torch.float64))
    return law


def test_money_equation():
    """P(emit x) = min(p, q)(x) + (1 - alpha) (p - q)+(x) / Z = p(x), for verify_chain_with_uniforms itself: its
    first-token law, integrated exactly over the uniforms, is p — on the seed example and on random p, q."""
    g = torch.Generator().manual_seed(0)
    random_pq = torch.randn(2, 8, generator=g, dtype=torch.float64).mul(1.5).softmax(-1)
    seed_pq = torch.tensor([[0.6, 0.3, 0.1], [0.4, 0.5, 0.1]], dtype=torch.float64)  # P, Q in float64
    for p, q in ((seed_pq[0], seed_pq[1]), (random_pq[0], random_pq[1])):
        law = _first_token_law(p, q)
        torch.testing.assert_close(law, p, atol=1e-12, rtol=0)
        torch.testing.assert_close(1 - acceptance_rate(p, q), (p - q).clamp_min(0).sum(), atol=1e-15, rtol=0)
    # the classic mistake, for contrast: resampling from p at a rejection does not give p
    p, q = seed_pq
    wrong = torch.minimum(p, q) + (1 - acceptance_rate(p, q)) * p
    assert (wrong - p).abs().max() > 0.05


def test_seed_example_acceptance_threshold():
    """dog has a(dog) = min(1, 0.3/0.5) = 0.6: accepted iff u < 0.6; on rejection the residual is all cat."""
    out = seed_step(DOG, 0.59, 0.5)
    assert out.num_accepted.item() == 1 and out.token_ids[0, 0].item() == DOG
    for v in (0.0, 0.3, 0.999999):
        out = seed_step(DOG, 0.61, v)
        assert out.num_accepted.item() == 0
        assert out.token_ids.tolist() == [[CAT, -1]]  # residual (p - q)+ / Z = (0.2, 0, 0) / 0.2


def test_seed_example_cat_and_fish_always_accepted():
    for tok in (CAT, FISH):
        out = seed_step(tok, 1 - 2**-53, 0.5)
        assert out.num_accepted.item() == 1 and out.token_ids[0, 0].item() == tok


def test_bonus_token_after_full_acceptance():
    out = seed_step(CAT, 0.0, 0.0)  # u = 0: accept; bonus with v = 0: first token with mass (cat)
    assert out.token_ids.tolist() == [[CAT, CAT]]
    out = seed_step(CAT, 0.0, 0.95)  # cdf of p: 0.6, 0.9, 1.0 -> fish
    assert out.token_ids.tolist() == [[CAT, FISH]]


def test_zero_target_probability_never_accepted_even_with_u_zero():
    p = torch.tensor([[[0.0, 1.0], [0.5, 0.5]]])
    q = torch.tensor([[[1.0, 0.0]]])
    out = verify_chain_with_uniforms(
        p,
        torch.tensor([[0]]),
        q,
        torch.tensor([1]),
        torch.zeros(1, 1, dtype=torch.float64),
        torch.zeros(1, dtype=torch.float64),
    )
    assert out.num_accepted.item() == 0 and out.token_ids.tolist() == [[1, -1]]


def test_zero_residual_mass_gives_no_nan():
    """p == q with a forced rejection (u = 1, outside the sampler's range) leaves Z = 0: fall back to p."""
    p = torch.tensor([[[0.25, 0.75, 0.0], [1 / 3, 1 / 3, 1 / 3]]])
    out = verify_chain_with_uniforms(
        p,
        torch.tensor([[1]]),
        p[:, :1].clone(),
        torch.tensor([1]),
        torch.ones(1, 1, dtype=torch.float64),
        torch.tensor([0.5], dtype=torch.float64),
    )
    assert out.num_accepted.item() == 0
    assert out.token_ids[0, 0].item() == 1  # drawn from p = (0.25, 0.75, 0): the 0.5 quantile is token 1


def test_one_hot_drafts_residual_excludes_the_draft():
    p = torch.tensor([[[0.5, 0.25, 0.25], [1.0, 0.0, 0.0]]])
    for v, expect in ((0.0, 0), (0.66, 0), (0.67, 2), (0.999, 2)):  # residual = (0.5, 0, 0.25) / 0.75
        out = verify_chain_with_uniforms(
            p,
            torch.tensor([[1]]),
            None,
            torch.tensor([1]),
            torch.tensor([[0.9]], dtype=torch.float64),
            torch.tensor([v], dtype=torch.float64),
        )
        assert out.num_accepted.item() == 0 and out.token_ids[0, 0].item() == expect


def _random_batch(B=6, k=4, V=20, seed=0):
    g = torch.Generator().manual_seed(seed)
    p = torch.randn(B, k + 1, V, generator=g).softmax(-1)
    q = torch.randn(B, k, V, generator=g).softmax(-1)
    ids = torch.multinomial(q.view(-1, V), 1, generator=g).view(B, k)
    return p, ids, q


def test_per_row_seed_is_batch_invariant():
    p, ids, q = _random_batch(B=6)
    nd = torch.tensor([4, 0, 2, 4, 1, 3])
    gens = [torch.Generator().manual_seed(100 + b) for b in range(6)]
    batch = verify_chain(p, ids, q, nd, gens)
    for b in range(6):
        alone = verify_chain(
            p[b : b + 1], ids[b : b + 1], q[b : b + 1], nd[b : b + 1], [torch.Generator().manual_seed(100 + b)]
        )
        assert torch.equal(alone.token_ids[0], batch.token_ids[b])
    # another batch around row 2, in another place, with other neighbours: same row-2 output
    perm = [2, 5, 0]
    other = verify_chain(p[perm], ids[perm], q[perm], nd[perm], [torch.Generator().manual_seed(100 + b) for b in perm])
    assert torch.equal(other.token_ids[0], batch.token_ids[2])


def test_same_seed_same_output_and_generator_advance():
    p, ids, q = _random_batch(B=3)
    nd = torch.tensor([0, 2, 4])
    outs = [verify_chain(p, ids, q, nd, [torch.Generator().manual_seed(s) for s in (1, 2, 3)]) for _ in range(2)]
    assert torch.equal(outs[0].token_ids, outs[1].token_ids)
    gens = [torch.Generator().manual_seed(s) for s in (1, 2, 3)]
    verify_chain(p, ids, q, nd, gens)
    for g, s, n in zip(gens, (1, 2, 3), nd.tolist()):  # row b consumed exactly nd[b] + 1 uniforms
        ref = torch.Generator().manual_seed(s)
        torch.rand(n + 1, dtype=torch.float64, generator=ref)
        assert torch.equal(torch.rand(3, generator=g), torch.rand(3, generator=ref))


def test_rows_without_drafts_consume_no_acceptance_randomness():
    accept_u, final_u = draw_uniforms(
        torch.tensor([0, 3]),
        3,
        [torch.Generator().manual_seed(0)] * 1 + [torch.Generator().manual_seed(1)],
        torch.device("cpu"),
    )
    assert accept_u[0].tolist() == [0.0, 0.0, 0.0]
    ref = torch.rand(1, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    assert final_u[0].item() == ref.item()


def test_ragged_rows_ignore_padding_garbage():
    """Positions beyond num_draft_tokens may hold anything (uninitialised buffers): never read."""
    p, ids, q = _random_batch(B=2, k=4)
    nd = torch.tensor([1, 2])
    p2, ids2, q2 = p.clone(), ids.clone(), q.clone()
    p2[0, 2:] = float("nan")
    q2[0, 1:] = float("nan")
    ids2[0, 1:] = -1
    p2[1, 3:] = -5.0
    ids2[1, 2:] = 10**6
    a = verify_chain(p, ids, q, nd, [torch.Generator().manual_seed(s) for s in (0, 1)])
    b = verify_chain(p2, ids2, q2, nd, [torch.Generator().manual_seed(s) for s in (0, 1)])
    assert torch.equal(a.token_ids, b.token_ids)
    for row in range(2):
        assert (b.token_ids[row, int(b.num_accepted[row]) + 1 :] == -1).all()


def test_output_layout():
    p, ids, q = _random_batch(B=64, k=4)
    out = verify_chain(p, ids, q)
    for b in range(64):
        n = int(out.num_accepted[b])
        assert out.token_ids[b, :n].tolist() == ids[b, :n].tolist()
        assert 0 <= out.token_ids[b, n] < 20
        assert (out.token_ids[b, n + 1 :] == -1).all()
    assert torch.equal(out.num_emitted, out.num_accepted + 1)


def test_low_precision_inputs():
    p, ids, q = _random_batch(B=8)
    for dtype in (torch.bfloat16, torch.float16):
        out = verify_chain(p.to(dtype), ids, q.to(dtype))
        assert out.token_ids.dtype == torch.int64 and (out.token_ids[:, 0] >= 0).all()


def test_mixed_dtypes_raise():
    """verify_chain promises (its docstring, in the docs' Python reference): dtype mismatches raise (a float32 q next to
    a float64 p is a caller's mistake)."""
    p, ids, q = _random_batch(B=2, k=3, V=8)
    with pytest.raises(ValueError, match=r"draft_probs is torch.float32 but target_probs is torch.float64"):
        verify_chain(p.double(), ids, q)
    with pytest.raises(ValueError, match="one dtype"):
        verify_chain(p, ids, q.bfloat16())
    assert verify_chain(p.double(), ids, q.double()).token_ids.shape == (2, 4)


# ---- bad input: each class gets a ValueError with a message that says what is wrong ----


def _bad(match, **over):
    p, ids, q = _random_batch(B=2, k=3, V=8)
    args = {"target_probs": p, "draft_token_ids": ids, "draft_probs": q, "num_draft_tokens": None, "generators": None}
    args.update(over)
    with pytest.raises(ValueError, match=match):
        verify_chain(**args)


def _with(t, index, value):
    t = t.clone()
    t[index] = value
    return t


def test_bad_input_nan_inf_negative_and_not_normalised():
    p, _, q = _random_batch(B=2, k=3, V=8)
    _bad("NaN or inf", target_probs=_with(p, (0, 1, 2), float("nan")))
    _bad("NaN or inf", draft_probs=_with(q, (1, 0, 0), float("inf")))
    neg = p.clone()
    neg[0, 0, 0] -= 0.5
    neg[0, 0, 1] += 0.5
    _bad("negative probability", target_probs=neg)
    _bad("sum to", target_probs=p * 1.1)
    _bad("sum to", draft_probs=q * 0.5)


def test_bad_input_shapes_dtypes_ids():
    p, ids, q = _random_batch(B=2, k=3, V=8)
    _bad("draft_token_ids must have shape", draft_token_ids=ids[:, :2])
    _bad("draft_probs must have shape", draft_probs=q[:, :, :7])
    _bad("target_probs must be a tensor of shape", target_probs=p[0])
    _bad("target_probs must be floating point", target_probs=p.long())
    _bad("draft_token_ids must be int64", draft_token_ids=ids.float())
    _bad("draft_probs must be floating point", draft_probs=q.long())
    _bad(r"outside \[0, 8\)", draft_token_ids=_with(ids, (1, 2), 8))
    _bad(r"outside \[0, 8\)", draft_token_ids=_with(ids, (0, 0), -1))
    _bad(r"num_draft_tokens must lie in \[0, k\]", num_draft_tokens=torch.tensor([4, 0]))
    _bad("num_draft_tokens must be an integer tensor", num_draft_tokens=torch.tensor([1.0, 2.0]))
    _bad("one entry per row", generators=[None])
    _bad("is on meta", draft_token_ids=ids.to("meta"))


def test_bad_input_draft_token_with_zero_q():
    _, ids, q = _random_batch(B=2, k=3, V=8)
    q0 = q.clone()
    q0[1, 1, ids[1, 1]] = 0
    q0[1, 1] /= q0[1, 1].sum()
    _bad("has q = 0", draft_probs=q0)


def test_checks_can_be_skipped_on_the_hot_path():
    p, ids, q = _random_batch(B=4, k=3, V=8)
    nd = torch.tensor([3, 0, 2, 1])
    # the checks read the inputs only: with or without them, the same uniforms give the same output
    checked = verify_chain(p, ids, q, nd, [torch.Generator().manual_seed(s) for s in range(4)])
    fast = verify_chain(p, ids, q, nd, [torch.Generator().manual_seed(s) for s in range(4)], check=False)
    assert torch.equal(checked.token_ids, fast.token_ids) and torch.equal(checked.num_accepted, fast.num_accepted)
    # input the checks reject is tolerated without them: the caller vouches for it, and the output keeps its layout
    with pytest.raises(ValueError, match="sum to"):
        verify_chain(p * 1.001, ids, q, nd)
    out = verify_chain(p * 1.001, ids, q, nd, check=False)
    for b in range(4):
        n = int(out.num_accepted[b])
        assert n <= int(nd[b]) and out.token_ids[b, :n].tolist() == ids[b, :n].tolist()
        assert 0 <= int(out.token_ids[b, n]) < 8 and (out.token_ids[b, n + 1 :] == -1).all()
