"""Structured outputs keep speculative decoding exact: the engine's constrained outputs follow the target's exact law
under the grammar, for every drafter, verification rule and randomness.

The law: G1 = `root ::= ("a" | "b" | "c") ("a" | "b")? "d"` on the tiny word-level tokenizer allows 9 outputs (then
EOS, id 2). Each one's probability is computed in the test from first principles (`helpers.grammar_law.exact_law`:
full forwards of the tiny target over prompt + prefix, the mask of a fresh xgrammar matcher applied to the logits
first, softmax at temperature 1), independently of verispec's runner, processors and `verispec.structured`.

The test: N = 3000 seeded samples (temperature 1, one `generate` call, max_new_tokens 4 so every output ends with
EOS) per configuration, a chi-square goodness of fit over the 9 outputs plus a probability-0 bin for anything else
(any output the grammar refuses, or a "length" output, rejects outright), at significance level LEVEL = 1e-3 per
test, seeds fixed (so the outcome of each test is deterministic; a false alarm would be a 1e-3 event).
Power: at N = 3000 the test rejects every alternative law at total variation >= 0.07 from the exact one with
probability >= 0.99 (`detectable_tv`, worst case over directions; asserted below). The slow tier holds the
grammar's one full-power law test, the masked chain at N = 20 000 (TV >= 0.025), and three configurations at
N = 3000 (~6 s each on 2 cores), their mechanisms being checked under the grammar in the default tier by a
neighbour: tree-without-replacement (the mask on a tree's nodes: tree-iid), block (verification of a masked
chain: chain) and position (a seeded row under the grammar: auto-seeded; position seeding under a grammar, the same
tokens for gamma 1, 2 and 4: tests/structured/test_review_fixes.py; its law: tests/engine/test_positional.py).

The draft models: a 1-layer model of another seed (8), whose masked q is 0.1-0.35 in TV from the masked p at the
first slots (rejections and residuals are exercised), with stop_below=none (the default, 0.3, measures the draft's
confidence before the mask and would stop every chain after one token here).

Broken samplers fail the same test: (a) the target's p and the draft's q masked with the root's mask at every slot
(a stale mask); (b') a drafter that samples from an unmasked q_u, hands verification the masked q_m and has its
refused tokens verified (the engine's cut before refused tokens disabled). Look-alikes pass, and must: (b) the same
drafter with the cut in place, (c) a drafter that hands the unmasked q_u it drew from, without the cut - and, with the
cut, (c) fails today: a bug in fit_draft (test_unmasked_q_handed_consistently_is_exact's docstring).
"""

from __future__ import annotations

import pytest
import torch

from verispec.certify.stats import detectable_tv
from verispec.drafting import Proposer
from verispec.drafting.base import Draft
from verispec.drafting.batch import BatchView
from verispec.engine import step as step_module
from verispec.engine.config import SpecConfig
from verispec.engine.generator import SpeculativeGenerator
from verispec.sampling import Constraint, SamplingParams

from ..helpers.grammar_law import compile_ebnf, exact_law, outcomes_of, truncated
from ..helpers.tiny import EOS, V, loaded

pytestmark = pytest.mark.statistical

LEVEL = 1e-3
N = 3000
N_SLOW = 20_000
L = 4  # G1's outputs have at most 3 tokens, then EOS
PROMPT = [1, 3, 4, 6, 3, 4]  # <s> a b d a b: prompt lookup finds proposals in it
G1 = 'root ::= ("a" | "b" | "c") ("a" | "b")? "d"'
# G2: the root's mask {a, b, c} is inside every later one ({a, b, c, d, EOS}), so a stale root mask never lets a
# refused token through: the broken engine runs to the end and its law is wrong (with G1 it is stopped outright)
G2 = 'root ::= ("a" | "b" | "c") ("a" | "b" | "c" | "d")*'
L2 = 3
NO_STOP = "stop_below=none"

