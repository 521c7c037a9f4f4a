"""A draft context window (`draft_context`, W): the draft's cache holds only W tokens before a row's pending token when
it joins (its first min(DRAFT_HEAD, W // 4), none for W = 3, and its last), its offset maps the row's sequence to the
cache, and q is what the draft sampled from after the window (and the drafts before) — for chains, trees, rows that
join (`add`) and leave (`select`) a running batch, and after `update`. Tiny models, exact assertions; the engine's
greedy output with a window is plain greedy, and its sampled output follows the target's exact law (chi-square at
LEVEL = 1e-4 over N = 12 000 seeded samples, tests/helpers/sequences.py's harness; slow tier)."""

from __future__ import annotations

import pytest
import torch

from verispec.drafting import DraftModelProposer
from verispec.drafting.batch import BatchView
from verispec.drafting.draft_model import DRAFT_HEAD, draft_window
from verispec.drafting.tree import TreeSpec
from verispec.engine import SpeculativeGenerator
from verispec.engine.config import SpecConfig, SpecError
from verispec.engine.drafters import build_proposer
from verispec.sampling import SamplingParams, probs_from_logits
from verispec.sampling.randomness import RANDOMNESS

from ..crossvocab.fixed_pair import pair
from ..helpers.cross_tok import SAMPLES
from ..helpers.sequences import LEVEL, PROMPT, SETTINGS, exact_sequence_probs, gof, sample_sequences

W = 3
T1 = SamplingParams(temperature=0.8, top_k=6)
GREEDY = SamplingParams(temperature=0.0)
LONG = [3, 7, 7, 12, 3, 9, 4, 11, 5]  # 9 tokens: the draft reads the last W = 3 before the pending 5 (offset 5)
SHORT = [6, 8, 2]  # shorter than the window (offset 0)
MID = [10, 4, 4, 13, 6, 1]  # offset 2


def _view(seqs, params=T1, seed0=0) -> BatchView:
    return BatchView(
        seqs=seqs,
        params=[params] * len(seqs),
        generators=[torch.Generator().manual_seed(seed0 + b) for b in range(len(seqs))],
        vocab_size=32,
        seeds=[seed0 + b for b in range(len(seqs))],
        positions=[0] * len(seqs),
        randomness=RANDOMNESS["stream"],
    )


@torch.no_grad()
def _q(model, tokens, params=T1) -> torch.Tensor:
    """The draft's processed distribution after `tokens` (a fresh forward from position 0: what a window reads)."""
    return probs_from_logits(model(torch.tensor([tokens])).logits[:, -1].float(), [params])[0]


def _window(seq):
    return seq[max(0, len(seq) - 1 - W) :]


def _check_chain(model, draft, seqs) -> None:
    """Every row's q at every slot is the draft's distribution after the row's window and its drafts before."""
    for b, seq in enumerate(seqs):
        ids = draft.token_ids[b, : draft.num_nodes[b]].tolist()
        for j in range(len(ids)):
            assert torch.allclose(draft.probs[b, j], _q(model, _window(seq) + ids[:j]), atol=1e-6), (b, j)


def test_draft_window_keeps_the_last_w_tokens_before_the_pending_one():
    cached, offsets = draft_window([LONG, SHORT, MID, [4]], W)
    assert cached == [LONG[5:8], SHORT[:2], MID[2:5], []] and offsets == [5, 0, 2, 0]
    assert draft_window([LONG], None) == ([LONG[:-1]], [0])
    seq = list(range(1000))
    assert DRAFT_HEAD == 64  # (the head of a window of 8 is 2, of 256 is 64, of 1024 still 64)
    assert draft_window([LONG], 8) == ([LONG[:8]], [0])  # the prompt fits
    assert draft_window([seq], 256) == ([seq[:64] + seq[64 + 743 : 999]], [743])
    assert draft_window([seq], 1024) == ([seq[:999]], [0])


def test_a_window_keeps_the_prompts_first_tokens_and_its_last(tiny_draft):
    """W = 8: the head is its first 2 tokens; q reads them, then the last 6 and the pending token."""
    seq = [3, 7, 7, 12, 3, 9, 4, 11, 5, 6, 8, 13, 10, 4]  # 13 cached: 5 skipped after the head
    prop = DraftModelProposer(tiny_draft.model, 32, stop_below=None, draft_context=8)
    view = _view([list(seq)])
    prop.start(view, capacity=len(seq) + 8)
    assert prop.runner.lengths == [8]
    draft = prop.propose(view, [3])
    ids = draft.token_ids[0].tolist()
    for j in range(3):
        assert torch.allclose(draft.probs[0, j], _q(tiny_draft.model, seq[:2] + seq[7:] + ids[:j]), atol=1e-6), j


def test_the_cache_holds_only_the_window_and_q_reads_it(tiny_draft):
    prop = DraftModelProposer(tiny_draft.model, 32, stop_below=None, draft_context=W)
    seqs = [list(LONG), list(SHORT)]
    view = _view(seqs)
    prop.start(view, capacity=len(LONG) + 8)
    assert prop.runner.lengths == [W, len(SHORT) - 1]
    draft = prop.propose(view, [3, 3])
    assert draft.num_nodes == [3, 3]
    _check_chain(tiny_draft.model, draft, seqs)


