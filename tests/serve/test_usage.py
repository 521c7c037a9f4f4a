"""usage.speculation: per-request speculation figures."""

from verispec.engine import Completion, SpecStats
from verispec.serve.jobs import usage


def _done(tokens: list[int], steps: list[tuple[int, int]]) -> Completion:
    stats = SpecStats()
    for drafted, accepted in steps:
        stats.observe(drafted, accepted)
    return Completion(0, [1, 2], tokens, "", "stop", 2, [], [], stats)


def test_tokens_per_pass_counts_the_pass_that_produced_eos():
    """Two plain passes: one token returned, then EOS (not returned) — still one token per pass, never 0.5."""
    u = usage(2, [_done([7], [(0, 0), (0, 0)])])
    assert u.speculation.tokens_per_pass == 1.0 and u.completion_tokens == 1
    u = usage(2, [_done([7, 8, 9], [(4, 2)]), _done([5], [(4, 0), (0, 0)])])
    assert u.speculation.tokens_per_pass == (3 + 1 + 1) / 3
    assert u.speculation.acceptance_rate == 2 / 8
    assert u.prompt_tokens == 2 and u.total_tokens == 2 + 4  # one prompt, n = 2: counted once (OpenAI, vLLM)
    assert usage([2, 5], [_done([7], [(0, 0)])] * 4).prompt_tokens == 7  # two prompts, n = 2: each once
