"""Cross-vocabulary units on the tiny tokenizer pair (tests/helpers/cross_tok.py): `token_keys`, `VocabMap` (the
intersection against the fixture's own construction lists, q summed over draft ids sharing a string, spelling),
`CrossVocabError` for a pair with nothing in common, and `BridgedRunner`'s bookkeeping (its logits against the
draft model run afresh, without a cache, on the spelled ids, through chains, trees, truncate, select, keep_paths,
add_rows and prefill).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from verispec.crossvocab import BridgedRunner, CrossVocabError, VocabMap, same_tokenizer, token_keys
from verispec.crossvocab.vocab import FLOOR
from verispec.engine.config import SpecConfig
from verispec.engine.generator import SpeculativeGenerator
from verispec.model.fast import make_runner
from verispec.sampling import SamplingParams

from ..helpers.cross_tok import (
    DRAFT_VOCAB,
    SAMPLES,
    TARGET_VOCAB,
    disjoint_pair,
    draft_tokenizer,
    duplicate_draft_ids,
    shared_id_pairs,
    shared_special_strings,
    shared_strings,
    target_tokenizer,
)
from .fixed_pair import pair as fixed_pair

V_T, V_D = len(TARGET_VOCAB), len(DRAFT_VOCAB)
T = {tok: i for i, tok in enumerate(TARGET_VOCAB)}  # target token -> id
D = {tok: i for i, tok in enumerate(DRAFT_VOCAB)}  # draft token -> id


@pytest.fixture(scope="module")
def pair():
    return fixed_pair(0, agree=True)


@pytest.fixture(scope="module")
def vmap(pair):
    target, draft = pair
    return VocabMap.build(target.tokenizer, draft.tokenizer, V_T, V_D)


@pytest.fixture(scope="module")
def vmap_last(pair):
    target, draft = pair
    return VocabMap.build(target.tokenizer, draft.tokenizer, V_T, V_D, merge="last")


def _preimages() -> dict[int, list[int]]:
    """target id -> the draft ids standing for it (from the fixture's construction lists)."""
    out: dict[int, list[int]] = {}
    for t, d in sorted(shared_id_pairs()):
        out.setdefault(t, []).append(d)
    return out


# --- token_keys ---------------------------------------------------------------------------------------------------
def test_token_keys_byte_level():
    keys, fallback = token_keys(target_tokenizer(), V_T)
    assert keys[T["Ġ"]] == b" " and keys[T["Ċ"]] == b"\n" and keys[T["ĊĊ"]] == b"\n\n"
    assert keys[T["Ġab"]] == b" ab" and keys[T["Ã"]] == b"\xc3" and keys[T["©"]] == b"\xa9"
    assert keys[T["ĠÃ©"]] == " é".encode() and keys[T["abc"]] == b"abc"
    assert keys[T["<|im_end|>"]] == "special:<|im_end|>" and keys[T["<|endoftext|>"]] == "special:<|endoftext|>"
    assert not any(fallback)


def test_token_keys_sentencepiece():
    keys, fallback = token_keys(draft_tokenizer(), V_D)
    assert keys[D["▁"]] == b" " and keys[D["▁ab"]] == b" ab" and keys[D["▁efg"]] == b" efg"
    assert keys[D["<0x61>"]] == b"a" and keys[D["<0x20>"]] == b" " and keys[D["<0x0A>"]] == b"\n"
    assert keys[D["<0xC3>"]] == b"\xc3" and keys[D["<0xA9>"]] == b"\xa9"
    assert keys[D["<unk>"]] == "special:<unk>" and keys[D["<|im_end|>"]] == "special:<|im_end|>"
    assert [i for i, f in enumerate(fallback) if f] == [D[t] for t in DRAFT_VOCAB if t.startswith("<0x")]
    # ids past the tokenizer's own: no key
    keys, fallback = token_keys(draft_tokenizer(), V_D + 3)
    assert keys[V_D:] == [None] * 3 and fallback[V_D:] == [False] * 3


def test_token_keys_match_what_the_tokenizers_decode():
    """Every ordinary token's key is the UTF-8 of what the tokenizer decodes it to (where that is whole UTF-8)."""
    for tok, size in ((target_tokenizer(), V_T), (draft_tokenizer(), V_D)):
        keys, _ = token_keys(tok, size)
        for i, k in enumerate(keys):
            if isinstance(k, bytes) and k.decode(errors="ignore") == k.decode(errors="replace"):
                assert tok.decode([i]).encode() == k, (i, k)


# --- the intersection ---------------------------------------------------------------------------------------------
def test_intersection_is_the_fixtures(vmap):
    pairs = shared_id_pairs()
    d2t = {d: t for t, d in pairs}
    assert len(d2t) == len(pairs)  # the target has no duplicate strings: one target id per draft id
    assert vmap.d2t.tolist() == [d2t.get(d, -1) for d in range(V_D)]
    pre = _preimages()
    for t in range(V_T):
        if t not in pre:
            assert int(vmap.t2d[t]) == -1, TARGET_VOCAB[t]
            continue
        d = int(vmap.t2d[t])
        assert (t, d) in pairs, TARGET_VOCAB[t]
        ordinary = [x for x in pre[t] if not DRAFT_VOCAB[x].startswith("<0x")]
        assert d == (ordinary or pre[t])[0], TARGET_VOCAB[t]  # what the draft's tokenizer writes for it
    assert vmap.intersection == len(shared_strings()) == 26
    assert vmap.shared_draft_ids == len(pairs) == 29
    assert set(vmap.target_specials) & set(vmap.draft_specials) == shared_special_strings()


def test_canonical_draft_id_is_what_the_draft_tokenizer_encodes(vmap):
    """A one-character string the draft has twice (ordinary piece, byte fallback) is fed as the piece its tokenizer
    writes (longer strings: BPE's merge order decides, e.g. ' ef' is '▁' 'ef')."""
    dt = draft_tokenizer()
    checked = 0
    for t in range(V_T):
        key = vmap.target_keys[t]
        if int(vmap.t2d[t]) < 0 or not isinstance(key, bytes) or len(key) != 1 or key[0] >= 0x80:
            continue  # outside the intersection, a special, or not one ASCII character
        checked += 1
        assert dt.encode(key.decode(), add_special_tokens=False) == [int(vmap.t2d[t])], TARGET_VOCAB[t]
    assert checked == 12  # a-h, space, newline, '.', ',' (' ', '.', 'a' have a byte-fallback twin)


def test_duplicates_map_to_one_target_id(vmap, vmap_last):
    dups = duplicate_draft_ids()
    assert len(dups) == 3
    for ids in dups:
        targets = {int(vmap.d2t[d]) for d in ids} | {int(vmap_last.d2t[d]) for d in ids}
        assert len(targets) == 1 and targets != {-1}, [DRAFT_VOCAB[d] for d in ids]


# --- q in the target's vocabulary ---------------------------------------------------------------------------------
def _summed_probs(logits: torch.Tensor) -> torch.Tensor:
    """[..., V_T]: the draft's softmax summed over each target id's preimages, renormalized over the intersection."""
    pre = _preimages()
    valid = sorted(d for ds in pre.values() for d in ds)
    q = torch.zeros(*logits.shape[:-1], V_D, dtype=torch.float64)
    q[..., valid] = logits[..., valid].double().softmax(-1)  # renormalized over the intersection's draft ids
    out = torch.zeros(*logits.shape[:-1], V_T, dtype=torch.float64)
    for t, ds in pre.items():
        out[..., t] = q[..., ds].sum(-1)
    return out


def test_target_logits_add_probabilities(vmap):
    g = torch.Generator().manual_seed(3)
    logits = 4 * torch.randn(5, 3, V_D, generator=g)  # batch dims kept
    out = vmap.target_logits(logits, V_T)
    assert out.shape == (5, 3, V_T)
    outside = [t for t in range(V_T) if t not in _preimages()]
    assert len(outside) == V_T - 26
    assert (out[..., outside] <= logits.amin(-1, keepdim=True) - FLOOR).all()  # probability 0 in float32
    torch.testing.assert_close(out.double().softmax(-1), _summed_probs(logits), atol=1e-6, rtol=1e-5)
    # log-sum-exp: a duplicated target id's logit is the log of its preimages' summed exp
    for ids in duplicate_draft_ids():
        t = int(vmap.d2t[ids[0]])
        torch.testing.assert_close(out[..., t], logits[..., list(ids)].logsumexp(-1))
    # huge logits: no overflow, no NaN (a preimage's exp underflowing to 0 is -inf, as its probability is)
    big = vmap.target_logits(logits * 1000, V_T)
    assert not big.isnan().any() and torch.isfinite(big.amax(-1)).all()
    torch.testing.assert_close(big.double().softmax(-1), _summed_probs(logits * 1000), atol=1e-6, rtol=1e-5)


def test_merge_last_keeps_one_preimage(vmap_last):
    """merge="last": the highest preimage's logit alone, so the duplicates' probabilities do not add up."""
    logits = torch.zeros(1, V_D)
    for ids in duplicate_draft_ids():  # the fallback byte token and the ordinary piece: equal logits
        logits[0, list(ids)] = 2.0
    last = vmap_last.target_logits(logits, V_T).double().softmax(-1)
    kept = [max(ds) for ds in _preimages().values()]
    q = logits[0, kept].double().softmax(-1)
    want = torch.zeros(1, V_T, dtype=torch.float64)
    want[0, list(_preimages())] = q
    torch.testing.assert_close(last, want)
    summed = _summed_probs(logits)
    for ids in duplicate_draft_ids():
        t = int(vmap_last.d2t[ids[0]])
        assert float(summed[0, t]) > 1.3 * float(last[0, t]), TARGET_VOCAB[t]
    assert float((last - summed).abs().sum()) / 2 > 0.1  # total variation
    logits = torch.randn(2, V_D, generator=torch.Generator().manual_seed(4))
    out = vmap_last.target_logits(logits, V_T)
    for ids in duplicate_draft_ids():
        torch.testing.assert_close(out[:, int(vmap_last.d2t[ids[0]])], logits[:, max(ids)])


def test_merge_must_be_known(pair):
    target, draft = pair
    with pytest.raises(CrossVocabError, match="merge"):
        VocabMap.build(target.tokenizer, draft.tokenizer, V_T, V_D, merge="mean")


def test_agreeing_draft_gives_duplicates_real_mass(pair):
    """The premise of the lossy merge="last" failing the law tests: the agreeing draft's byte-fallback duplicates
    carry about as much probability as their ordinary pieces."""
    _target, draft = pair
    ids = torch.tensor([draft.tokenizer.encode(SAMPLES[1])])
    with torch.no_grad():
        q = draft.model(ids).logits[0].softmax(-1)  # [T, V_D]
    for dup in duplicate_draft_ids():
        fallback, ordinary = sorted(dup)
        ratio = q[:, fallback].sum() / q[:, ordinary].sum()
        assert 0.3 < float(ratio) < 3, [DRAFT_VOCAB[d] for d in dup]


# --- spelling -----------------------------------------------------------------------------------------------------
def test_spell_every_target_token(vmap):
    for t in range(V_T):
        ids = vmap.spell(t)
        key = vmap.target_keys[t]
        if isinstance(key, str):  # a special: the draft's special of the same content
            assert ids == [vmap.draft_specials[key[len("special:") :]]]
            assert DRAFT_VOCAB[ids[0]] == TARGET_VOCAB[t]
            continue
        assert ids, TARGET_VOCAB[t]  # the draft can spell every byte of the target's alphabet
        assert b"".join(vmap.draft_keys[d] for d in ids) == key, TARGET_VOCAB[t]
        if int(vmap.t2d[t]) >= 0:
            assert ids == [int(vmap.t2d[t])]
        else:
            assert len(ids) > 1
    assert [DRAFT_VOCAB[d] for d in vmap.spell(T["ĠÃ©"])] == ["▁", "<0xC3>", "<0xA9>"]
    assert [DRAFT_VOCAB[d] for d in vmap.spell(T["Ġabc"])] == ["▁ab", "c"]
    assert [DRAFT_VOCAB[d] for d in vmap.spell(T["ĊĊ"])] == ["<0x0A>", "<0x0A>"]
    assert vmap.spell(V_T + 5) == []  # an id the target does not have


def test_spell_bytes_skips_what_the_draft_cannot_spell(vmap):
    assert [DRAFT_VOCAB[d] for d in vmap.spell_bytes(b"a z")] == ["a", "▁"]  # no draft token starts with 'z'
    assert vmap.spell_bytes(b"") == []
    assert vmap.draft_text_bytes(vmap.spell_bytes(b"abcd efgh")) == b"abcd efgh"


def test_text_bytes_round_trip(vmap, pair):
    target, draft = pair
    for text in SAMPLES:
        t_ids = target.tokenizer.encode(text)
        d_ids = draft.tokenizer.encode(text)
        assert vmap.target_text_bytes(t_ids) == text.encode() == vmap.draft_text_bytes(d_ids), text
        spelled = [d for t in t_ids for d in vmap.spell(t)]
        assert vmap.draft_text_bytes(spelled) == text.encode(), text


# --- a pair with nothing in common --------------------------------------------------------------------------------
def test_disjoint_pair_is_refused():
    target, draft = disjoint_pair(0)
    with pytest.raises(CrossVocabError, match="no token in common"):
        VocabMap.build(target.tokenizer, draft.tokenizer, V_T, len(draft.tokenizer))
    assert not same_tokenizer(target, draft)
    for mode in ("auto", "tli"):
        with pytest.raises(CrossVocabError, match=r"no token in common.*cross_vocab=slem"):
            SpeculativeGenerator(target, draft, config=SpecConfig(draft="model", cross_vocab=mode))
    # string-level exact match needs no shared token: it re-tokenizes the draft's text (here never the target's)
    gen = SpeculativeGenerator(target, draft, config=SpecConfig(draft="model", cross_vocab="slem", gamma=2))
    plain = SpeculativeGenerator(target, config=SpecConfig(draft="none"))
    greedy = SamplingParams(temperature=0.0)
    assert (
        gen.generate(SAMPLES[0], greedy, max_new_tokens=6)[0].token_ids
        == plain.generate(SAMPLES[0], greedy, max_new_tokens=6)[0].token_ids
    )


def test_same_tokenizer_is_not_bridged(tiny_target, tiny_draft, pair):
    """cross_vocab=auto bridges only where the tokenizers differ; forcing tli on one tokenizer gives the identity."""
    target, draft = pair
    assert same_tokenizer(tiny_target, tiny_draft) and not same_tokenizer(target, draft)
    gen = SpeculativeGenerator(tiny_target, tiny_draft, config=SpecConfig(draft="model"))
    assert not isinstance(gen.core.proposer.runner, BridgedRunner)
    gen = SpeculativeGenerator(target, draft, config=SpecConfig(draft="model"))
    assert isinstance(gen.core.proposer.runner, BridgedRunner)
    vm = VocabMap.build(tiny_target.tokenizer, tiny_target.tokenizer, 32, 32)
    assert all(vm.spell(t) == [t] for t in range(32))
    assert vm.d2t.tolist() == vm.t2d.tolist() == list(range(32))


# --- BridgedRunner --------------------------------------------------------------------------------------------------
class Mirror:
    """What a BridgedRunner's rows hold, in target ids, and the draft's logits after any of them, computed afresh:
    one forward of the draft model, without a cache, over the row's tokens spelled in draft ids."""

    def __init__(self, runner: BridgedRunner, model, vm: VocabMap):
        self.runner, self.model, self.map = runner, model, vm
        self.rows: list[list[int]] = []

    @torch.no_grad()
    def after(self, seq: list[int]) -> torch.Tensor:
        """[V_D]: the draft's logits after the draft ids spelling seq (its last draft id's)."""
        ids = [d for t in seq for d in self.map.spell(t)]
        assert ids, "nothing fed: no logits to compare"
        return self.model(torch.tensor([ids])).logits[0, -1]

    def check_lengths(self):
        assert self.runner.lengths == [len(r) for r in self.rows]
        spelled = [sum(len(self.map.spell(t)) for t in r) for r in self.rows]
        assert self.runner.inner.lengths == spelled

    def chain(self, chunks: list[list[int]], logits_at: str = "all"):
        """Feed chains; every row's logits (draft and target vocabulary) equal the fresh ones."""
        out = self.runner.draft_forward(chunks, logits_at=logits_at)
        for b, chunk in enumerate(chunks):
            if logits_at == "last":
                if chunk:
                    self._close(out[b], self.after(self.rows[b] + chunk), (b, chunk))
            else:
                for i in range(len(chunk)):
                    self._close(out[b, i], self.after(self.rows[b] + chunk[: i + 1]), (b, chunk, i))
            self.rows[b] = self.rows[b] + chunk
        self.check_lengths()
        return out

    def tree(self, chunks, parents, start):
        """Feed tree nodes (parents: every node's since the tree's start, this chunk's last); returns each row's
        tree so far (node -> its path) for keep_paths."""
        out = self.runner.draft_forward(chunks, parents=parents, tree_start=start)
        for b, chunk in enumerate(chunks):
            nodes = self._tree[b]
            for i, tok in enumerate(chunk):
                p = parents[b][len(nodes)]
                nodes.append((nodes[p] if p >= 0 else []) + [tok])
                self._close(out[b, i], self.after(self._base[b] + nodes[-1]), (b, chunk, i))
        return out

    def begin_tree(self):
        self._base = [list(r) for r in self.rows]
        self._tree: list[list[list[int]]] = [[] for _ in self.rows]

    def keep(self, start, paths):
        self.runner.keep_paths(start, paths)
        self.rows = [self._base[b] + (self._tree[b][p[-1]] if p else []) for b, p in enumerate(paths)]
        for b, p in enumerate(paths):  # a path is root first: each node's parent is the one before it
            assert [self._tree[b][n][-1] for n in p] == (self._tree[b][p[-1]] if p else [])
        self.check_lengths()

    @staticmethod
    def _close(got, want, where):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4, msg=lambda m: f"{where}: {m}")


