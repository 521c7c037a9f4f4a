"""Block verification (verispec.sampling.block): exact losslessness by enumeration on prefix-dependent p and q,
the sampler against its exact step law, never fewer accepted tokens than token-wise, one-hot and greedy
reductions, and verify_chain's contracts (uniform consumption, batch invariance, validation)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from verispec.certify.stats import chisquare_gof
from verispec.sampling import verify_chain
from verispec.sampling.block import block_final_weights, block_stop_law, block_terms, verify_block

from ..helpers.toy_lm import ToyLM, stable_seed

LEVEL = 1e-3  # per statistical test below; each uses a fixed seed


def step_outcomes(lm: ToyLM, prefix: tuple, gamma: int, onehot: bool, rule):
    """Every outcome of one verification step from `prefix` with its exact probability: [(emitted tokens, prob)].
    rule(p, ids, q, nd) -> (stop law [B, gamma + 1], final weights [B, gamma + 1, V]) for the B draft blocks."""
    V = lm.V
    if onehot:  # one deterministic draft block (what a prompt-lookup drafter proposes), q = onehot
        g = torch.Generator().manual_seed(stable_seed("ids", *prefix))
        drafts = [tuple(torch.randint(V, (gamma,), generator=g).tolist())]
    else:  # every draft block, weighted by its probability under q
        drafts = list(itertools.product(range(V), repeat=gamma))
    p = torch.stack([torch.stack([lm.dist(prefix + d[:i], "p") for i in range(gamma + 1)]) for d in drafts])
    q = None
    if not onehot and gamma > 0:
        q = torch.stack([torch.stack([lm.dist(prefix + d[:i], "q") for i in range(gamma)]) for d in drafts])
    elif not onehot:
        q = torch.empty(1, 0, V, dtype=torch.float64)
    ids = torch.tensor(drafts, dtype=torch.int64).view(len(drafts), gamma)
    q_draft = (  # q(x^gamma | prefix)
        torch.ones(len(drafts), dtype=torch.float64)
        if q is None
        else q.gather(-1, ids.unsqueeze(-1)).squeeze(-1).prod(1)
    )
    nd = torch.full((len(drafts),), gamma)
    law, weights = rule(p, ids, q, nd)
    weights = weights / weights.sum(-1, keepdim=True)
    out = []
    for b, d in enumerate(drafts):
        for tau in range(gamma + 1):
            for y in range(V):
                w = float(q_draft[b] * law[b, tau] * weights[b, tau, y])
                if w > 0:
                    out.append((d[:tau] + (y,), w))
    return out


def block_rule(p, ids, q, nd, drop_rho: bool = False):
    law = block_stop_law(p, ids, q, nd)
    rho, _ = block_terms(p, ids, q, nd)
    if drop_rho:  # the vllm-ascend #7807 mistake: the token-wise residual (P - Q)+ after a block decision
        rho = torch.ones_like(rho)
    K1 = p.shape[1]
    weights = torch.stack(
        [block_final_weights(p, ids, q, nd, rho, torch.full_like(nd, tau)) for tau in range(K1)], 1
    )  # [B, k + 1, V]
    return law, weights


def first_rejection_rule(p, ids, q, nd):
    """The block thresholds read as a token-wise chain (stop at the first u >= h): looks right, is not."""
    _, weights = block_rule(p, ids, q, nd)
    _, h = block_terms(p, ids, q, nd)
    keep = h[:, 1:].cumprod(1)  # P(u_1 < h_1, ..., u_i < h_i)
    keep = torch.cat([torch.ones_like(keep[:, :1]), keep], 1)
    law = keep - torch.cat([keep[:, 1:], torch.zeros_like(keep[:, :1])], 1)
    return law, weights


def sequence_law(lm: ToyLM, length: int, gamma, onehot: bool, rule) -> dict[tuple, float]:
    """The exact law of the first `length` tokens when decoding by repeated steps from the empty prefix
    (gamma(prefix) drafts per step: a function of the state, like an adaptive gamma)."""
    law: dict[tuple, float] = {}
    frontier = {(): 1.0}
    while frontier:
        nxt: dict[tuple, float] = {}
        for prefix, w in frontier.items():
            for emitted, pr in step_outcomes(lm, prefix, gamma(prefix), onehot, rule):
                s = prefix + emitted
                bucket = law if len(s) >= length else nxt
                key = s[:length] if len(s) >= length else s
                bucket[key] = bucket.get(key, 0.0) + w * pr
        frontier = nxt
    return law


def target_law(lm: ToyLM, length: int) -> dict[tuple, float]:
    out = {}
    for s in itertools.product(range(lm.V), repeat=length):
        out[s] = float(np.prod([float(lm.dist(s[:i], "p")[s[i]]) for i in range(length)]))
    return out


def max_abs_error(law: dict, ref: dict) -> float:
    return max(abs(law.get(s, 0.0) - ref[s]) for s in ref) + sum(w for s, w in law.items() if s not in ref)


GAMMAS = {
    "gamma1": lambda s: 1,
    "gamma3": lambda s: 3,
    "ragged": lambda s: len(s) % 4,  # 0..3 drafts depending on the state
}


@pytest.mark.parametrize("gamma", GAMMAS)
@pytest.mark.parametrize("zeros", [False, True])
def test_block_verification_is_lossless_exactly(gamma, zeros):
    """Enumerate every draft, stopping point and final token: the law of the first 4 tokens equals p's to 1e-12."""
    lm = ToyLM(vocab=3, seed=7, zeros=zeros)
    ref = target_law(lm, 4)
    err = max_abs_error(sequence_law(lm, 4, GAMMAS[gamma], False, block_rule), ref)
    assert err < 1e-12, err


