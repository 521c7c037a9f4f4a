"""Draft-model drafting: a smaller model samples tokens with the request's own SamplingParams, through the same
`probs_from_logits` as the target, so q is exactly what it sampled from — a chain of up to gamma tokens, or
(with a TreeSpec) a token tree grown level by level (`verispec.drafting.tree`).

The draft keeps its own KV cache (its runner's): the first forward of a step feeds the tokens the cache lacks
(the pending token, and after plain steps a backlog); the drafts fed after it form a small tree in the cache
(a chain's is a path) from which verification's accepted nodes are kept (`keep_paths`) and the rest dropped.
After a fully accepted chain the last draft was never fed: the next step's first forward catches up on it.
"""

from __future__ import annotations

import math
import time

import torch

from ..model.fast import make_runner
from ..sampling.tree import chain_parents
from .base import BatchView, Draft, Proposer
from .tree import TreeSpec, grow_tree

__all__ = ["DraftModelProposer"]


class DraftModelProposer(Proposer):
    name = "draft-model"

    def __init__(
        self,
        model,
        vocab_size: int,
        stop_below: float | None = 0.3,
        *,
        tree: TreeSpec | None = None,
        runner: str = "auto",
        quant: str | None = None,
        vocab=None,
    ):
        """stop_below: a chain row stops drafting once a draft token's probability under the draft's own
        (temperature-1) distribution is below stop_below (the draft is unsure, so later drafts would
        likely be rejected). Any such stopping rule that looks only at the draft's own tokens and
        distributions keeps verification exact. None drafts the full gamma. Trees ignore it (their shape is fixed).
        tree: draft token trees of this shape instead of chains.
        runner / quant: see `verispec.model.fast.make_runner` (quant: weight-only int8 / int4 draft weights); runner
        may also be a factory (model, vocab_size) -> runner (a hidden-state head's, `verispec.heads.head_runner`).
        vocab: (VocabMap, V_t) for a draft with another tokenizer (`verispec.crossvocab`): its runner then takes and
        returns the target's ids and vocabulary; vocab_size is the draft's own."""
        if stop_below is not None and not 0.0 <= stop_below <= 1.0:
            raise ValueError(f"stop_below must be in [0, 1] or None, got {stop_below}")
        if tree is not None and not isinstance(tree, TreeSpec):
            raise ValueError(f"tree must be a TreeSpec or None, got {tree!r}")
        self.model = model
        self._runner_args = (vocab_size, runner, quant)
        self.vocab = vocab
        self.runner = self._make_runner()
        self.stop_below = None if tree is not None else stop_below
        self.tree = tree
        self.quant = quant
        self._start: list[int] = []  # per row: the draft cache's length where this step's fed drafts begin
        self._fed: list[dict[int, int]] = []  # per row: draft node -> its index among the fed drafts

    def start(self, view: BatchView, capacity: int) -> None:
        self.runner.fill([s[:-1] for s in view.seqs], capacity)  # invariant: the cache holds all but the pending token

    def add(self, view: BatchView, capacity: int) -> None:
        self.runner.add_rows([s[:-1] for s in view.seqs], capacity)

    def propose(self, view: BatchView, caps: list[int]) -> Draft:
        if self.tree is not None:
            draft, self._start, self._fed = grow_tree(self.runner, self.tree, view, caps)
            return draft
        self._start, self._fed = list(self.runner.lengths), [{} for _ in caps]
        limit = getattr(self.runner, "max_draft", None)  # Medusa: as many drafts as heads
        caps = list(caps) if limit is None else [min(c, limit) for c in caps]
        if max(caps, default=0) == 0:
            return Draft.empty(len(view.seqs), view.device)
        return self._chain(view, caps)

    def _chain(self, view: BatchView, gammas: list[int]) -> Draft:
        """Sample up to gammas[b] tokens per row, one draft forward per position."""
        B, k, dev = len(view.seqs), max(gammas), view.device
        ids = torch.full((B, k), -1, dtype=torch.int64, device=dev)
        probs = None  # [B, k + 1, V] once V is known
        feed = [s[n:] if g > 0 else [] for s, n, g in zip(view.seqs, self.runner.lengths, gammas)]
        for j in range(k):
            logits = self.runner.forward(feed, logits_at="last")  # [B, V]
            if j == 0:
                self._start = list(self.runner.lengths)
            ctx = view.node_context(ids[:, :j], chain_parents(B, j, dev)).at(j)  # the context after draft j - 1
            active_rows = torch.tensor([g > j for g in gammas], device=dev)  # [B]: rows drafting at j (others: junk)
            q = view.probs(logits, *ctx, valid=active_rows)  # [B, V]: penalties, bad words, grammar see drafts before j
            if probs is None:
                probs = torch.zeros((B, k + 1, q.shape[-1]), dtype=q.dtype, device=dev)
            probs[:, j] = q
            active = [g > j for g in gammas]
            tok = view.randomness.draw(q, view, j, active)  # [B]: the engine's randomness (engine.randomness)
            ids[:, j] = torch.where(torch.tensor(active, device=dev), tok, -1)
            if self.stop_below is not None:
                # confidence from the draft's own unprocessed distribution (a greedy q is always one-hot), within what
                # the grammar allows there (a structured output's mask: else a forced token looks unsure); drafts the
                # target is not fed (the randomness's lookahead) follow the last one kept
                own_logits = logits if ctx.allowed is None else logits.masked_fill(~ctx.allowed, float("-inf"))
                own = own_logits.gather(1, tok.unsqueeze(1)).squeeze(1) - own_logits.logsumexp(-1)  # [B]: at tok
                unsure = (own < (math.log(self.stop_below) if self.stop_below > 0 else -math.inf)).tolist()
                last = j + 1 + view.randomness.lookahead
                gammas = [min(last, g) if (a and low) else g for g, a, low in zip(gammas, active, unsure)]
            if max(gammas) <= j + 1:
                break
            feed = [[t] if g > j + 1 else [] for t, g in zip(tok.tolist(), gammas)]
            for b, g in enumerate(gammas):
                if g > j + 1:
                    self._fed[b][j] = j  # draft j is in the cache now (node j, fed index j)
        k_used = max(gammas)
        return Draft.chain_of(ids[:, :k_used], probs[:, : k_used + 1], gammas)

    def update(self, view: BatchView, old_lengths: list[int], draft: Draft, paths: list[list[int]]) -> None:
        """Keep the accepted nodes the draft has computed (a chain: its accepted drafts but the last one fed)."""
        keep = []
        for fed, path in zip(self._fed, paths):
            kept = []
            for n in path:
                if n not in fed:
                    break
                kept.append(fed[n])
            keep.append(kept)
        self.runner.keep_paths(self._start, keep)

    def select(self, rows: list[int]) -> None:
        self.runner.select(rows)

    def weights_changed(self, model) -> float:
        """A dense runner reads the model's own (updated) parameters; a quantized one is re-quantized from them."""
        if model is not self.model or self.quant is None:
            return 0.0
        t0 = time.perf_counter()
        self.runner = self._make_runner()
        return time.perf_counter() - t0

    def _make_runner(self):
        vocab_size, runner, quant = self._runner_args
        if callable(runner):  # a runner factory (a hidden-state head's, `verispec.heads`)
            return runner(self.model, vocab_size)
        inner = make_runner(self.model, vocab_size, runner=runner, quant=quant)
        if self.vocab is None:
            return inner
        from ..crossvocab.runner import BridgedRunner

        return BridgedRunner(inner, *self.vocab)
