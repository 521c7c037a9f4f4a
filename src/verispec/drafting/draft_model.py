"""Draft-model drafting: a smaller model samples with the request's own SamplingParams, through the same
`probs_from_logits` as the target, so q is exactly what it sampled from: a chain of up to gamma tokens, or a tree
(`verispec.drafting.tree`). Its KV cache keeps the accepted drafts it was fed (`keep_paths`); a fully accepted chain's
last draft is fed at the next step.

A draft context window (`draft_context`, W): a row joins the draft's cache with only W of the tokens before its
pending token (`draft_window`): the first min(DRAFT_HEAD, W // 4) (a chat template's system prompt and the
instruction a long document follows: without them acceptance fell further, docs/guides/generating.md) and the last
ones, so the draft's prefill of a long prompt costs at most W tokens. Its offset (the middle tokens skipped) maps the
row's sequence to the cache's slots past the head. The window bounds the prompt's prefill only: generated tokens
append to it, and it is not slid once it fills up. Any context is exact: q is what the draft sampled from, whatever
it read.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from itertools import takewhile

import torch

from ..model.fast import make_runner
from ..model.protocol import Runner
from ..sampling.tree import chain_parents
from .base import ANY_DEPTH, BatchView, Draft, Proposer, Signal
from .tree import TreeSpec, grow_tree

__all__ = ["DRAFT_HEAD", "DraftModelProposer", "check_draft_context", "draft_window"]

DRAFT_HEAD = 64  # a window's first tokens kept from the start of the prompt (at most a quarter of the window)


def check_draft_context(draft_context: int | None) -> int | None:
    """draft_context, checked: an integer >= 1 or None (the whole context)."""
    ok = draft_context is None or (
        isinstance(draft_context, int) and not isinstance(draft_context, bool) and draft_context >= 1
    )
    if not ok:
        raise ValueError(f"draft_context must be an integer >= 1 or None, got {draft_context!r}")
    return draft_context


def draft_window(seqs, draft_context: int | None) -> tuple[list[list[int]], list[int]]:
    """What a draft's cache holds of each row on joining: all but its pending (last) token, or only draft_context of
    them, its first head = min(DRAFT_HEAD, draft_context // 4) and its last; and each row's offset, the tokens
    skipped between them (a sequence's token i >= head + offset is cache slot i - offset)."""
    cached = [list(s[:-1]) for s in seqs]
    if draft_context is None:
        return cached, [0] * len(cached)
    head = min(DRAFT_HEAD, draft_context // 4)
    offsets = [max(0, len(c) - draft_context) for c in cached]
    return [c[:head] + c[head + o :] for c, o in zip(cached, offsets)], offsets


class DraftModelProposer(Proposer):
    name = "draft-model"
    cost_prior = 0.3  # a draft forward before one is timed, as a share of a target step (engine.adaptive)

    def __init__(
        self,
        model,
        vocab_size: int,
        stop_below: float | None = 0.3,
        *,
        tree: TreeSpec | None = None,
        runner: Callable[[object, int], Runner] = make_runner,
        draft_context: int | None = None,
    ):
        """stop_below: a chain row stops once a draft token's probability under the draft's own (temperature-1)
        distribution is below it (exact: the rule looks only at the draft's own tokens and distributions); None
        drafts the full gamma; trees ignore it. tree: draft trees of this shape instead of chains. runner: the
        factory (model, vocab_size) -> the draft's Runner (a quantized fast runner, a cross-vocabulary bridge, a
        hidden-state head's runner: `engine.drafters.build_proposer`). draft_context: the draft reads only this many
        tokens of a row's sequence when it joins, its first and its last (the module docstring); None: all of it (a
        hidden-state head reads the target's hidden states of the whole context: it takes None)."""
        if stop_below is not None and not 0.0 <= stop_below <= 1.0:
            raise ValueError(f"stop_below must be in [0, 1] or None, got {stop_below}")
        if tree is not None and not isinstance(tree, TreeSpec):
            raise ValueError(f"tree must be a TreeSpec or None, got {tree!r}")
        self.draft_context = check_draft_context(draft_context)
        self.model = model
        self._make_runner = lambda: runner(model, vocab_size)
        self.runner = self._make_runner()
        self.stop_below = None if tree is not None else stop_below
        self.tree = tree
        self._offset: list[int] = []  # per row: sequence tokens the draft's cache skips after its head (`draft_window`)
        self._start: list[int] = []  # per row: the draft cache's length where this step's fed drafts begin
        self._fed: list[dict[int, int]] = []  # per row: draft node -> its index among the fed drafts

    def start(self, view: BatchView, capacity: int) -> None:
        # invariant: the cache holds all but the pending token, less the `offset` tokens its window skips
        cached, self._offset = draft_window(view.seqs, self.draft_context)
        self.runner.fill(cached, capacity - min(self._offset, default=0))  # a row needs `capacity` less its offset

    def add(self, view: BatchView, capacity: int) -> None:
        cached, offsets = draft_window(view.seqs, self.draft_context)
        self.runner.add_rows(cached, capacity - min(offsets, default=0))
        self._offset = self._offset + offsets

    def signals(self, view: BatchView) -> list[tuple[Signal | None]]:
        """One bucket; as deep as asked, or as the runner drafts at most (Medusa: its heads)."""
        depth = getattr(self.runner, "max_draft", None) or ANY_DEPTH
        return [(Signal(None, depth),)] * len(view.seqs)

    def propose(self, view: BatchView, caps: list[int]) -> Draft:
        if self.tree is not None:
            draft, self._start, self._fed = grow_tree(self.runner, self.tree, view, caps, self._offset)
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
        feed = [s[o + n :] if g > 0 else [] for s, o, n, g in zip(view.seqs, self._offset, self.runner.lengths, gammas)]
        for j in range(k):
            logits = self.runner.forward(feed, logits_at="last")  # [B, V]
            if j == 0:
                self._start = list(self.runner.lengths)
            ctx = view.node_context(ids[:, :j], chain_parents(B, j, dev)).at(j)  # the context after draft j - 1
            active = [g > j for g in gammas]  # rows drafting at j (the others' q is junk)
            active_rows = torch.tensor(active, device=dev)  # [B]
            q = view.probs(logits, *ctx, valid=active_rows)  # [B, V]: penalties, bad words, grammar see drafts before j
            if probs is None:
                probs = torch.zeros((B, k + 1, q.shape[-1]), dtype=q.dtype, device=dev)
            probs[:, j] = q
            tok = view.randomness.draw(q, view, j, active)  # [B]: the engine's randomness (engine.randomness)
            ids[:, j] = torch.where(active_rows, tok, -1)
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
        keep = [[fed[n] for n in takewhile(fed.__contains__, path)] for fed, path in zip(self._fed, paths)]
        self.runner.keep_paths(self._start, keep)

    def select(self, rows: list[int]) -> None:
        self.runner.select(rows)
        self._offset = [self._offset[r] for r in rows]

    def release(self) -> None:
        release = getattr(self.runner, "release", None)  # a runner without a cache (Medusa's, llama.cpp's) has none
        if release is not None:
            release()

    def weights_changed(self, model) -> float:
        """A dense runner reads the model's own (updated) parameters; a quantized one is re-quantized from them."""
        if model is not self.model or getattr(self.runner, "quant", None) is None:
            return 0.0
        t0 = time.perf_counter()
        self.runner = self._make_runner()
        return time.perf_counter() - t0
