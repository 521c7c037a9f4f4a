"""Slow tier, `llamacpp` marker: the llama.cpp runner on the default model (SmolLM2-135M Q4_1), with the extra
installed (`pip install -e ".[llamacpp]"`; `.ci/run` installs it and runs these).

Logits: a chain, a tree and one token at a time agree; rollback, rejected branches, finished rows and compaction
leave the other rows' logits as a fresh computation gives them (the graveyard of `verispec.model.llamacpp`: a
llama.cpp sequence whose token lands in a KV cell below its earlier positions gets wrong attention, which one test
reproduces on the raw API so that a llama.cpp release that fixes it shows up). Output law: speculative decoding on
this runner against plain decoding on it, a two-sample test at level 0.01 that a broken verifier fails.
"""

from __future__ import annotations

import pytest
import torch

from verispec.certify.bugs import broken_verifier
from verispec.certify.stats import chisquare_two_sample, detectable_tv
from verispec.engine import SpeculativeGenerator
from verispec.engine.config import SpecConfig
from verispec.engine.verify import Verification
from verispec.model import make_runner
from verispec.model.loading import default_model_path, load_model
from verispec.sampling import SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.llamacpp]
TOL = 1e-3  # measured 0.0 on this model: llama.cpp's CPU logits do not depend on the batch here


@pytest.fixture(scope="module")
def lc():
    # in the fixture, not at import: the default tier deselects these slow tests instead of reporting a skip
    pytest.importorskip("llama_cpp", reason='needs the extra: pip install -e ".[llamacpp]"')
    return load_model(default_model_path(), backend="llamacpp", threads=1)


@pytest.fixture(scope="module")
def prompt(lc):
    return lc.tokenizer("def fib(n):\n    return", add_special_tokens=True)["input_ids"]


def fresh(lc, prefix, tokens):
    """Logits [len(tokens), V] of `tokens` after `prefix`, computed in a new runner as one chain."""
    r = make_runner(lc.model, len(lc.tokenizer))
    r.fill([prefix], len(prefix) + len(tokens) + 4)
    return r.forward([tokens])[0]


def close(a, b):
    return (a - b).abs().max().item() <= TOL


def test_chain_tree_and_single_tokens_agree(lc, prompt):
    chain = fresh(lc, prompt, [10, 11, 12, 13])
    r = make_runner(lc.model, len(lc.tokenizer))
    r.fill([prompt], 64)
    single = torch.stack([r.forward([[t]], logits_at="last")[0] for t in [10, 11, 12, 13]])
    assert close(single, chain)
    r.fill([prompt], 64)  # a tree: 10 -> {11 -> 12, 99 -> 7}, 5 (a second root)
    tree = r.forward([[10, 11, 99, 12, 7, 5]], parents=[[-1, 0, 0, 1, 2, -1]])[0]
    assert close(tree[[0, 1, 3]], chain[:3])
    assert close(tree[[2, 4]], fresh(lc, prompt, [10, 99, 7])[1:])
    assert close(tree[5], fresh(lc, prompt, [5])[0])


def test_keep_paths_on_a_later_branch_then_continue(lc, prompt):
    r = make_runner(lc.model, len(lc.tokenizer))
    r.fill([prompt, prompt], 64)  # the second row shares the first's cells
    start = r.lengths
    r.forward([[10, 11, 99, 7], [10, 11, 99, 7]], parents=[[-1, 0, 0, 2], [-1, 0, 1, 2]])
    r.keep_paths(start, [[0, 2, 3], [0, 1]])
    assert r.lengths == [len(prompt) + 3, len(prompt) + 2]
    out = r.forward([[5], [5]], logits_at="last")
    assert close(out[0], fresh(lc, prompt, [10, 99, 7, 5])[-1])
    assert close(out[1], fresh(lc, prompt, [10, 11, 5])[-1])
    start = r.lengths
    r.forward([[1, 2], [1, 2]], parents=[[-1, -1], [-1, 0]])
    with pytest.raises(ValueError, match="root-to-node path"):
        r.keep_paths(start, [[0, 1], [0, 1]])  # row 0: node 1 is a second root, not a child of node 0


