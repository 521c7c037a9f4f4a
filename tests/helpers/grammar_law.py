"""The exact law of a constrained output, from first principles: every output a grammar allows up to a budget,
enumerated, each with its probability under the target (full forwards of the model over prompt + prefix, no cache,
the grammar's mask from a fresh xgrammar matcher applied to the logits first, then temperature 1 softmax).
Independent of verispec's runner, processors and `verispec.structured` (xgrammar is used directly).

An outcome is (output token ids without the stop token, finish reason): "stop" where EOS was drawn, "length" where
the budget ran out. Without a grammar the law is the plain one (every token allowed at every position).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import xgrammar as xgr

from verispec.certify.stats import GofResult, chisquare_gof

Outcome = tuple[tuple[int, ...], str]


def compile_ebnf(tokenizer, vocab_size: int, eos: int, ebnf: str):
    """xgrammar's compiled grammar for this tokenizer (EOS the only stop token)."""
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=[eos])
    return xgr.GrammarCompiler(info, max_threads=1).compile_grammar(ebnf)


def fresh_mask(compiled, vocab_size: int, prefix: Sequence[int]) -> torch.Tensor:
    """[V] bool: the tokens a new matcher allows after accepting `prefix` (all True once it has accepted a stop)."""
    m = xgr.GrammarMatcher(compiled)
    for t in prefix:
        assert m.accept_token(int(t)), f"the grammar refuses {t} after {list(prefix)}"
    if m.is_terminated():
        return torch.ones(vocab_size, dtype=torch.bool)
    bits = xgr.allocate_token_bitmask(1, vocab_size)
    m.fill_next_token_bitmask(bits)
    logits = torch.zeros(1, vocab_size)
    xgr.apply_token_bitmask_inplace(logits, bits)  # xgrammar's own: refused tokens -> -inf
    return torch.isfinite(logits[0])


@dataclass
class Law:
    outcomes: list[Outcome]
    probs: np.ndarray  # [len(outcomes)] float64, summing to 1

    def index(self) -> dict[Outcome, int]:
        return {o: i for i, o in enumerate(self.outcomes)}

    def gof(self, samples: Sequence[Outcome]) -> GofResult:
        """Chi-square goodness of fit of sampled outcomes (one extra bin of probability 0 for anything else)."""
        idx = self.index()
        counts = np.zeros(len(self.outcomes) + 1)
        for s in samples:
            counts[idx.get(s, len(self.outcomes))] += 1
        return chisquare_gof(counts, np.append(self.probs, 0.0))


@torch.no_grad()
def exact_law(model, prompt: Sequence[int], max_new: int, eos: int, compiled=None, vocab_size: int = 32) -> Law:
    """The law of (output, finish reason) at temperature 1 under the grammar (None: plain), budget max_new."""
    out: dict[Outcome, float] = {}
    frontier: list[tuple[tuple[int, ...], float]] = [((), 1.0)]
    while frontier:
        ids = torch.tensor([list(prompt) + list(p) for p, _ in frontier])  # one length per frontier
        logits = model(ids).logits[:, -1].double()  # [n, V]
        nxt = []
        for (prefix, mass), row in zip(frontier, logits):
            if compiled is not None:
                row = row.masked_fill(~fresh_mask(compiled, vocab_size, prefix), float("-inf"))
            p = row.softmax(-1).tolist()
            for t, pt in enumerate(p):
                if pt <= 0:
                    continue
                if t == eos:
                    out[(prefix, "stop")] = out.get((prefix, "stop"), 0.0) + mass * pt
                elif len(prefix) + 1 == max_new:
                    out[(prefix + (t,), "length")] = mass * pt
                else:
                    nxt.append((prefix + (t,), mass * pt))
        frontier = nxt
    outcomes = sorted(out)
    probs = np.array([out[o] for o in outcomes])
    assert abs(probs.sum() - 1) < 1e-9, probs.sum()
    return Law(outcomes, probs / probs.sum())


def outcomes_of(completions) -> list[Outcome]:
    return [(tuple(c.token_ids), c.finish_reason) for c in completions]


def truncated(outcome: Outcome, n: int) -> Outcome:
    """An outcome as the budget n would have ended it (the law of a prefix of the output, budget n)."""
    tokens, reason = outcome
    return (tokens[:n], "length") if len(tokens) >= n else (tokens, reason)
