"""CombinedProposer: a draft model's sampled chain (nodes first) beside a chooser's deterministic trie, in one tree
verified with rule "mixed" — the tree it builds, the q slots it gives, how `update` splits the accepted path
between its parts, its counts, and the arguments it refuses. (The mixed rule's exactness: tests/sampling/test_tree.py
and the tree certificate, `certify kernel --tree mixed`.)"""

from __future__ import annotations

import pytest
import torch

from verispec.drafting import BatchView, CombinedProposer, DraftModelProposer, HistoryProposer, RolloutHistory, TreeSpec
from verispec.engine.config import SpecConfig
from verispec.engine.generator import SpeculativeGenerator
from verispec.sampling import SamplingParams, probs_from_logits
from verispec.sampling.tree import verify_tree

from ..helpers.tiny import greedy_reference

V = 32
PROMPT = [5, 6, 7]
TRIE = TreeSpec(dynamic=True, depth=3, topk=2, budget=6)
SAMPLE = SamplingParams(temperature=1.0)


def _parts(model, gamma: int = 3):
    history = RolloutHistory()
    history.add(PROMPT, [8, 9, 10, 11])
    history.add(PROMPT, [8, 12, 13])
    chooser = HistoryProposer(history, ngram_sizes=(2, 1), tree=TRIE)
    sampler = DraftModelProposer(model, V, stop_below=None)
    return chooser, sampler, CombinedProposer(chooser, sampler, gamma)


def _view(seqs, seed: int = 0) -> BatchView:
    gens = [torch.Generator().manual_seed(seed + b) for b in range(len(seqs))]
    return BatchView(seqs=[list(s) for s in seqs], params=[SAMPLE] * len(seqs), generators=gens, vocab_size=V)


PROMPTS = [PROMPT, PROMPT, [20, 21, 22]]
SEQS = [PROMPT + [8, 9], PROMPT + [8], [20, 21, 22]]  # rows 0, 1 match the history; row 2 matches nothing
CAPS = [3, 2, 3]


def _started(model, gamma: int = 3):
    chooser, sampler, combined = _parts(model, gamma)
    combined.start(_view(PROMPTS), 64)
    return chooser, sampler, combined


def test_the_tree_is_the_chain_then_the_branches(tiny_draft):
    _, _, combined = _started(tiny_draft.model)
    draft = combined.propose(_view(SEQS), CAPS)
    _, ref_sampler, _ = _started(tiny_draft.model)  # the two parts alone, on the same rows and seeds
    ref_chooser, _, _ = _started(tiny_draft.model)
    chain = ref_sampler.propose(_view(SEQS), [min(3, c) for c in CAPS])
    branches = ref_chooser.propose(_view(SEQS), CAPS)
    assert draft.rule == "mixed" and not draft.chain
    assert branches.num_nodes[0] > 0 and branches.num_nodes[1] > 0 and branches.num_nodes[2] == 0
    for b in range(3):
        k, t = chain.num_nodes[b], branches.num_nodes[b]
        assert k == min(3, CAPS[b]) and draft.num_nodes[b] == k + t
        row = draft.token_ids[b].tolist()
        assert row[: k + t] == chain.token_ids[b, :k].tolist() + branches.token_ids[b, :t].tolist()
        assert all(x == -1 for x in row[k + t :])
        shifted = [p + k if p >= 0 else -1 for p in branches.parents[b, :t].tolist()]
        assert draft.parents[b, : k + t].tolist() == list(range(-1, k - 1)) + shifted
        assert draft.sampled[b].tolist() == [True] * k + [False] * (draft.width - k)
        assert draft.depth[b] == max(k, branches.depth[b])
    # q: the chain's slots only (root, then after each chain node), exactly what each chain node was drawn from
    assert torch.equal(draft.probs, chain.probs[:, : draft.width + 1])
    with torch.no_grad():
        for j in range(3):
            logits = tiny_draft.model(torch.tensor([SEQS[0] + chain.token_ids[0, :j].tolist()])).logits[0, -1]
            assert torch.allclose(draft.probs[0, j], probs_from_logits(logits.unsqueeze(0), [SAMPLE])[0], atol=1e-5)
    # the draft meets verify_tree's contract for rule "mixed" (input checks on)
    uniform = torch.full((3, draft.width + 1, V), 1 / V)
    nn = torch.tensor(draft.num_nodes)
    verify_tree(uniform, draft.token_ids, draft.parents, draft.probs, nn, rule=draft.rule, sampled=draft.sampled)


def test_nothing_to_draft_gives_an_empty_deterministic_tree(tiny_draft):
    _, _, combined = _started(tiny_draft.model)
    draft = combined.propose(_view(SEQS), [0, 0, 0])
    assert draft.num_nodes == [0, 0, 0] and draft.rule == "deterministic" and draft.probs is None
    assert draft.sampled is None


def _spy(part, calls: list):
    real = part.update

    def update(view, old_lengths, draft, paths):
        calls.append((draft, paths))
        real(view, old_lengths, draft, paths)

    part.update = update