def _bridged(pair, vm):
    _target, draft = pair
    runner = BridgedRunner(make_runner(draft.model, V_D), vm, V_T)
    return runner, Mirror(runner, draft.model, vm)


@torch.inference_mode()
def test_bridged_runner_chains_and_rollback(pair, vmap):
    target, _draft = pair
    runner, m = _bridged(pair, vmap)
    prompts = [target.tokenizer.encode(s) for s in (SAMPLES[0], SAMPLES[6], SAMPLES[3])]
    runner.fill(prompts, 8)  # small: the rows outgrow it (spelled tokens take up to 3 draft slots)
    m.rows = [list(p) for p in prompts]
    m.check_lengths()
    # multi-id tokens (Ġabc: 2 draft ids, ĠÃ©: 3), rows of different lengths, an empty row
    multi = [T["Ġabc"], T["ĠÃ©"], T["a"], T["ĊĊ"]]
    m.chain([multi, [T["Ã©"]], []])
    logits = runner.forward([[T["."]], [T["ĠÃ©"], T["b"]], [T["cd"], T["Ġ"]]], logits_at="last")
    assert logits.shape == (3, V_T)
    m.rows = [r + c for r, c in zip(m.rows, [[T["."]], [T["ĠÃ©"], T["b"]], [T["cd"], T["Ġ"]]])]
    m.check_lengths()
    m.chain([[T["efg"]], [T["a"], T["abd"]], [T["Ġab"]]], logits_at="last")
    # roll back into the multi-id tokens, then on
    cut = [len(prompts[0]) + 2, len(m.rows[1]) - 1, len(m.rows[2])]
    runner.truncate(cut)
    m.rows = [r[:n] for r, n in zip(m.rows, cut)]
    m.check_lengths()
    m.chain([[T["ĠÃ©"], T["Ġabd"]], [T["ab"]], [T["Ċ"], T["<|im_end|>"]]])
    # select: reorder and drop rows
    runner.select([2, 0])
    m.rows = [m.rows[2], m.rows[0]]
    m.check_lengths()
    m.chain([[T["Ġcd"]], [T["Ġabc"], T["Ġabc"], T["Ġabc"], T["Ġabc"]]])
    # rows join; then prefill (no logits) and on
    new = target.tokenizer.encode(SAMPLES[4])
    runner.add_rows([new], 8)
    m.rows.append(list(new))
    m.check_lengths()
    m.chain([[T["h"]], [T["g"]], [T["ĠÃ©"]]])
    more = [[T["Ġab"], T["ĠÃ©"]], [], [T["abc"]]]
    runner.prefill(more)
    m.rows = [r + c for r, c in zip(m.rows, more)]
    m.check_lengths()
    m.chain([[T["Ġ"]], [T["."], T["Ġe"]], [T["f"]]])
    # target-vocabulary logits are the map's of the draft's
    out = runner.forward([[T["a"]], [T["b"]], [T["c"]]])
    want = vmap.target_logits(torch.stack([m.after(r + [t]) for r, t in zip(m.rows, [0, 1, 2])]), V_T)
    torch.testing.assert_close(out[:, 0], want, atol=2e-5, rtol=1e-4)