def test_grown_tree_over_several_forwards(lc, prompt):
    r = make_runner(lc.model, len(lc.tokenizer))
    r.fill([prompt], 64)
    start = r.lengths
    r.forward([[10, 99]], parents=[[-1, -1]], tree_start=start)
    x = r.forward([[11, 7]], parents=[[-1, -1, 0, 1]], tree_start=start)[0]
    assert close(x[0], fresh(lc, prompt, [10, 11])[1]) and close(x[1], fresh(lc, prompt, [99, 7])[1])


def test_rollbacks_and_finished_rows_leave_other_rows_exact(lc, prompt):
    """Speculative-looking steps on 3 rows: each forwards 4 tokens and keeps 1-3; a row leaves, one is duplicated,
    a row joins (the context grows: cells copied over); a small capacity forces compactions. Each row's logits then
    match a fresh computation."""
    V = len(lc.tokenizer)
    r = make_runner(lc.model, V)
    rows = [list(prompt), list(prompt[:5]), list(prompt[:7])]
    r.fill(rows, 40)
    g = torch.Generator().manual_seed(0)
    for step in range(40):
        toks = [torch.randint(0, V, (4,), generator=g).tolist() for _ in rows]
        out = r.forward(toks)
        keep = [1 + (step + b) % 3 for b in range(len(rows))]
        for b, row in enumerate(rows):
            assert close(out[b, keep[b] - 1], fresh(lc, row, toks[b][: keep[b]])[-1]), (step, b)
        r.keep_paths([len(row) for row in rows], [list(range(k)) for k in keep])
        rows = [row + t[:k] for row, t, k in zip(rows, toks, keep)]
        if step == 4:
            r.select([2, 0, 0])
            rows = [rows[2], rows[0], list(rows[0])]
        if step == 7:
            r.add_rows([prompt[:3]], 40)
            rows.append(list(prompt[:3]))
        if max(map(len, rows)) > 30:  # keep the rows inside the capacity
            r.truncate([len(p) - 6 for p in rows])
            rows = [p[:-6] for p in rows]
    assert r.compactions > 0


def test_llamacpp_reused_cells_below_a_sequence_give_wrong_logits(lc, prompt):
    """The llama.cpp behaviour the graveyard works around, on the raw API: a token that lands in a freed cell below
    its own sequence's latest cell. If this starts to fail, llama.cpp fixed it and the graveyard can go."""
    r = make_runner(lc.model, len(lc.tokenizer))
    lib = r.lib
    r.start(1, 64)
    items = [(t, [0], i, False) for i, t in enumerate(prompt)]
    r._decode(items)
    r._decode([(3, [5], 0, False)])  # another sequence's cell right after the prompt
    r._decode([(10, [0], len(prompt), False)])
    lib.llama_memory_seq_rm(r.mem, 5, -1, -1)  # freed: a hole below the sequence's last cell
    got = torch.from_numpy(r._decode([(99, [0], len(prompt) + 1, True)]).copy())[0, : r.vocab_size]
    assert not close(got, fresh(lc, prompt, [10, 99])[-1])


def test_greedy_speculation_gives_plain_decodings_tokens(lc):
    prompts = ["def fib(n):", "def fib(n):", "Write a haiku about the sea."]
    params = SamplingParams(temperature=0)
    plain = SpeculativeGenerator(lc, config=SpecConfig(draft="none")).generate(
        prompts, params, max_new_tokens=32, chat=True
    )
    model = "draft=model"
    for draft, spec in [
        (None, "draft=ngram"),
        (lc, model),
        (lc, f"{model},tree=2-2-1"),
        (lc, f"{model},tree=dynamic-3-2-6"),
    ]:
        got = SpeculativeGenerator(lc, draft, config=SpecConfig.parse(spec))
        got = got.generate(prompts, params, max_new_tokens=32, chat=True)
        assert [c.token_ids for c in got] == [c.token_ids for c in plain], spec


