"""The engine's output distribution over its first L = 3 tokens, against the target's exact sequence distribution
(all V^3 = 32768 sequences enumerated from the target itself): one chi-square goodness-of-fit test (bins merged to
expected counts >= 5), at level LEVEL = 1e-4, over N seeded samples of PROMPT."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from verispec.certify.stats import chisquare_gof
from verispec.engine.generator import SpeculativeGenerator
from verispec.sampling import SamplingParams, probs_from_logits

from .tiny import V

LEVEL = 1e-4
N = 12_000
L = 3
PROMPT = [3, 7, 7, 12, 3, 7]

SETTINGS = {
    "temperature": SamplingParams(temperature=0.6),
    "top_k_top_p": SamplingParams(temperature=1.0, top_k=12, top_p=0.9),
    "penalties": SamplingParams(temperature=0.8, repetition_penalty=1.5, frequency_penalty=0.5),
}


@torch.no_grad()
def exact_sequence_probs(model, prompt: list[int], params: SamplingParams) -> np.ndarray:
    """P(x1, x2, x3 | prompt) under the processed target, flattened over V^3 sequences."""
    prompt_mask = torch.zeros(1, V, dtype=torch.bool)
    prompt_mask[0, prompt] = True
    joint = torch.ones(1, dtype=torch.float64)
    prefixes = torch.empty((1, 0), dtype=torch.int64)
    for _ in range(L):
        n = prefixes.shape[0]
        ids = torch.cat([torch.tensor(prompt).expand(n, -1), prefixes], 1)
        logits = model(ids).logits[:, -1]  # [n, V]
        counts = torch.zeros(n, V).scatter_add_(1, prefixes, torch.ones_like(prefixes, dtype=torch.float32))
        p = probs_from_logits(logits, params, prompt_mask=prompt_mask.expand(n, -1), output_counts=counts)
        joint = (joint.unsqueeze(1) * p.double()).reshape(-1)  # [n * V]
        prefixes = torch.cat([prefixes.repeat_interleave(V, 0), torch.arange(V).repeat(n).unsqueeze(1)], 1)
    return (joint / joint.sum()).numpy()


def sample_sequences(gen: SpeculativeGenerator, params: SamplingParams, n: int = N) -> np.ndarray:
    rows = [replace(params, seed=10_000 + i) for i in range(n)]
    outs = gen.generate([PROMPT] * n, rows, max_new_tokens=L, ignore_eos=True)
    seqs = np.array([o.token_ids for o in outs])
    assert seqs.shape == (n, L)
    return seqs


def gof(seqs: np.ndarray, probs: np.ndarray):
    index = (seqs[:, 0] * V + seqs[:, 1]) * V + seqs[:, 2]
    return chisquare_gof(np.bincount(index, minlength=V**L), probs)