CONFIGS = {
    "plain": "draft=none,random=stream",
    "chain": f"draft=model,gamma=3,{NO_STOP},random=stream",
    "block": f"draft=model,gamma=3,{NO_STOP},verify=block,random=stream",
    "tree-iid": "draft=model,tree=2-2-1,verify=iid,random=stream",
    "tree-without-replacement": "draft=model,tree=2-2-1,verify=without_replacement,random=stream",
    "ngram-jump": "draft=ngram,gamma=3,random=stream",
    "position": f"draft=model,gamma=3,{NO_STOP},random=position",
    "auto-seeded": f"draft=model,gamma=3,{NO_STOP}",  # random=auto: every request has a seed, so Gumbel-coupled
}


@pytest.fixture(scope="module")
def far_draft():
    """A 1-layer draft of another seed: its masked q differs from the masked p (TV 0.1-0.35 at the first slots)."""
    return loaded(8, layers=1)


@pytest.fixture(scope="module")
def law_g1(tiny_target):
    return exact_law(tiny_target.model, PROMPT, L, EOS, compile_ebnf(tiny_target.tokenizer, V, EOS, G1), V)


@pytest.fixture(scope="module")
def law_g2(tiny_target):
    return exact_law(tiny_target.model, PROMPT, L2, EOS, compile_ebnf(tiny_target.tokenizer, V, EOS, G2), V)


def sample(gen, grammar: str, n: int, max_new: int = L, seed0: int = 1000):
    c = Constraint.grammar(grammar)
    params = [SamplingParams(temperature=1.0, seed=seed0 + i, constraint=c) for i in range(n)]
    return outcomes_of(gen.generate([PROMPT] * n, params, max_new_tokens=max_new))


def generator(target, draft, spec: str):
    cfg = SpecConfig.parse(spec)
    return SpeculativeGenerator(target, draft if cfg.draft == "model" else None, config=cfg)


class JumpCounter:
    """Wraps fit_draft: counts the tokens it appends (jump-forward) and the drafted tokens it cuts."""

    def __init__(self, fit):
        self.fit = fit
        self.jumped = self.cut = 0

    def __call__(self, draft, grammars, room, jump):
        out = self.fit(draft, grammars, room, jump)
        for b in range(len(grammars)):
            old = draft.token_ids[b, : draft.num_nodes[b]].tolist()
            new = out.token_ids[b, : out.num_nodes[b]].tolist()
            same = 0
            while same < min(len(old), len(new)) and old[same] == new[same]:
                same += 1
            self.jumped += len(new) - same
            self.cut += len(old) - same
        return out


@pytest.fixture
def jump_counter(monkeypatch):
    counter = JumpCounter(step_module.fit_draft)
    monkeypatch.setattr(step_module, "fit_draft", counter)
    return counter


def test_power(law_g1, law_g2):
    """The sample sizes detect any law at these total variations from the exact one with power 0.99 at LEVEL."""
    assert len(law_g1.outcomes) == 9 and all(r == "stop" for _, r in law_g1.outcomes)
    assert min(law_g1.probs) > 0.04  # every output has a fair share of samples (the smallest: ~0.048)
    assert detectable_tv(law_g1.probs, N, LEVEL, 0.99) < 0.07
    assert detectable_tv(law_g1.probs, N_SLOW, LEVEL, 0.99) < 0.025
    assert detectable_tv(law_g2.probs, N, LEVEL, 0.99) < 0.09


def check_law(gen, law, n, spec):
    samples = sample(gen, G1, n)
    assert all(reason == "stop" for _, reason in samples)  # every output complete, ended by EOS
    result = law.gof(samples)
    assert not result.rejects(LEVEL), (spec, result)
    stats = gen.last_stats
    if "draft=none" not in spec:
        assert stats.drafted > 0 and stats.accepted > 0, spec  # speculation happened ...
        if "auto" not in spec:  # (coupled: a draft is accepted when it is the coupled token, and often is)
            assert stats.accepted < stats.drafted, spec  # ... with rejections


SLOW_ONLY = ("tree-without-replacement", "block", "position")  # at N in the slow tier: the docstring above