@torch.inference_mode()
def test_bridged_runner_trees(pair, vmap):
    """Tree nodes (one draft id each) over several forwards, then keep_paths; the rows go on as chains."""
    target, _draft = pair
    runner, m = _bridged(pair, vmap)
    prompts = [target.tokenizer.encode(s) for s in (SAMPLES[0], SAMPLES[7], SAMPLES[2])]
    runner.fill([p[:-1] for p in prompts], 16)
    m.rows = [list(p[:-1]) for p in prompts]
    m.chain([[p[-1]] for p in prompts], logits_at="last")  # the pending tokens: the root
    for keep in ([[0, 2], [1], []], [[0, 3], [], [0, 2]]):
        start = list(runner.lengths)
        m.begin_tree()
        level1 = [[T["Ġab"], T["a"]], [T["Ġ"], T["ab"]], [T["ef"]]]
        parents = [[-1, -1], [-1, -1], [-1]]
        m.tree(level1, parents, start)
        level2 = [[T["c"], T["."]], [T["gh"]], [T["g"], T["h"]]]
        parents = [[-1, -1, 0, 0], [-1, -1, 1], [-1, 0, 0]]
        m.tree(level2, parents, start)
        m.keep(start, keep)
        m.chain([[T["Ġabc"]], [T["ĠÃ©"], T["a"]], [T["cd"]]])  # the bonus / correction tokens and on
    # a node outside the intersection (drawn only where a request allowed none of it) takes one stand-in slot
    before = runner.lengths
    runner.forward([[T["Ġabc"]], [], []], parents=[[-1], [], []])
    assert runner.lengths == [before[0] + 1, *before[1:]]