def test_block_verification_with_one_hot_drafts_is_lossless_exactly():
    lm = ToyLM(vocab=4, seed=3, zeros=True)
    ref = target_law(lm, 4)
    assert max_abs_error(sequence_law(lm, 4, GAMMAS["gamma3"], True, block_rule), ref) < 1e-12


@pytest.mark.parametrize(
    "wrong", [lambda *a: block_rule(*a, drop_rho=True), first_rejection_rule], ids=["drop_rho", "first_rejection"]
)
def test_the_exact_check_catches_wrong_block_rules(wrong):
    """The enumeration is not vacuous: the two look-alike mistakes move the sequence law by 7e-3 (drop_rho) and 0.25
    (first_rejection) on this model, against < 1e-15 for the exact rule: any error over 1e-9 is caught."""
    lm = ToyLM(vocab=3, seed=7)
    assert max_abs_error(sequence_law(lm, 4, GAMMAS["gamma3"], False, wrong), target_law(lm, 4)) > 1e-3


def test_never_fewer_accepted_tokens_than_token_wise_exactly():
    """E[accepted] over every draft block, block vs token-wise, on 20 random (p, q): block >= token always,
    strictly more on most (theorem 2 of the paper)."""
    gains = []
    for seed in range(20):
        lm = ToyLM(vocab=4, seed=100 + seed, scale=2.0)
        drafts = list(itertools.product(range(4), repeat=3))
        p = torch.stack([torch.stack([lm.dist(d[:i], "p") for i in range(4)]) for d in drafts])
        q = torch.stack([torch.stack([lm.dist(d[:i], "q") for i in range(3)]) for d in drafts])
        ids = torch.tensor(drafts)
        q_draft = q.gather(-1, ids.unsqueeze(-1)).squeeze(-1)  # [B, 3]
        weight = q_draft.prod(1)
        block = (block_stop_law(p, ids, q) * torch.arange(4)).sum(1)
        ratio = (p[:, :3].gather(-1, ids.unsqueeze(-1)).squeeze(-1) / q_draft).clamp(max=1)
        token = ratio.cumprod(1).sum(1)
        gains.append(float((weight * (block - token)).sum()))
    assert min(gains) > -1e-12, gains
    assert sum(g > 1e-4 for g in gains) >= 15, gains


def _block_case(seed=0, B=1, k=3, V=6, onehot=False):
    g = torch.Generator().manual_seed(seed)
    p = (2 * torch.randn(B, k + 1, V, generator=g, dtype=torch.float64)).softmax(-1)
    q = (2 * torch.randn(B, k, V, generator=g, dtype=torch.float64)).softmax(-1)
    ids = torch.stack([torch.multinomial(q[0, j], 1, generator=g) for j in range(k)], 1).expand(B, k).contiguous()
    return p, ids, (None if onehot else q)


