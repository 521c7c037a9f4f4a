"""The draft-model proposer on its own (no engine): q is the processed distribution it sampled from, the draws
follow the engine's randomness, stop_below ends unsure chains, the draft cache keeps exactly the accepted drafts
and catches up on a backlog. Tiny models, exact assertions."""

from __future__ import annotations

from functools import partial

import torch

from verispec.drafting import DraftModelProposer
from verispec.drafting.batch import BatchView
from verispec.model.fast import make_runner
from verispec.sampling import SamplingParams, probs_from_logits
from verispec.sampling.randomness import RANDOMNESS

from ..helpers.tiny import loaded

GREEDY = SamplingParams(temperature=0.0)
PROMPT = [3, 7, 7, 12, 3]


def _view(seqs, params, seeds=(0, 1), randomness="stream") -> BatchView:
    return BatchView(
        seqs=seqs,
        params=list(params),
        generators=[torch.Generator().manual_seed(s) for s in seeds[: len(seqs)]],
        vocab_size=32,
        seeds=list(seeds[: len(seqs)]),
        positions=[0] * len(seqs),
        randomness=RANDOMNESS[randomness],
    )


@torch.no_grad()
def _fresh_probs(model, seq, params) -> torch.Tensor:
    return probs_from_logits(model(torch.tensor([seq])).logits[:, -1].float(), [params])[0]


def test_q_is_the_processed_distribution_each_draft_was_drawn_from(tiny_draft):
    params = SamplingParams(temperature=0.7, top_k=5)
    prop = DraftModelProposer(tiny_draft.model, 32, stop_below=None)
    seqs = [list(PROMPT)]
    view = _view(seqs, [params])
    prop.start(view, capacity=len(PROMPT) + 8)
    draft = prop.propose(view, [3])
    ids = draft.token_ids[0].tolist()
    assert draft.num_nodes == [3] and draft.chain and draft.rule == "iid"
    for j in range(3):  # slot j's q: the draft's p after the prompt and drafts 0..j-1, with the request's processing
        ref = _fresh_probs(tiny_draft.model, PROMPT + ids[:j], params)
        assert torch.allclose(draft.probs[0, j], ref, atol=1e-6)
        assert draft.probs[0, j, ids[j]] > 0  # drawn from it
        assert int((draft.probs[0, j] > 0).sum()) <= 5  # top-k applied to q as to p


def test_greedy_drafts_are_the_draft_models_argmax_chain(tiny_draft):
    prop = DraftModelProposer(tiny_draft.model, 32, stop_below=None)
    view = _view([list(PROMPT)], [GREEDY])
    prop.start(view, capacity=len(PROMPT) + 8)
    ids = prop.propose(view, [4]).token_ids[0].tolist()
    seq = list(PROMPT)
    for t in ids:
        assert t == int(_fresh_probs(tiny_draft.model, seq, GREEDY).argmax())
        seq.append(t)


def test_draws_follow_the_engines_randomness(tiny_draft):
    """stream: per-row generators (rows with another seed draw otherwise); position: keyed by (seed, position), so
    the same seed drafts the same tokens whatever the generator's state."""
    params = SamplingParams(temperature=1.0)

    def draft(randomness, gen_seeds):
        prop = DraftModelProposer(tiny_draft.model, 32, stop_below=None)
        view = _view([list(PROMPT), list(PROMPT)], [params] * 2, seeds=(5, 5), randomness=randomness)
        view.generators = [torch.Generator().manual_seed(s) for s in gen_seeds]
        prop.start(view, capacity=len(PROMPT) + 12)
        return prop.propose(view, [8, 8]).token_ids.tolist()

    stream = draft("stream", (0, 1))
    assert stream[0] != stream[1]  # two generators, two chains (8 draws from a near-uniform q)
    assert draft("stream", (0, 1)) == stream  # seeded: repeatable
    keyed = draft("position", (0, 1))
    assert keyed[0] == keyed[1]  # one seed, one chain, whatever the generators


def test_stop_below_ends_an_unsure_chain_and_lookahead_drafts_one_more(tiny_draft):
    params = SamplingParams(temperature=1.0)
    for randomness, extra in (("stream", 0), ("position", 1)):
        prop = DraftModelProposer(tiny_draft.model, 32, stop_below=1.0)  # every draft is "unsure": stop after it
        view = _view([list(PROMPT)], [params], randomness=randomness)
        prop.start(view, capacity=len(PROMPT) + 12)
        assert prop.propose(view, [6]).num_nodes == [1 + extra]


def test_update_keeps_the_accepted_drafts_and_rolls_back_the_rest(tiny_draft):
    prop = DraftModelProposer(tiny_draft.model, 32, stop_below=None)
    seqs = [list(PROMPT), list(PROMPT)]
    view = _view(seqs, [GREEDY, GREEDY])
    prop.start(view, capacity=len(PROMPT) + 16)
    draft = prop.propose(view, [4, 4])
    old = [len(s) for s in seqs]
    ids = draft.token_ids.tolist()
    seqs[0].extend(ids[0][:2] + [9])  # row 0: two drafts accepted, then a recovered token
    seqs[1].extend([9])  # row 1: the first draft rejected
    prop.update(view, old, draft, [[0, 1], []])
    assert prop.runner.lengths == [len(seqs[0]) - 1, len(seqs[1]) - 1]  # all but each row's pending token
    nxt = prop.propose(view, [1, 1]).token_ids[:, 0].tolist()
    assert nxt == [int(_fresh_probs(tiny_draft.model, s, GREEDY).argmax()) for s in seqs]


def test_draft_catches_up_a_backlog_after_plain_steps(tiny_draft):
    """A row that decoded plainly for several steps (gamma 0) feeds its backlog to the draft in one chunk,
    next to a row that drafted every step; the draft's q afterwards equals a fresh forward's."""
    prop = DraftModelProposer(tiny_draft.model, 32, stop_below=None)
    seqs = [list(PROMPT), list(PROMPT)]
    view = _view(seqs, [GREEDY, GREEDY])
    prop.start(view, capacity=len(PROMPT) + 40)
    for step in range(9):
        gammas = [2, 2 if step == 8 else 0]
        out = prop.propose(view, gammas)
        old = [len(s) for s in seqs]
        seqs[0].extend(out.token_ids[0, :2].tolist() + [7])  # row 0: both drafts accepted, bonus 7
        seqs[1].append(5 + step)  # row 1: one plainly decoded token
        prop.update(view, old, out, [[0, 1], []])  # row 0 kept both drafts, row 1 had none
        if step == 8:
            assert out.token_ids[1, 0].item() == int(_fresh_probs(tiny_draft.model, seqs[1][: old[1]], GREEDY).argmax())
    assert prop.runner.lengths[1] == len(seqs[1]) - 1  # backlog fed; the rejected draft rolled back


def test_a_quantized_self_draft_is_rebuilt_after_a_weight_update():
    model = loaded(0).model
    prop = DraftModelProposer(model, 32, stop_below=None, runner=partial(make_runner, quant="int8"))
    runner = prop.runner
    assert prop.weights_changed(loaded(9).model) == 0.0 and prop.runner is runner  # another model: untouched
    assert prop.weights_changed(model) > 0.0 and prop.runner is not runner
