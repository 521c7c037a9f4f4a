"""The step stays on the device until its results move to the host: a fixed number of device -> host transfers per
step (`.tolist()`, `.item()`, `.cpu()`, `.numpy()`, and a tensor's truth value, int or float), the same at every
batch size and draft length (vLLM's rule: one transfer per step, not one per row or per draft token).

Counted over `GenerationSession.run` (draft, fit, score, verify, commit, emit) with a drafter whose chains are made
on the host (no transfer), so every counted transfer is the engine's own. A draft model's chain loop is not counted:
it feeds each sampled draft token back to its runner, one transfer per draft position."""

import pytest
import torch

from verispec.drafting import Draft, Proposer
from verispec.engine import SpecConfig, SpeculativeGenerator
from verispec.sampling import SamplingParams

MOST = 3  # the drafted nodes, a residual draw's empty-row check, the results (faults, accepted, tokens, logprobs)


class _HostChain(Proposer):
    """Drafts `cap` tokens per row, each the row's last token + 1 (mod 32), built from host lists."""

    def propose(self, view, caps):
        ids = [[(s[-1] + j + 1) % 32 for j in range(c)] + [-1] * (max(caps) - c) for s, c in zip(view.seqs, caps)]
        return Draft.chain_of(torch.tensor(ids, dtype=torch.int64).view(len(caps), max(caps)), None, list(caps))


HOOKS = ("tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__")


class _Count:
    def __init__(self, monkeypatch):
        self.n = 0
        for name in HOOKS:
            orig = getattr(torch.Tensor, name)

            def counted(t, *a, _orig=orig, **k):
                self.n += 1
                return _orig(t, *a, **k)

            monkeypatch.setattr(torch.Tensor, name, counted)


def _transfers_per_step(target, batch: int, gamma: int, monkeypatch) -> list[int]:
    gen = SpeculativeGenerator(target, _HostChain(), config=SpecConfig(draft="custom", gamma=gamma))
    sess = gen.session()
    prompt = [1, 2, 3, 4, 5]
    for i in range(batch):
        sess.add(prompt, SamplingParams(temperature=1.0, seed=i), max_new_tokens=40, ignore_eos=True)
    sess.schedule()  # joins and prefills: not a step
    with monkeypatch.context() as m:
        count = _Count(m)
        per_step = []
        for _ in range(4):
            before = count.n
            sess.run()
            per_step.append(count.n - before)
    return per_step


@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("gamma", [1, 8])
def test_a_step_moves_its_results_to_the_host_once(tiny_target, batch, gamma, monkeypatch):
    per_step = _transfers_per_step(tiny_target, batch, gamma, monkeypatch)
    assert all(n <= MOST for n in per_step), per_step


def test_the_count_does_not_grow_with_batch_or_gamma(tiny_target, monkeypatch):
    counts = {(b, g): _transfers_per_step(tiny_target, b, g, monkeypatch) for b in (1, 8) for g in (1, 8)}
    assert len({tuple(c) for c in counts.values()}) == 1, counts
