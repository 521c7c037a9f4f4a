"""The model runners (transformers forward and verispec's fast forward) and the row-wise KV cache against
plain full forwards of the same HF model."""

from __future__ import annotations

import pytest
import torch

from verispec.model.fast import FastRunner
from verispec.model.runner import HFRunner

from ..helpers.tiny import make_model

RUNNERS = {"hf": HFRunner, "fast": FastRunner}


@pytest.mark.parametrize("runner", list(RUNNERS))
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
def test_ragged_chunks_and_rollback_match_fresh_forward(family, runner):
    model = make_model(0, family)
    with torch.no_grad():  # non-zero biases (qwen2's q/k/v), so the fused bias path is exercised
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    seqs = [[1, 5, 7, 3, 9, 2, 4, 11], [3, 3, 1], [8, 6, 5, 4, 3, 2, 1, 0, 2, 9]]
    with torch.no_grad():
        ref = [model(torch.tensor([s])).logits[0] for s in seqs]
    r = RUNNERS[runner](model)
    r.start(3, 32)
    r.prefill([s[:2] for s in seqs])
    lo = r.forward([s[2:5] for s in seqs])  # 3, 1 and 3 new tokens
    for b, s in enumerate(seqs):
        n = len(s[2:5])
        torch.testing.assert_close(lo[b, :n], ref[b][2 : 2 + n], atol=1e-5, rtol=1e-5)
    # roll rows back by different amounts (a rejected draft), then continue: same logits as a fresh forward
    r.truncate([3, 3, 4])
    lo = r.forward([seqs[0][3:], [], seqs[2][4:]])
    torch.testing.assert_close(lo[0, :5], ref[0][3:8], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lo[2, :6], ref[2][4:10], atol=1e-5, rtol=1e-5)
    assert r.lengths == [8, 3, 10]
    last = r.forward([[1], [2], [3]], logits_at="last")
    assert last.shape == (3, 32)


