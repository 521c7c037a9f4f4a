"""SamplingParams validation and probs_from_logits processing, on hand-built logits."""

from __future__ import annotations

import math

import pytest
import torch

from verispec.sampling import SamplingParams, counts_at_nodes, probs_from_logits
from verispec.sampling.tree import chain_parents


@pytest.mark.parametrize(
    "field,value",
    [
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("temperature", float("inf")),
        ("temperature", "1"),
        ("top_k", -1),
        ("top_k", 2.5),
        ("top_k", True),
        ("top_p", 0.0),
        ("top_p", 1.01),
        ("top_p", -0.5),
        ("min_p", -0.01),
        ("min_p", 1.5),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3.0),
        ("seed", -1),
        ("seed", 1.5),
        ("seed", 2**63),
    ],
)
def test_invalid_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
        SamplingParams(**{field: value})


def test_params_are_frozen_and_normalised():
    sp = SamplingParams(temperature=1, top_k=3, seed=7)
    assert isinstance(sp.temperature, float) and sp.top_k == 3 and sp.seed == 7
    with pytest.raises(AttributeError):
        sp.temperature = 0.5  # type: ignore[misc]
    assert SamplingParams(temperature=0).greedy and not SamplingParams().uses_truncation


def P(*vals):
    return torch.tensor([list(vals)], dtype=torch.float64)


def test_temperature():
    logits = torch.randn(3, 2, 11, dtype=torch.float64)
    out = probs_from_logits(logits, SamplingParams(temperature=0.7))
    assert torch.allclose(out, (logits / 0.7).softmax(-1), atol=1e-12)
    assert out.shape == logits.shape


def test_greedy_is_one_hot_with_lowest_id_on_ties():
    out = probs_from_logits(P(1.0, 3.0, 3.0, 2.0), SamplingParams(temperature=0))
    assert out.tolist() == [[0.0, 1.0, 0.0, 0.0]]


def test_top_k_keeps_k_tokens_ties_by_id():
    out = probs_from_logits(P(1.0, 2.0, 2.0, 0.0, 2.0), SamplingParams(top_k=2))
    assert out[0].tolist() == pytest.approx([0, 0.5, 0.5, 0, 0])


def test_top_p_smallest_set_reaching_mass():
    logits = P(0.5, 0.3, 0.15, 0.05).log()
    keep2 = probs_from_logits(logits, SamplingParams(top_p=0.75))
    assert keep2[0].tolist() == pytest.approx([0.625, 0.375, 0, 0])
    keep3 = probs_from_logits(logits, SamplingParams(top_p=0.85))  # 0.5 + 0.3 < 0.85: the third joins
    assert keep3[0].tolist() == pytest.approx([0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0])
    keep1 = probs_from_logits(logits, SamplingParams(top_p=0.1))  # the top token is always kept
    assert keep1[0].tolist() == pytest.approx([1, 0, 0, 0])


def test_top_k_then_top_p_then_min_p_order():
    logits = P(0.4, 0.3, 0.2, 0.1).log()
    out = probs_from_logits(logits, SamplingParams(top_k=3, top_p=0.7))  # top_k renormalises: 4/9, 3/9, 2/9
    assert out[0].tolist() == pytest.approx([4 / 7, 3 / 7, 0, 0])
    out = probs_from_logits(logits, SamplingParams(min_p=0.6))  # 0.3 >= 0.6 * 0.4, 0.2 < 0.24
    assert out[0].tolist() == pytest.approx([4 / 7, 3 / 7, 0, 0])


def test_penalties():
    logits = P(2.0, -1.0, 0.5, 1.0)
    prompt = torch.tensor([[True, True, False, False]])
    counts = torch.tensor([[0, 0, 2, 0]])
    sp = SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    out = probs_from_logits(logits, sp, prompt_mask=prompt, output_counts=counts)
    expect = torch.tensor([[2.0 / 2, -1.0 * 2, 0.5 / 2 - 0.5 - 0.5, 1.0]], dtype=torch.float64).softmax(-1)
    assert torch.allclose(out, expect, atol=1e-12)