@pytest.mark.parametrize(
    "name, n",
    [pytest.param(name, N, id=name, marks=[pytest.mark.slow] if name in SLOW_ONLY else []) for name in CONFIGS]
    + [pytest.param("chain", N_SLOW, id="chain-large", marks=pytest.mark.slow)],  # the full-power one
)
def test_constrained_law(name, n, tiny_target, far_draft, law_g1, jump_counter):
    spec = CONFIGS[name]
    gen = generator(tiny_target, far_draft, spec)
    check_law(gen, law_g1, n, spec)
    if name == "ngram-jump":  # prompt lookup's proposals were cut at refused tokens, and forced tokens appended
        assert jump_counter.cut > 0 and jump_counter.jumped > 0, vars(jump_counter)


def test_mixed_batch(tiny_target, far_draft, law_g1):
    """Constrained and unconstrained rows in one batch (interleaved, one generate call): the constrained rows follow
    G1's law, the unconstrained ones the plain law (their first 2 tokens, against the plain law of budget 2, ~1000
    outcomes, bins merged to expected counts >= 5: detectable TV at power 0.99 asserted below 0.25)."""
    n = 2000
    plain_prompt = [1, 7, 9, 12, 5]
    plain_law = exact_law(tiny_target.model, plain_prompt, 2, EOS, None, V)
    assert detectable_tv(plain_law.probs, n, LEVEL, 0.99) < 0.25
    assert detectable_tv(law_g1.probs, n, LEVEL, 0.99) < 0.08
    c = Constraint.grammar(G1)
    prompts, params = [], []
    for i in range(n):
        prompts += [PROMPT, plain_prompt]
        params += [
            SamplingParams(temperature=1.0, seed=5000 + i, constraint=c),
            SamplingParams(temperature=1.0, seed=9000 + i),
        ]
    gen = generator(tiny_target, far_draft, CONFIGS["chain"])
    outs = outcomes_of(gen.generate(prompts, params, max_new_tokens=L))
    constrained, plain = outs[0::2], outs[1::2]
    result = law_g1.gof(constrained)
    assert not result.rejects(LEVEL), result
    result = plain_law.gof([truncated(o, 2) for o in plain])
    assert not result.rejects(LEVEL), result
    assert any(len(t) >= 2 and t[0] not in (3, 4, 5) for t, _ in plain)  # the plain rows are not constrained
    assert gen.last_stats.accepted < gen.last_stats.drafted


# --- broken samplers -------------------------------------------------------------------------------------------------
@pytest.fixture
def stale_root_mask(monkeypatch):
    """Broken on purpose: every slot of a draft gets the root's mask (the grammar state before the step's drafts),
    for the draft's q and the target's p alike."""
    original = BatchView.node_context

    def stale(self, token_ids, parents):
        ctx = original(self, token_ids, parents)
        if ctx.allowed is None:
            return ctx
        return ctx._replace(allowed=ctx.allowed[:, :1].expand_as(ctx.allowed).clone())

    monkeypatch.setattr(BatchView, "node_context", stale)


def test_stale_root_mask_fails(tiny_target, far_draft, law_g2, stale_root_mask):
    """With G2 the stale mask only forbids d and EOS after the first draft: the engine runs and the chi-square test
    rejects its law (the exact engine passes the same test: test_stale_mask_grammar_passes_when_correct)."""
    gen = generator(tiny_target, far_draft, CONFIGS["chain"])
    result = law_g2.gof(sample(gen, G2, N, max_new=L2))
    assert result.rejects(LEVEL), result


def test_stale_mask_grammar_passes_when_correct(tiny_target, far_draft, law_g2):
    gen = generator(tiny_target, far_draft, CONFIGS["chain"])
    result = law_g2.gof(sample(gen, G2, N, max_new=L2))
    assert not result.rejects(LEVEL), result


@pytest.mark.slow  # the stale mask's power on G2 (test_stale_root_mask_fails) is the default tier's
def test_stale_root_mask_fails_on_g1(tiny_target, far_draft, law_g1, stale_root_mask):
    """With G1 the stale mask lets the target emit tokens the grammar refuses (c after a letter, a letter after d):
    the engine must not pass the test - it either stops (the row's matcher refuses the token) or its law is wrong."""
    gen = generator(tiny_target, far_draft, CONFIGS["chain"])
    try:
        samples = sample(gen, G1, N)
    except RuntimeError as e:
        assert "refused" in str(e)
        return
    result = law_g1.gof(samples)
    assert result.rejects(LEVEL), result