def test_update_keeps_the_accepted_drafts_after_the_window(tiny_draft):
    prop = DraftModelProposer(tiny_draft.model, 32, stop_below=None, draft_context=W)
    seqs = [list(LONG), list(MID)]
    view = _view(seqs, GREEDY)
    prop.start(view, capacity=len(LONG) + 16)
    draft = prop.propose(view, [4, 4])
    old = [len(s) for s in seqs]
    seqs[0].extend(draft.token_ids[0, :2].tolist() + [9])  # row 0: two drafts accepted, then a recovered token
    seqs[1].append(9)  # row 1: the first draft rejected
    prop.update(view, old, draft, [[0, 1], []])
    assert prop.runner.lengths == [len(s) - 1 - o for s, o in zip(seqs, (5, 2))]  # all but the pending token
    nxt = prop.propose(view, [1, 1]).token_ids[:, 0].tolist()
    assert nxt == [int(_q(tiny_draft.model, s[o:], GREEDY).argmax()) for s, o in zip(seqs, (5, 2))]  # joined windows


def test_rows_that_join_and_leave_keep_their_offsets(tiny_draft):
    """start [LONG], add [SHORT, MID] (the session's view of the new rows only), select [2, 0] (SHORT left, the
    others reordered): each row's cache and q follow its own window."""
    model = tiny_draft.model
    prop = DraftModelProposer(model, 32, stop_below=None, draft_context=W)
    prop.start(_view([list(LONG)]), capacity=len(LONG) + 8)
    prop.add(_view([list(SHORT), list(MID)]), capacity=len(MID) + 8)
    assert prop.runner.lengths == [W, len(SHORT) - 1, W]
    seqs = [list(LONG), list(SHORT), list(MID)]
    view = _view(seqs)
    draft = prop.propose(view, [2, 2, 2])
    _check_chain(model, draft, seqs)
    old = [len(s) for s in seqs]
    for b, s in enumerate(seqs):  # every row: its first draft accepted, then token 9
        s.extend([draft.token_ids[b, 0].item(), 9])
    prop.update(view, old, draft, [[0]] * 3)
    prop.select([2, 0])
    kept = [seqs[2], seqs[0]]
    view = _view(kept, seed0=7)
    assert prop.runner.lengths == [W + 2, W + 2]  # the window, the old pending token, the accepted draft
    draft = prop.propose(view, [3, 3])
    for b, (seq, offset) in enumerate(zip(kept, (2, 5))):  # the windows fixed when the rows joined
        ids = draft.token_ids[b].tolist()
        for j in range(3):
            assert torch.allclose(draft.probs[b, j], _q(model, seq[offset:] + ids[:j]), atol=1e-6), (b, j)


def test_a_tree_grows_after_the_window(tiny_draft):
    prop = DraftModelProposer(tiny_draft.model, 32, draft_context=W, tree=TreeSpec.parse("2-2", "iid"))
    seqs = [list(LONG), list(MID)]
    view = _view(seqs)
    prop.start(view, capacity=len(LONG) + 16)
    draft = prop.propose(view, [2, 2])
    for b, seq in enumerate(seqs):
        assert torch.allclose(draft.probs[b, 0], _q(tiny_draft.model, _window(seq)), atol=1e-6)  # the root
        for n in range(draft.num_nodes[b]):
            if draft.parents[b, n] == -1:  # a depth-1 node: its children were drawn from q after it
                token = draft.token_ids[b, n].item()
                assert torch.allclose(draft.probs[b, n + 1], _q(tiny_draft.model, _window(seq) + [token]), atol=1e-6)


def test_the_config_checks_and_prints_draft_context():
    for bad in (0, -3, 2.5, True, "many"):
        with pytest.raises(SpecError, match=r"draft_context") as err:
            SpecConfig(draft="model", draft_context=bad)
        assert err.value.key == "draft_context"
    with pytest.raises(SpecError, match="draft_context"):
        SpecConfig.parse("draft=model,draft_context=0")
    for value in (1, 256, None):
        cfg = SpecConfig(draft="model", draft_context=value)
        assert SpecConfig.parse(str(cfg)) == cfg and cfg.draft_context == value
    with pytest.raises(ValueError, match="draft_context"):
        DraftModelProposer(torch.nn.Linear(1, 1), 32, draft_context=0)


def test_build_proposer_passes_the_window_to_draft_models(tiny_target, tiny_draft):
    model = build_proposer(SpecConfig(draft="model", draft_context=7), tiny_target, tiny_draft).proposer
    self_draft = build_proposer(SpecConfig(draft="self", quant="int8", draft_context=5), tiny_target).proposer
    assert model.draft_context == 7 and self_draft.draft_context == 5