def test_per_row_params_and_mixed_greedy_batch():
    logits = torch.randn(3, 4, 9, dtype=torch.float64)
    rows = [SamplingParams(temperature=0), SamplingParams(temperature=2.0, top_k=3), SamplingParams()]
    out = probs_from_logits(logits, rows)
    for b, sp in enumerate(rows):
        assert torch.equal(out[b : b + 1], probs_from_logits(logits[b : b + 1], sp))
    with pytest.raises(ValueError, match="3 rows"):
        probs_from_logits(logits, rows[:2])


def test_counts_at_nodes_of_a_chain():
    base = torch.tensor([[1, 0, 0, 0]])
    drafts = torch.tensor([[2, 2, -1]])
    c = counts_at_nodes(base, drafts, chain_parents(1, 3))  # the padding node's slot is never read: base counts
    assert c.tolist() == [[[1, 0, 0, 0], [1, 0, 1, 0], [1, 0, 2, 0], [1, 0, 0, 0]]]


def test_counts_at_nodes_of_a_tree_follow_each_path():
    base = torch.tensor([[0, 1, 0, 0]])
    tokens = torch.tensor([[2, 3, 2, -1]])  # nodes 0 and 1 hang off the root, node 2 below node 1
    parents = torch.tensor([[-1, -1, 1, -1]])
    c = counts_at_nodes(base, tokens, parents)
    assert c.tolist() == [[[0, 1, 0, 0], [0, 1, 1, 0], [0, 1, 0, 1], [0, 1, 1, 1], [0, 1, 0, 0]]]


def test_same_function_for_draft_and_target_positions():
    """Penalties use per-position counts: q at draft position j sees drafts < j, exactly like p does."""
    logits = torch.randn(1, 3, 6, dtype=torch.float64)
    sp = SamplingParams(frequency_penalty=1.0)
    drafts = torch.tensor([[4, 4]])
    counts = counts_at_nodes(torch.zeros(1, 6), drafts, chain_parents(1, 2))
    probs = probs_from_logits(logits, sp, output_counts=counts)
    for j in range(3):
        single = probs_from_logits(logits[:, j], sp, output_counts=counts[:, j])
        assert torch.allclose(probs[:, j], single)
    assert probs[0, 2, 4] < (logits[0, 2].softmax(-1))[4]


def test_bad_logits():
    sp = SamplingParams()
    with pytest.raises(ValueError, match="NaN"):
        probs_from_logits(P(0.0, math.nan), sp)
    with pytest.raises(ValueError, match="NaN or \\+inf"):
        probs_from_logits(P(0.0, math.inf), sp)
    with pytest.raises(ValueError, match="every logit is -inf"):
        probs_from_logits(P(-math.inf, -math.inf), sp)
    with pytest.raises(ValueError, match="floating-point"):
        probs_from_logits(torch.tensor([[1, 2]]), sp)
    with pytest.raises(ValueError, match="output_counts must have shape"):
        probs_from_logits(P(0.0, 1.0), SamplingParams(presence_penalty=1.0), output_counts=torch.zeros(1, 3))
    assert torch.isfinite(probs_from_logits(P(-math.inf, 0.0), sp)).all()


def test_processing_on_low_precision_logits_is_float32():
    out = probs_from_logits(torch.randn(2, 8).bfloat16(), SamplingParams(top_p=0.9))
    assert out.dtype == torch.float32 and torch.allclose(out.sum(-1), torch.ones(2))


@pytest.mark.parametrize("t", [1.2e-38, 1e-30, 1e-6, 1e-3, 0.7, 1e30, 3.4e38])
def test_any_accepted_temperature_gives_a_distribution(t):
    """Logits shifted before the temperature: a tiny one is (near-)greedy and a huge one near-uniform, never NaN
    (x / t overflowed for |x| > 3.4e38 t). The exact law: softmax(x / t) computed in float64 where it is finite."""
    logits = torch.tensor([[3.0, 2.5, -1.0, float("-inf"), 40.0, 39.99]])
    p = probs_from_logits(logits, SamplingParams(temperature=t))
    assert torch.isfinite(p).all() and abs(float(p.sum()) - 1) < 1e-6 and p[0, 3] == 0
    ref = torch.softmax(logits.double() / t, -1)
    assert torch.allclose(p.double(), ref, atol=1e-6)