@pytest.mark.statistical
@pytest.mark.parametrize("onehot", [False, True])
def test_sampler_follows_its_exact_step_law(onehot):
    """40 000 draws of verify_block for one fixed draft block: the joint law of (kept length, next token) passes a
    chi-square test against block_stop_law x the normalised final weights (level 1e-3); token-wise verification,
    whose step law differs, fails the same test (the test has power against a different rule)."""
    N = 40_000
    p, ids, q = _block_case(seed=16, onehot=onehot)  # kept length 0..3 all likely; TV 0.064 to token-wise
    law, weights = block_rule(p, ids, q, torch.tensor([3]))
    cells = (law[0].unsqueeze(1) * weights[0] / weights[0].sum(-1, keepdim=True)).flatten().numpy()  # [(k+1) V]
    V = p.shape[-1]

    def counts(verifier):
        torch.manual_seed(5)
        out = verifier(p.expand(N, -1, -1), ids.expand(N, -1), None if q is None else q.expand(N, -1, -1))
        final = out.token_ids.gather(1, out.num_accepted.unsqueeze(1)).squeeze(1)
        return np.bincount((out.num_accepted * V + final).numpy(), minlength=cells.size)

    assert chisquare_gof(counts(verify_block), cells).pvalue > LEVEL
    if not onehot:  # with one-hot drafts token-wise has the same step law (next test)
        assert chisquare_gof(counts(verify_chain), cells).pvalue < LEVEL


def test_one_hot_drafts_reduce_to_token_wise_law():
    """q = onehot(X): P(tau = i) = prod_{j <= i} P_{j-1}(X_j) (1 - P_i(X_{i+1})) and the residual is P_tau without
    the draft token — token-wise verification's law, exactly."""
    p, ids, _ = _block_case(seed=2, B=4, k=4, V=8, onehot=True)
    nd = torch.tensor([4, 3, 1, 0])
    law = block_stop_law(p, ids, None, nd)
    p_t = p[:, :4].gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    for b in range(4):
        n = int(nd[b])
        keep = torch.cat([torch.ones(1, dtype=torch.float64), p_t[b, :n].cumprod(0)])  # P(tau >= i), i = 0..n
        expected = torch.cat([keep[:-1] * (1 - p_t[b, :n]), keep[-1:]])
        torch.testing.assert_close(law[b, : n + 1], expected, rtol=0, atol=1e-12)
        assert float(law[b, n + 1 :].abs().sum()) == 0.0
    rho, _ = block_terms(p, ids, None, nd)
    for tau in range(4):
        taus = torch.full((4,), tau).clamp(max=nd)
        w = block_final_weights(p, ids, None, nd, rho, taus)
        for b in range(4):
            t = int(taus[b])
            expected = p[b, t].clone()
            if t < int(nd[b]):
                expected[ids[b, t]] = 0
            torch.testing.assert_close(w[b] / w[b].sum(), expected / expected.sum(), rtol=0, atol=1e-12)


def test_greedy_target_is_exact_match_for_any_uniforms():
    """A one-hot p: keep drafts up to the first mismatch and emit the argmax, whatever the uniforms."""
    g = torch.Generator().manual_seed(3)
    B, k, V = 256, 5, 7
    p = torch.nn.functional.one_hot(torch.randint(V, (B, k + 1), generator=g), V).double()
    q = (torch.randn(B, k, V, generator=g, dtype=torch.float64)).softmax(-1)
    ids = torch.where(torch.rand(B, k, generator=g) < 0.7, p[:, :k].argmax(-1), torch.randint(V, (B, k), generator=g))
    q.scatter_(2, ids.unsqueeze(-1), q.gather(2, ids.unsqueeze(-1)) + 0.1)
    q = q / q.sum(-1, keepdim=True)
    for draft_probs in (q, None):
        out = verify_block(p, ids, draft_probs)
        match = (ids == p[:, :k].argmax(-1)).long().cumprod(1).sum(1)
        assert torch.equal(out.num_accepted, match)
        final = out.token_ids.gather(1, match.unsqueeze(1)).squeeze(1)
        assert torch.equal(final, p.argmax(-1).gather(1, match.unsqueeze(1)).squeeze(1))


def test_zero_target_probability_prefix_never_kept_even_with_u_zero():
    from verispec.sampling.block import verify_block_with_uniforms

    p = torch.tensor([[[0.0, 0.5, 0.5], [0.2, 0.3, 0.5], [0.3, 0.3, 0.4]]], dtype=torch.float64)
    q = torch.tensor([[[0.5, 0.25, 0.25], [0.2, 0.3, 0.5]]], dtype=torch.float64)
    ids = torch.tensor([[0, 2]])  # X_1 = 0 has p = 0: rho_1 = rho_2 = 0
    for u in (0.0, 0.5):
        out = verify_block_with_uniforms(
            p, ids, q, torch.tensor([2]), torch.full((1, 2), u, dtype=torch.float64), torch.tensor([u]).double()
        )
        assert int(out.num_accepted) == 0 and int(out.token_ids[0, 0]) != 0