def first_tokens(gen, prompt, n, m, seed):
    """Tokens 0..m-1 of n seeded samples (one batch of rows per 64)."""
    out = []
    for s in range(0, n, 64):
        k = min(64, n - s)
        params = [SamplingParams(temperature=1.0, seed=seed + s + i) for i in range(k)]
        out += [c.token_ids[:m] for c in gen.generate([prompt] * k, params, max_new_tokens=m, ignore_eos=True)]
    return out


@pytest.mark.statistical
def test_speculation_matches_plain_decoding_on_this_runner(lc):
    """Two-sample chi-square homogeneity per position (0, 1, 2), Bonferroni at level 0.01, N = 512 a side, prompt
    lookup on a repetitive prompt (drafts at every position, often rejected). Power: each position's test detects a
    law at TV >= 0.26 from plain decoding's with probability 0.99 (`detectable_tv` on plain's own frequencies, the
    effective size N / 2; asserted), and the same test on a verifier that accepts every draft token (swap_p_q:
    u * p < q = 1 for a one-hot q) must reject (measured p ~1e-94, 1e-139, 1e-20 at this N). This runner's logits
    are checked exactly by the tests above; the output laws of the rules, at full power, by the torch runner's."""
    V = len(lc.tokenizer)
    prompt = lc.tokenizer("one two three one two three one two three one two", add_special_tokens=True)["input_ids"]
    n, m, level = 512, 3, 0.01  # 8 batches of 64
    plain = first_tokens(SpeculativeGenerator(lc, config=SpecConfig(draft="none")), prompt, n, m, seed=0)

    def pvalues(gen):
        got = first_tokens(gen, prompt, n, m, seed=10**6)
        return [
            chisquare_two_sample(
                torch.bincount(torch.tensor([s[j] for s in got]), minlength=V).numpy(),
                torch.bincount(torch.tensor([s[j] for s in plain]), minlength=V).numpy(),
            ).pvalue
            for j in range(m)
        ]

    for j in range(m):
        freq = torch.bincount(torch.tensor([s[j] for s in plain]), minlength=V).numpy() / n
        assert detectable_tv(freq, n / 2, level / m, 0.99) < 0.26, j
    exact = SpeculativeGenerator(lc, config=SpecConfig(draft="ngram", gamma=3))
    assert min(pvalues(exact)) > level / m
    assert exact.stats.drafted > n and 0 < exact.stats.accepted < exact.stats.drafted
    broken = SpeculativeGenerator(
        lc,
        config=SpecConfig(draft="ngram", gamma=3, random="stream"),
        verification=Verification(chain=broken_verifier("swap_p_q")),
    )
    assert min(pvalues(broken)) < level / m


@pytest.mark.parametrize(
    "forwards, path, kept",
    [  # (tokens, parents) per forward, the path kept (fed indices), and the tokens it spells
        ([([10, 11, 99], [-1, 0, 0])], [0, 2], [10, 99]),  # a second child, in one forward
        ([([10, 99], [-1, -1]), ([11, 7], [-1, -1, 0, 0])], [0, 2], [10, 11]),  # grown: fed indices not adjacent
        ([([10, 99], [-1, -1]), ([11, 7], [-1, -1, 1, 1])], [1, 3], [99, 7]),
        ([([10, 99, 5], [-1, -1, -1]), ([11], [-1, -1, -1, 2])], [2, 3], [5, 11]),
    ],
)
def test_keep_paths_whose_nodes_are_not_adjacent_slots(lc, prompt, forwards, path, kept):
    """The kept path's nodes need not sit in consecutive slots (a dynamic tree's draft feeds level by level): the
    row goes on from exactly the path's tokens, whichever sequence holds its last node."""
    r = make_runner(lc.model, len(lc.tokenizer))
    r.fill([prompt], 64)
    start = r.lengths
    for tokens, parents in forwards:
        r.forward([tokens], parents=[parents], tree_start=start)
    r.keep_paths(start, [path])
    assert r.lengths == [len(prompt) + len(path)]
    assert len(r._free_seqs) == r.n_seq_max - 2  # every branch's sequence is free again (the row holds one)
    out = r.forward([[5, 6]])[0]
    assert close(out, fresh(lc, prompt + kept, [5, 6]))