def test_update_gives_each_part_its_own_path(tiny_draft):
    chooser, sampler, combined = _started(tiny_draft.model)
    view = _view(SEQS)
    seqs = view.seqs  # committed tokens go here
    draft = combined.propose(view, CAPS)
    k = [int(n) for n in draft.sampled.sum(1)]  # chain lengths per row
    chain_calls, branch_calls = [], []
    _spy(sampler, chain_calls)
    _spy(chooser, branch_calls)
    child = draft.parents[1].tolist().index(k[1])  # row 1: a node below its first branch node
    paths = [[0, 1], [k[1], child], []]  # row 0: two chain nodes; row 1: a branch and its child; row 2: none
    old = [len(s) for s in seqs]
    for b, path in enumerate(paths):
        seqs[b].extend(draft.token_ids[b, path].tolist() + [4])  # the accepted tokens, then the final one
    combined.update(view, old, draft, paths)
    assert chain_calls[0][1] == [[0, 1], [], []] and branch_calls[0][1] == [[], [0, child - k[1]], []]
    assert chain_calls[0][0].chain and branch_calls[0][0].rule == "deterministic"  # each part gets its own draft
    assert branch_calls[0][0].parents[1, child - k[1]] == 0
    assert combined.accepted_by_source == {"chain": 2, "branches": 2}
    # the draft model kept exactly the chain nodes it computed: its next q equals a fresh forward on each row
    nxt = combined.propose(view, [1, 1, 1])
    with torch.no_grad():
        for b in range(3):
            logits = tiny_draft.model(torch.tensor([seqs[b]])).logits[0, -1]
            assert torch.allclose(nxt.probs[b, 0], probs_from_logits(logits.unsqueeze(0), [SAMPLE])[0], atol=1e-5)
    combined.update(view, [len(s) for s in seqs], nxt, [[], [], []])
    assert combined.accepted_by_source == {"chain": 2, "branches": 2}


def test_greedy_generation_equals_the_target_and_counts_both_parts(tiny_target, tiny_draft, tiny_noisy):
    """Through the engine (rule "mixed" in the session's verifier): greedy output is the target's greedy
    continuation; with the target's own continuation in the history the branches are accepted, with a draft that
    agrees often (and an empty history) the chain is."""
    prompt = [3, 4, 5, 3, 4]
    want = greedy_reference(tiny_target.model, prompt, 12)
    for draft, known in ((tiny_draft, [want]), (tiny_noisy, [])):
        history = RolloutHistory()
        for completion in known:
            history.add(prompt, completion)
        combined = CombinedProposer(
            HistoryProposer(history, tree=TRIE), DraftModelProposer(draft.model, V, stop_below=None), 2
        )
        gen = SpeculativeGenerator(tiny_target, combined, config=SpecConfig(draft="custom"))
        out = gen.generate(prompt, SamplingParams(temperature=0), max_new_tokens=12)[0]
        assert out.token_ids == want
        part = "branches" if known else "chain"
        assert combined.accepted_by_source[part] >= len(want) // 3, combined.accepted_by_source


def test_bad_arguments_are_refused(tiny_draft):
    chooser, sampler, _ = _parts(tiny_draft.model)
    with pytest.raises(ValueError, match="chooser must draft deterministic trees"):
        CombinedProposer(sampler, sampler, 2)  # a chain drafter has no tree
    sampled_tree = DraftModelProposer(tiny_draft.model, V, tree=TreeSpec(widths=(2,), rule="iid"))
    with pytest.raises(ValueError, match="chooser must draft deterministic trees"):
        CombinedProposer(sampled_tree, sampler, 2)
    with pytest.raises(ValueError, match="sampler must be a DraftModelProposer that drafts chains"):
        CombinedProposer(chooser, chooser, 2)
    with pytest.raises(ValueError, match="sampler must be a DraftModelProposer that drafts chains"):
        CombinedProposer(chooser, DraftModelProposer(tiny_draft.model, V, tree=TreeSpec(widths=(2,))), 2)
    for gamma in (0, -1, True, 2.0, "2"):
        with pytest.raises(ValueError, match="gamma"):
            CombinedProposer(chooser, sampler, gamma)
    # the KV slots and nodes a step can use: the trie plus the chain
    spec = CombinedProposer(chooser, sampler, 4).tree
    assert (spec.dynamic, spec.max_depth, spec.topk, spec.max_nodes) == (True, 4, 3, TRIE.max_nodes + 4)


def test_choose_depth_gives_each_row_one_part(tiny_draft):
    """With choose_depth, a row whose trie is deep enough is drafted by the trie alone (no draft-model work, no
    randomness consumed), the others by the chain alone; both kinds share one "mixed" draft."""
    chooser, sampler, _ = _parts(tiny_draft.model)
    combined = CombinedProposer(chooser, sampler, 3, choose_depth=2)
    combined.start(_view(PROMPTS), 64)
    branches = HistoryProposer(chooser.history, ngram_sizes=(2, 1), tree=TRIE)
    branches.start(_view(PROMPTS), 64)
    depths = branches.propose(_view(SEQS), CAPS).depth
    view = _view(SEQS)
    draft = combined.propose(view, CAPS)
    for b, d in enumerate(depths):
        flags = draft.sampled[b, : draft.num_nodes[b]].tolist()
        assert flags and (all(not f for f in flags) if d >= 2 else all(flags)), (b, d, flags)
    assert any(d >= 2 for d in depths) and any(d < 2 for d in depths)
    with pytest.raises(ValueError, match="choose_depth"):
        CombinedProposer(chooser, sampler, 3, choose_depth="deep")