@pytest.mark.parametrize("spec", ["gamma=3,stop_below=none", "tree=2-2-1", "gamma=2,verify=block"])
def test_greedy_speculation_with_a_window_is_plain_greedy(spec, tiny_target, tiny_noisy):
    """Prompts longer and shorter than the window, in a batch of 2 that rows join and leave."""
    prompts = [LONG, SHORT, MID, LONG[2:], [5]]
    plain = SpeculativeGenerator(tiny_target, config=SpecConfig(draft="none"))
    spec_gen = SpeculativeGenerator(
        tiny_target, tiny_noisy, config=SpecConfig.parse(f"draft=model,draft_context=2,{spec}")
    )
    want = [c.token_ids for c in plain.generate(prompts, GREEDY, max_new_tokens=12, ignore_eos=True)]
    sess = spec_gen.session(max_batch=2)
    keys = [sess.add(p, GREEDY, max_new_tokens=12, ignore_eos=True) for p in prompts]
    done = {}
    while not sess.idle:
        done.update({e.key: e.completion for e in sess.step() if e.completion is not None})
    assert [done[k].token_ids for k in keys] == want
    assert spec_gen.core.proposer.draft_context == 2
    assert sess.stats.accepted > 0


@pytest.mark.slow  # ~5 s on 2 cores; the default tier checks greedy speculation with a window and q per slot
@pytest.mark.statistical
def test_a_windowed_draft_keeps_the_targets_law(tiny_target, tiny_draft):
    """PROMPT (6 tokens) read by a draft with a window of 2: chi-square at LEVEL over N = 12 000 seeded samples."""
    params = SETTINGS["top_k_top_p"]
    config = SpecConfig(draft="model", gamma=2, draft_context=2, stop_below=None, random="stream")
    gen = SpeculativeGenerator(tiny_target, tiny_draft, config=config)
    result = gof(sample_sequences(gen, params), exact_sequence_probs(tiny_target.model, PROMPT, params))
    assert not result.rejects(LEVEL), result
    assert 0 < gen.last_stats.accepted < gen.last_stats.drafted


@pytest.mark.parametrize("cross", ["tli", "slem"])
def test_a_cross_vocabulary_draft_reads_the_window_in_target_tokens(cross):
    """The bridged draft's rows hold the last 3 target tokens before the pending one (spelled in draft ids), and its
    greedy speculation is plain greedy, in a batch of 2 that rows join and leave."""
    target, draft = pair(0, True)
    prompts = [target.tokenizer.encode(s) for s in (SAMPLES[3], SAMPLES[0], "ecé", SAMPLES[6])]
    plain = SpeculativeGenerator(target, config=SpecConfig(draft="none"))
    want = [c.token_ids for c in plain.generate(prompts, GREEDY, max_new_tokens=10)]
    config = SpecConfig.parse(f"draft=model,cross_vocab={cross},gamma=4,draft_context=3")
    gen = SpeculativeGenerator(target, draft, config=config)
    runner, filled = gen.core.proposer.runner, []
    fill, add_rows = runner.fill, runner.add_rows
    runner.fill = lambda seqs, capacity: filled.extend(seqs) or fill(seqs, capacity)
    runner.add_rows = lambda seqs, capacity: filled.extend(seqs) or add_rows(seqs, capacity)
    sess = gen.session(max_batch=2)
    keys = [sess.add(p, GREEDY, max_new_tokens=10) for p in prompts]
    done = {}
    while not sess.idle:
        done.update({e.key: e.completion for e in sess.step() if e.completion is not None})
    assert [done[k].token_ids for k in keys] == want
    assert sorted(map(list, filled)) == sorted(p[-4:-1] for p in prompts)
    assert sess.stats.accepted > 0


def test_slem_with_a_window_proposes_what_it_proposes_after_the_window_alone():
    """W = 5 (beyond SLEM's look-behind of 4): the string-level drafter's proposals after a long prompt (its row left
    alone by `select`) are those of an unwindowed drafter given only the window's tokens, step after step; its cache
    holds the window and what followed."""
    target, draft = pair(0, True)
    seq = target.tokenizer.encode(SAMPLES[3])
    offset = len(seq) - 1 - 5
    assert offset > 0
    props = [
        build_proposer(SpecConfig.parse(f"draft=model,cross_vocab=slem,draft_context={w}"), target, draft).proposer
        for w in (5, "none")
    ]
    rows = [list(seq), seq[:1] + seq[1 + offset :]]  # the window: its head (5 // 4 = 1 token), then the last 4 + 1
    short = target.tokenizer.encode("ecé")
    props[0].start(_view([short, list(seq)], GREEDY), capacity=len(seq) + 32)
    props[0].select([1])  # the short row leaves: the long row's offset moves with it
    props[1].start(_view([rows[1]], GREEDY), capacity=len(seq) + 32)
    views = [_view([r], GREEDY) for r in rows]
    for prop, view in zip(props, views):
        view.vocab_size = prop.runner.vocab_size
    for _ in range(3):
        drafts = [p.propose(v, [4]).token_ids[0].tolist() for p, v in zip(props, views)]
        assert drafts[0] == drafts[1] and drafts[0]
        assert props[0].runner.lengths == [len(rows[0]) - offset]  # the window, then the pending token fed
        for r in rows:
            r.extend(drafts[0][:2])  # two drafts accepted (the second one pending)