@torch.inference_mode()
def test_bridged_runner_grows_past_its_capacity(pair, vmap):
    target, _ = pair
    runner, m = _bridged(pair, vmap)
    prompt = target.tokenizer.encode("abc abd")
    runner.fill([prompt], 4)
    m.rows = [prompt]
    for _ in range(6):
        m.chain([[T["ĠÃ©"]] * 5], logits_at="last")  # 15 draft slots per call
    assert runner.inner.capacity >= runner.inner.lengths[0] == 4 + 6 * 15  # ab c ▁ab d, then the calls'


def _none_map(vm: VocabMap) -> VocabMap:
    """vm where the target's '<|endoftext|>' is spelled by no draft id (as a target special the draft lacks)."""
    t = T["<|endoftext|>"]
    out = dataclasses.replace(
        vm,
        t2d=vm.t2d.clone(),
        draft_specials={k: v for k, v in vm.draft_specials.items() if k != "<|endoftext|>"},
        _spell={},
    )
    out.t2d[t] = -1
    assert out.spell(t) == [] and out.spell(T["a"]) == [D["a"]]
    return out


@torch.inference_mode()
def test_bridged_runner_token_spelled_by_nothing_mid_chunk(pair, vmap):
    """A target token the draft cannot spell feeds nothing: the logits after it are those before it."""
    target, _ = pair
    vm = _none_map(vmap)
    runner, m = _bridged(pair, vm)
    nothing = T["<|endoftext|>"]
    prompts = [target.tokenizer.encode(s) for s in (SAMPLES[0], SAMPLES[1])]
    runner.fill(prompts, 16)
    m.rows = [list(p) for p in prompts]
    m.chain([[T["a"], nothing, T["b"]], [T["Ġabc"], nothing]])
    m.chain([[T["c"], nothing, nothing], [T["a"]]], logits_at="last")
    m.chain([[nothing], [T["b"], nothing]])  # the first token: the logits after the last call
    m.chain([[nothing, T["d"]], [nothing]], logits_at="last")
    m.chain([[nothing], [nothing]])  # no draft id fed at all


