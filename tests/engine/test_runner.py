"""The model runner and its row-wise KV cache against plain full forwards of the same HF model."""

from __future__ import annotations

import pytest
import torch

from verispec.engine.runner import HFRunner

from .tiny import make_model


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_ragged_chunks_and_rollback_match_fresh_forward(family):
    model = make_model(0, family)
    seqs = [[1, 5, 7, 3, 9, 2, 4, 11], [3, 3, 1], [8, 6, 5, 4, 3, 2, 1, 0, 2, 9]]
    with torch.no_grad():
        ref = [model(torch.tensor([s])).logits[0] for s in seqs]
    r = HFRunner(model)
    r.start(3, 32)
    r.prefill([s[:2] for s in seqs])
    lo = r.forward([s[2:5] for s in seqs])  # 3, 1 and 3 new tokens
    for b, s in enumerate(seqs):
        n = len(s[2:5])
        torch.testing.assert_close(lo[b, :n], ref[b][2:2 + n], atol=1e-5, rtol=1e-5)
    # roll rows back by different amounts (a rejected draft), then continue: same logits as a fresh forward
    r.truncate([3, 3, 4])
    lo = r.forward([seqs[0][3:], [], seqs[2][4:]])
    torch.testing.assert_close(lo[0, :5], ref[0][3:8], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lo[2, :6], ref[2][4:10], atol=1e-5, rtol=1e-5)
    assert r.lengths == [8, 3, 10]
    last = r.forward([[1], [2], [3]], logits_at="last")
    assert last.shape == (3, 32)


def test_rollback_then_different_continuation():
    model = make_model(1)
    r = HFRunner(model)
    r.start(1, 16)
    r.forward([[1, 2, 3, 4, 5, 6]])
    r.truncate([3])
    lo = r.forward([[9, 9]])
    with torch.no_grad():
        fresh = model(torch.tensor([[1, 2, 3, 9, 9]])).logits[0, 3:]
    torch.testing.assert_close(lo[0], fresh, atol=1e-5, rtol=1e-5)


def test_select_rows_and_bad_calls():
    model = make_model(2)
    r = HFRunner(model)
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