Q_U = torch.full((V,), 0.2 / V)
Q_U[[3, 4, 5, 6, EOS]] += 0.8 / 5  # a b c d EOS: the grammar's tokens get 80% of q_u, so most drafts survive the cut


class UnmaskedDraft(Proposer):
    """A drafter without a model: gamma tokens per row drawn from the fixed q_u (not the grammar's mask) with the row's
    generator. hand_masked: verification gets the masked q_m = q_u * mask / Z at every slot instead of q_u. At G1's
    root Z = q_u({a, b, c}) ~ 0.5 and q_m is uniform on {a, b, c}, 0.23 in TV from p there."""

    name = "unmasked-draft"

    def __init__(self, hand_masked: bool):
        self.hand_masked = hand_masked

    def propose(self, view, caps):
        B, k = len(view.seqs), max(caps, default=0)
        ids = torch.full((B, k), -1, dtype=torch.int64)
        for b, g in enumerate(caps):
            if g:
                ids[b, :g] = torch.multinomial(Q_U, g, replacement=True, generator=view.generators[b])
        q = Q_U.expand(B, k + 1, V).clone()
        if self.hand_masked and view.grammars is not None:
            q = q * view.node_context(ids, Draft.chain_of(ids, None, caps).parents).allowed
            q = q / q.sum(-1, keepdim=True)
        return Draft.chain_of(ids, q, caps)


@pytest.fixture
def no_cut(monkeypatch):
    """Disables fit_draft (no cut before refused tokens, no jump-forward)."""
    monkeypatch.setattr(step_module, "fit_draft", lambda draft, grammars, room, jump: draft)


def unmasked_law(tiny_target, hand_masked: bool):
    gen = SpeculativeGenerator(
        tiny_target, UnmaskedDraft(hand_masked), config=SpecConfig(draft="custom", gamma=3, random="stream")
    )
    samples = sample(gen, G1, N)
    assert gen.last_stats.drafted > N and gen.last_stats.accepted > 0
    return samples


def test_unmasked_draw_masked_q_with_refused_tokens_verified_fails(tiny_target, law_g1):
    """(b) Broken: drafts drawn from q_u, verification handed the masked q_m (the engine never cuts a sampled chain, so
    the refused drafts are verified). A refused draft (p = 0) is always rejected and the residual max(p - q_m, 0) is drawn as if the draft had
    come from q_m: the law is wrong (measured: p-value ~ 1e-294)."""
    result = law_g1.gof(unmasked_law(tiny_target, hand_masked=True))
    assert result.rejects(LEVEL), result


@pytest.mark.slow  # (c) as the engine runs it (test_unmasked_q_handed_consistently_is_exact) is the default tier's
def test_unmasked_q_handed_consistently_without_the_cut_is_exact(tiny_target, law_g1, no_cut):
    """(c) Drafts drawn from q_u and verification handed that same q_u, every draft verified: exact, and passes
    (measured p-value ~ 0.04). Verification needs only that q is the law the drafts were drawn from; the masked p gives
    a refused draft p = 0, so it is rejected and the residual max(p - q_u, 0) is the right one."""
    result = law_g1.gof(unmasked_law(tiny_target, hand_masked=False))
    assert not result.rejects(LEVEL), result


def test_unmasked_q_handed_consistently_is_exact(tiny_target, law_g1):
    """(c) as the engine runs it: fit_draft never cuts a sampled chain (drafting.grammar), so a Proposer that draws
    from its own unmasked q and hands that q (the contract of drafting.base) stays exact. Cutting it before its first
    refused token made it fail (p ~ 1e-55) before fit_draft was fixed."""
    result = law_g1.gof(unmasked_law(tiny_target, hand_masked=False))
    assert not result.rejects(LEVEL), result
