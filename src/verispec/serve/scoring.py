"""Prompt logprobs for completions' `echo` with `logprobs`: one target forward over the prompt (in chunks), on a runner
of its own that shares the target's weights (nothing is copied) and holds a cache only while it scores. Raw
log-softmax, as every logprob the server returns; the first token has none (None), as OpenAI and vLLM answer."""

from __future__ import annotations

import torch

from ..model.fast import FastRunner, make_runner
from ..model.runner import HFRunner

__all__ = ["PromptScorer"]

CHUNK = 256  # prompt tokens per forward: bounds the [chunk, vocab] logits


class PromptScorer:
    def __init__(self, gen):
        self.gen = gen
        self._runner: HFRunner | None = None

    @property
    def unavailable(self) -> str | None:
        """Why prompts cannot be scored here (None: they can)."""
        if not isinstance(self.gen.core.runner, HFRunner):
            return "prompt logprobs (echo with logprobs) need a torch runner; this model runs on llama.cpp"
        return None

    def _make(self) -> HFRunner:
        if self._runner is None:
            kind = "fast" if isinstance(self.gen.core.runner, FastRunner) else "hf"
            self._runner = make_runner(self.gen.target.model, self.gen.core.vocab_size, runner=kind)
        return self._runner

    @torch.inference_mode()
    def __call__(self, ids: list[int], top_n: int = 0) -> tuple[list[float | None], list | None]:
        """Per prompt token: log p(ids[t] | ids[:t]) (None at t = 0), and with top_n its best alternatives
        [(token, logprob), ...] (None at t = 0; None for the whole list without top_n)."""
        runner = self._make()
        logprobs: list[float | None] = [None]
        top: list | None = [None] if top_n else None
        runner.start(1, len(ids))
        try:
            for s in range(0, len(ids) - 1, CHUNK):
                fed = ids[s : min(s + CHUNK, len(ids) - 1)]
                nxt = torch.tensor(ids[s + 1 : s + 1 + len(fed)], device=runner.device)  # [T]: what each predicts
                logp = torch.log_softmax(runner.forward([fed])[0], -1)  # [T, V]
                logprobs += logp.gather(-1, nxt.unsqueeze(-1)).squeeze(-1).tolist()
                if top_n:
                    values, alts = logp.topk(top_n, dim=-1)
                    top += [list(zip(a, v)) for a, v in zip(alts.tolist(), values.tolist())]
        finally:
            runner.cache = None  # free the cache between requests
        return logprobs, top
