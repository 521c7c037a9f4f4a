"""The mutants' interface (verispec.certify.mutants): each injection is checked against the config, runs the stream
randomness said in its config, and an observer that rebuilds q reads the very logits the draft was drawn from (its
exact rebuild reproduces the drafted q), so the q it hands over differs from the drawn one only by the bug."""

from __future__ import annotations

from typing import ClassVar

import pytest

from verispec.certify.mutants import LastWrite, Mutant, mutant, with_q
from verispec.engine.config import SpecConfig
from verispec.sampling import SamplingParams

from ..crossvocab.fixed_pair import pair
from ..helpers.cross_tok import SAMPLES


def test_the_config_a_mutant_runs():
    auto = SpecConfig.parse("draft=model,model=d,gamma=4")
    assert mutant("swap_p_q", auto).config(auto).random == "stream"  # said, not flipped inside the engine
    block = SpecConfig.parse("draft=model,model=d,gamma=4,verify=block,random=stream")
    ran = mutant("block_first_rejection", block).config(block)
    assert ran.chain_rule == "token" and ran.random == "stream"  # the broken block rule replaces verify=block
    with pytest.raises(ValueError, match="stream randomness"):
        mutant("swap_p_q", SpecConfig.parse("draft=model,model=d,random=gumbel"))
    with pytest.raises(ValueError, match="unknown verifier"):
        mutant("nope", auto)
    with pytest.raises(ValueError, match="cross_vocab auto or tli"):
        mutant("tli-last-write", SpecConfig.parse("draft=model,model=d,cross_vocab=slem"))


class _Exact(LastWrite):
    """tli-last-write's observer rebuilding q with the right merge (sum): it must give back the drafted q."""

    gaps: ClassVar[list[float]] = []

    def after_draft(self, view, draft):
        if draft.probs is None:
            return None
        right = self.runner.map.target_logits(self.draft_logits(view, draft), self.runner.vocab_size)
        rebuilt = with_q(view, draft, right)
        for b, n in enumerate(draft.num_nodes):
            if n:
                _Exact.gaps.append(float((rebuilt.probs[b, :n] - draft.probs[b, :n]).abs().max()))
        return None


def test_the_cross_vocabulary_mutant_reads_the_drafting_logits():
    target, draft = pair(0, agree=True)
    cfg = SpecConfig.parse("draft=model,gamma=3,stop_below=none,random=stream")
    gen = Mutant("tli-last-write", observer=_Exact).generator(target, draft, cfg)
    prompts = [target.tokenizer.encode(s) for s in SAMPLES[:4]] * 2
    gen.generate(prompts, [SamplingParams(temperature=1.0, seed=i) for i in range(8)], max_new_tokens=6)
    assert len(_Exact.gaps) >= 8 and max(_Exact.gaps) < 1e-5
    broken = mutant("tli-last-write", cfg).generator(target, draft, cfg)
    broken.generate(prompts, [SamplingParams(temperature=1.0, seed=i) for i in range(8)], max_new_tokens=6)
    assert 0 < broken.last_stats.accepted < broken.last_stats.drafted