def test_equal_p_and_q_keep_everything_without_nan():
    p, ids, q = _block_case(seed=4, B=64, k=4, V=5)
    q = p[:, :4].clone()
    out = verify_block(p, ids, q)
    assert torch.equal(out.num_accepted, torch.full((64,), 4))
    assert bool((out.token_ids >= 0).all())


def test_uniform_consumption_matches_verify_chain_and_rows_are_batch_invariant():
    """Row b draws num_draft[b] + 1 uniforms from its own generator (as verify_chain), so a seeded row's output
    and its generator's state do not depend on the other rows."""
    p, ids, q = _block_case(seed=5, B=6, k=4, V=9)
    nd = torch.tensor([4, 0, 2, 3, 1, 4])
    gens = [torch.Generator().manual_seed(10 + b) for b in range(6)]
    out = verify_block(p, ids, q, nd, gens)
    ref = [torch.Generator().manual_seed(10 + b) for b in range(6)]
    verify_chain(p, ids, q, nd, ref)
    assert all(torch.equal(a.get_state(), b.get_state()) for a, b in zip(gens, ref))
    for b in range(6):
        alone = verify_block(
            p[b : b + 1], ids[b : b + 1], q[b : b + 1], nd[b : b + 1], [torch.Generator().manual_seed(10 + b)]
        )
        assert torch.equal(alone.token_ids[0], out.token_ids[b])


def test_ragged_rows_ignore_padding_garbage():
    p, ids, q = _block_case(seed=6, B=3, k=4, V=7)
    nd = torch.tensor([1, 2, 0])
    p2, q2, ids2 = p.clone(), q.clone(), ids.clone()
    for b, n in enumerate(nd.tolist()):
        q2[b, n:] = float("nan")
        p2[b, n + 1 :] = float("nan")
        ids2[b, n:] = -1
    a = verify_block(p, ids, q, nd, [torch.Generator().manual_seed(b) for b in range(3)])
    b = verify_block(p2, ids2, q2, nd, [torch.Generator().manual_seed(b) for b in range(3)])
    assert torch.equal(a.token_ids, b.token_ids)
    assert bool((b.num_accepted <= nd).all())


def test_bad_input_is_rejected_like_verify_chain():
    p, ids, q = _block_case(seed=7, B=2, k=3, V=5)
    bad = p.clone()
    bad[0, 1, 0] = float("nan")
    with pytest.raises(ValueError, match="not a probability distribution"):
        verify_block(bad, ids, q)
    with pytest.raises(ValueError, match="shape"):
        verify_block(p, ids[:, :2], q)
    with pytest.raises(ValueError, match="q = 0"):
        q0 = q.clone()
        q0[0, 0, ids[0, 0]] = 0
        verify_block(p, ids, q0 / q0.sum(-1, keepdim=True))
    with pytest.raises(ValueError, match="num_draft_tokens"):
        verify_block(p, ids, q, torch.tensor([4, 0]))


def test_mixed_greedy_and_sampled_rows_in_one_batch():
    """A batch whose rows alternate a greedy (one-hot) target and a sampled one, with ragged draft counts: greedy
    rows verify by exact match, and every row's output is what it gets alone with its generator."""
    p, ids, q = _block_case(seed=8, B=8, k=4, V=9)
    greedy = torch.arange(8) % 2 == 0
    onehot = torch.nn.functional.one_hot(p.argmax(-1), 9).double()
    p = torch.where(greedy.view(8, 1, 1), onehot, p)
    ids[0, :2] = p[0, :2].argmax(-1)  # a greedy row whose first two drafts match
    nd = torch.tensor([4, 3, 2, 4, 0, 1, 4, 2])
    out = verify_block(p, ids, q, nd, [torch.Generator().manual_seed(b) for b in range(8)])
    for b in range(8):
        alone = verify_block(
            p[b : b + 1], ids[b : b + 1], q[b : b + 1], nd[b : b + 1], [torch.Generator().manual_seed(b)]
        )
        assert torch.equal(alone.token_ids[0], out.token_ids[b])
        if greedy[b]:
            n = int(nd[b])
            match = int((ids[b, :n] == p[b, :n].argmax(-1)).long().cumprod(0).sum())
            assert int(out.num_accepted[b]) == match
            assert int(out.token_ids[b, match]) == int(p[b, match].argmax())