@torch.inference_mode()
@pytest.mark.parametrize("after", ["fill", "truncate", "keep_paths", "select", "add_rows", "prefill"])
def test_bridged_runner_token_spelled_by_nothing_first(pair, vmap, after):
    """A chunk that starts with a token spelled by nothing, right after the rows changed: its logits are the
    draft's after the row's last draft id (not stale ones from before the change, not zeros)."""
    target, _ = pair
    vm = _none_map(vmap)
    runner, m = _bridged(pair, vm)
    nothing = T["<|endoftext|>"]
    prompts = [target.tokenizer.encode(s) for s in (SAMPLES[0], SAMPLES[1])]
    runner.fill(prompts, 16)
    m.rows = [list(p) for p in prompts]
    if after != "fill":
        m.chain([[T["a"], T["b"], T["c"]], [T["d"], T["Ġe"]]])
    if after == "truncate":
        cut = [len(m.rows[0]) - 2, len(m.rows[1]) - 1]
        runner.truncate(cut)
        m.rows = [r[:n] for r, n in zip(m.rows, cut)]
    elif after == "keep_paths":
        start = list(runner.lengths)
        m.begin_tree()
        m.tree([[T["a"], T["g"]], [T["h"], T["gh"]]], [[-1, -1], [-1, -1]], start)
        m.keep(start, [[0], []])
    elif after == "select":
        runner.select([1, 0])
        m.rows = m.rows[::-1]
    elif after == "add_rows":
        new = target.tokenizer.encode(SAMPLES[2])
        runner.add_rows([new], 16)
        m.rows.append(list(new))
    elif after == "prefill":
        more = [[T["Ġab"], T["ĠÃ©"]], [T["h"]]]
        runner.prefill(more)
        m.rows = [r + c for r, c in zip(m.rows, more)]
    m.check_lengths()
    B = len(m.rows)
    m.chain([[nothing, T["a"]]] * B)
    m.chain([[nothing]] * B, logits_at="last")