@pytest.mark.parametrize("runner", list(RUNNERS))
def test_rollback_then_different_continuation(runner):
    model = make_model(1)
    r = RUNNERS[runner](model)
    r.start(1, 16)
    r.forward([[1, 2, 3, 4, 5, 6]])
    r.truncate([3])
    lo = r.forward([[9, 9]])
    with torch.no_grad():
        fresh = model(torch.tensor([[1, 2, 3, 9, 9]])).logits[0, 3:]
    torch.testing.assert_close(lo[0], fresh, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("runner", list(RUNNERS))
def test_select_rows_and_bad_calls(runner):
    model = make_model(2)
    r = RUNNERS[runner](model)
    r.start(3, 8)
    r.forward([[1, 2], [3], [4, 5]])
    r.select([2, 0])
    assert r.lengths == [2, 2]
    with pytest.raises(ValueError, match="rollback"):
        r.truncate([3, 1])
    with pytest.raises(ValueError, match="batch of 2"):
        r.forward([[1]])
    with pytest.raises(RuntimeError, match="capacity"):
        r.forward([[1] * 7, [1]])


@pytest.mark.parametrize("runner", list(RUNNERS))
@pytest.mark.parametrize("family", ["mistral", "qwen2-sliding"])
def test_sliding_window_models_keep_their_window(family, runner):
    """The runner builds its own 4D mask, so it must apply a model's sliding window itself."""
    from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    kw = dict(
        vocab_size=32,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        sliding_window=3,
    )
    if family == "mistral":
        model = MistralForCausalLM(MistralConfig(**kw)).eval()
    else:  # one full-attention and one sliding layer: the model takes one mask per layer type
        model = Qwen2ForCausalLM(
            Qwen2Config(
                **kw, use_sliding_window=True, max_window_layers=1, layer_types=["full_attention", "sliding_attention"]
            )
        ).eval()
    seq = [1, 5, 7, 3, 9, 2, 4, 11, 6, 8, 10, 12]
    with torch.no_grad():
        ref = model(torch.tensor([seq])).logits[0]
        unwindowed = model(torch.tensor([seq]), attention_mask=torch.ones(1, 1, 12, 12).tril().log()).logits[0]
    assert (ref - unwindowed).abs().max() > 1e-3  # the window matters for this sequence
    r = RUNNERS[runner](model)
    r.start(1, 16)
    r.prefill([seq[:5]])
    torch.testing.assert_close(r.forward([seq[5:]])[0], ref[5:], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("runner", list(RUNNERS))
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_tree_masked_logits_equal_separate_branch_forwards(family, runner):
    """One pass over a token tree (row 0) next to a chain (row 1, a chain written as a tree) gives, at every
    node, the logits of a plain forward over prefix + the node's branch; keeping one path then continues
    exactly like a fresh forward over prefix + that path."""
    model = make_model(3, family)
    prefix = [[1, 5, 7, 3], [9, 2]]
    tree = [10, 11, 12, 13, 14, 15]
    parents = [-1, 0, 0, 1, 3, -1]  # branches: 10-11-13-14, 10-12, 15
    branch = {0: [10], 1: [10, 11], 2: [10, 12], 3: [10, 11, 13], 4: [10, 11, 13, 14], 5: [15]}
    chain = [20, 21, 22]
    r = RUNNERS[runner](model)
    r.start(2, 32)
    r.prefill(prefix)
    logits = r.forward([tree, chain], parents=[parents, [-1, 0, 1]])
    with torch.no_grad():
        for node, toks in branch.items():
            ref = model(torch.tensor([prefix[0] + toks])).logits[0, -1]
            torch.testing.assert_close(logits[0, node], ref, atol=1e-5, rtol=1e-5)
        ref_chain = model(torch.tensor([prefix[1] + chain])).logits[0, -3:]
    torch.testing.assert_close(logits[1, :3], ref_chain, atol=1e-5, rtol=1e-5)
    r.keep_paths([4, 2], [[0, 2], [0, 1, 2]])  # row 0 keeps 10-12 (slots moved), row 1 its whole chain
    assert r.lengths == [6, 5]
    nxt = r.forward([[16], [23]])
    with torch.no_grad():
        torch.testing.assert_close(
            nxt[0, 0], model(torch.tensor([prefix[0] + [10, 12, 16]])).logits[0, -1], atol=1e-5, rtol=1e-5
        )
        torch.testing.assert_close(
            nxt[1, 0], model(torch.tensor([prefix[1] + chain + [23]])).logits[0, -1], atol=1e-5, rtol=1e-5
        )


@pytest.mark.parametrize("runner", list(RUNNERS))
def test_tree_grown_over_several_forwards(runner):
    """A drafter grows its tree level by level (tree_start): the logits equal those of a one-pass tree, and a
    kept path continues like a fresh forward."""
    model = make_model(3, "qwen2")
    prefix = [[1, 5, 7, 3], [9, 2]]
    r = RUNNERS[runner](model)
    r.start(2, 40)
    r.prefill(prefix)
    one = r.forward([[10, 11, 12, 13, 14], [20, 21]], parents=[[-1, -1, 0, 0, 2], [-1, 0]])
    r.truncate([4, 2])
    lv1 = r.forward([[10, 11], [20]], parents=[[-1, -1], [-1]], tree_start=[4, 2])
    lv2 = r.forward([[12, 13], [21]], parents=[[-1, -1, 0, 0], [-1, 0]], tree_start=[4, 2])
    lv3 = r.forward([[14], []], parents=[[-1, -1, 0, 0, 2], [-1, 0]], tree_start=[4, 2])
    torch.testing.assert_close(lv1[0, :2], one[0, :2], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lv2[0, :2], one[0, 2:4], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lv3[0, 0], one[0, 4], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lv2[1, 0], one[1, 1], atol=1e-5, rtol=1e-5)
    r.keep_paths([4, 2], [[0, 2, 4], [0, 1]])
    nxt = r.forward([[30], [31]])
    with torch.no_grad():
        torch.testing.assert_close(
            nxt[0, 0], model(torch.tensor([prefix[0] + [10, 12, 14, 30]])).logits[0, -1], atol=1e-5, rtol=1e-5
        )
        torch.testing.assert_close(
            nxt[1, 0], model(torch.tensor([prefix[1] + [20, 21, 31]])).logits[0, -1], atol=1e-5, rtol=1e-5
        )


def test_bad_trees():
    r = HFRunner(make_model(0))
    r.start(1, 16)
    with pytest.raises(ValueError, match="earlier node"):
        r.forward([[1, 2]], parents=[[-1, 1]])
    with pytest.raises(ValueError, match="2 parents for 3"):
        r.forward([[1, 2, 3]], parents=[[-1, 0]])
    r.forward([[1, 2, 3]], parents=[[-1, 0, 0]])
    with pytest.raises(ValueError, match="increasing nodes"):
        r.keep_paths([0], [[2, 0]])


def test_every_runner_implements_the_runner_protocol():
    """The engine sees a model only through `model.Runner` (make_runner's return type)."""
    from verispec.model import Runner, make_runner
    from verispec.model.llamacpp import LlamaCppRunner

    model = make_model(0)
    for runner in (HFRunner(model), FastRunner(model), make_runner(model), make_runner(model, runner="hf")):
        assert isinstance(runner, Runner)
    methods = ("start", "fill", "add_rows", "lengths", "truncate", "select", "forward", "keep_paths", "prefill")
    assert [m for m in methods if not hasattr(LlamaCppRunner, m)] == []  # (its model needs llama-cpp-python)
