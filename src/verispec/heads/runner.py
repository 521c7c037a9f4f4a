"""Runners for hidden-state heads (`verispec.model.protocol`, in the target's ids and vocabulary), so
`DraftModelProposer` drafts chains and EAGLE-2 trees with a head as with a draft model.

`PairRunner` (EAGLE-3, EAGLE-1/2, MTP): cache slot j holds the pair (h_{j-1}, x_j) (slot 0 has no hidden state and
is hidden from every query); h_{j-1} is the target's where the target holds token j - 1 (`HFRunner.capture_hidden`),
else the head's own output at the parent slot (RoPE is relative: positions j for the papers' j - 1). After
verification every drafted slot is dropped: the next step feeds the accepted tokens again with the target's hidden
states, as EAGLE does. `MedusaRunner`: no cache; a slot d positions after the target's last token gets head d on that
token's hidden state (uniform past the last head, or where the target holds no token yet).

Both return float32 logits over the target's vocabulary, every id outside the head's `FLOOR` below the row's lowest
(probability 0). Exact whatever the head is: the draft is drawn from exactly this q.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import Tensor

from ..crossvocab.vocab import FLOOR
from ..model.cache import RowKVCache
from ..model.runner import HFRunner, check_forward_args
from .modules import MedusaHeads, PairHead

__all__ = ["MedusaRunner", "PairRunner", "scatter_logits"]


def scatter_logits(logits: Tensor, target_ids: Tensor | None, vocab: int) -> Tensor:
    """Draft-vocabulary logits [..., V_d] -> target-vocabulary logits [..., vocab] (float32): logits[..., i] at id
    target_ids[i] (None: the ids are the target's already, sliced to vocab), FLOOR below the row's lowest elsewhere."""
    logits = logits.float()
    if target_ids is None:
        return logits[..., :vocab]
    if bool(torch.isnan(logits).any()):
        raise ValueError("the head's logits are NaN (its weights or the target's hidden states are not finite)")
    floor = logits.amin(-1, keepdim=True).nan_to_num(neginf=-1e30) - FLOOR  # [..., 1]
    out = floor.expand(*logits.shape[:-1], vocab).clone()
    out[..., target_ids] = logits
    return out


class _Features:
    """Where a head's hidden inputs come from: the target runner's hidden states at `layers` (captured from now on)."""

    def __init__(self, target: HFRunner, layers: tuple[int, ...]):
        if not isinstance(target, HFRunner):
            raise ValueError(
                "a hidden-state head reads the target's hidden states: the target must run on the fast or the "
                f"transformers runner, not {type(target).__name__} (llama.cpp does not expose them)"
            )
        target.capture_hidden(layers)
        if target.cache is not None and not target.cache.extras:
            target.cache = None  # its cache was allocated without room for hidden states: the next fill makes one
        self.target = target
        self.rows: list[int] | None = None  # the target's row of each of the head's rows, where not the same

    def lengths(self, batch: int) -> list[int]:
        """Tokens the target holds per row (0 for every row when its cache is not this batch's)."""
        cache = self.target.cache
        if cache is None or not cache.extras:
            return [0] * batch
        if self.rows is not None:
            return [cache.lengths[r] for r in self.rows]
        return cache.lengths if cache.batch_size == batch else [0] * batch

    def read(self, rows: Tensor, slots: Tensor) -> Tensor:
        """Captured hidden states at (rows[i], slots[i]) -> [n, F]."""
        if self.rows is not None:
            rows = torch.tensor(self.rows, device=rows.device)[rows]
        return self.target.cache.extras[0][rows, slots]


class PairRunner(HFRunner):
    """A pair head (`PairHead`) as a runner; target: the target's runner (HFRunner or FastRunner) whose cache holds
    the hidden states the head reads (this constructor asks it to capture them)."""

    def __init__(self, head: PairHead, target: HFRunner, vocab_size: int):
        self.features = _Features(target, head.layers_read)
        self.head = head
        self.config = SimpleNamespace(sliding_window=None, layer_types=None)
        self.num_layers, (self.num_kv_heads, self.head_dim) = head.num_layers, head.kv_shape
        self.max_positions, self.vocab_size, self.hidden_size = None, vocab_size, head.hidden_size
        p = next(head.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.cache: RowKVCache | None = None
        self.tokens_computed, self.capture, self._softcap = 0, (), None
        self._ids = None if head.kind != "eagle3" else (torch.arange(len(head.d2t), device=self.device) + head.d2t)
        self._chunk: Tensor | None = None  # [B, T, H]: the running forward's hidden inputs

    def start(self, batch: int, capacity: int) -> None:
        dims = (self.num_kv_heads, self.head_dim, capacity, self.dtype, self.device, (self.hidden_size,))
        self.cache = RowKVCache(self.num_layers, batch, *dims)

    def add_rows(self, seqs, capacity: int) -> None:
        old = self.cache
        self.fill(seqs, capacity, old.batch_size if old is not None else 0)  # the new rows: a cache of their own
        if old is not None and old.batch_size:
            old.extend(self.cache)
            self.cache = old

    def fill(self, seqs, capacity: int, offset: int = 0) -> None:
        """HFRunner.fill, reading the target's rows offset + b: it prefills each distinct sequence once (in the
        order of first occurrence), and new rows (`add_rows`) come after the target's old ones."""
        first: dict[tuple[int, ...], int] = {}
        for b, s in enumerate(seqs):
            first.setdefault(tuple(s), offset + b)
        self.features.rows = list(first.values())
        try:
            HFRunner.fill(self, seqs, capacity)
        finally:
            self.features.rows = None

    def _run(self, tokens, parents=None, tree_start=None):
        self._chunk = self._inputs(tokens, parents, tree_start)
        try:
            return super()._run(tokens, parents, tree_start)
        finally:
            self._chunk = None

    def _inputs(self, tokens, parents, tree_start) -> Tensor:
        """The chunk's hidden inputs [B, T, H]: per new token at slot j, the target's hidden state at j - 1 where the
        target holds it, else the head's output at the parent slot."""
        lengths, dev = self.cache.lengths, self.device
        held = self.features.lengths(len(tokens))
        T = max((len(t) for t in tokens), default=0)
        hidden = torch.zeros((len(tokens), T, self.hidden_size), dtype=self.dtype, device=dev)
        target, own = [], []  # (row, chunk position, slot read)
        for b, row in enumerate(tokens):
            start = lengths[b] if tree_start is None else int(tree_start[b])
            for i in range(len(row)):
                j = lengths[b] + i  # this token's slot
                if parents is None:
                    prev = j - 1
                else:  # the parent node's slot (the row's tree starts at slot `start`)
                    p = int(parents[b][j - start])
                    prev = start - 1 if p < 0 else start + p
                if j == 0:  # x_0: no hidden state before it (its slot is hidden from every other query)
                    continue
                if prev >= max(held[b], lengths[b]):
                    raise ValueError(
                        f"row {b}: token {i} reads the head's output at slot {prev}, computed in this same forward: "
                        "feed drafted tokens after their parents' forward (a tree level by level)"
                    )
                (own if prev >= held[b] else target).append((b, i, prev))
        if target:
            rows, pos, slots = map(list, zip(*target))
            f = self.features.read(torch.tensor(rows, device=dev), torch.tensor(slots, device=dev))
            hidden[rows, pos] = self.head.project(f.to(self.dtype))
        if own:
            rows, pos, slots = map(list, zip(*own))
            hidden[rows, pos] = self.cache.extras[0][torch.tensor(rows, device=dev), torch.tensor(slots, device=dev)]
        return hidden

    def _body(self, ids: Tensor, masks, position_ids: Tensor) -> Tensor:
        cache = self.cache

        def attend(i: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            keys, values = cache.update(k, v, i)
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=masks, enable_gqa=q.shape[1] != k.shape[1])

        logits, out = self.head.step(ids, self._chunk, position_ids, attend)
        cache.write_extra(0, out)
        return logits

    def _masks(self, causal: Tensor, distance: Tensor):
        causal = causal.clone()
        causal[:, :, 0] &= distance[:, :, 0] == 0  # slot 0 (x_0) holds no pair: only its own query sees it
        return self._additive(causal)

    def _logits(self, hidden: Tensor) -> Tensor:  # `_body` returned the head's logits already
        return scatter_logits(hidden, self._ids, self.vocab_size)

    def keep_paths(self, old_lengths: list[int], paths: Sequence[Sequence[int]]) -> None:
        """Verification is over: drop every drafted slot (the accepted tokens are fed again with the target's hidden
        states at the next step)."""
        self.cache.truncate([min(n, m) for n, m in zip(old_lengths, self.cache.lengths)])


class MedusaRunner:
    """Medusa heads as a runner (see the module docstring); target: the target's runner."""

    def __init__(self, heads: MedusaHeads, target: HFRunner, vocab_size: int):
        self.features = _Features(target, heads.layers_read)
        self.heads, self.vocab_size, self.max_positions, self.max_draft = heads, vocab_size, None, heads.num_heads
        p = next(heads.parameters())
        self.device, self.dtype = p.device, p.dtype
        self._lengths: list[int] = []
        self.tokens_computed = 0

    @property
    def lengths(self) -> list[int]:
        return list(self._lengths)

    def start(self, batch: int, capacity: int) -> None:
        self._lengths = [0] * batch

    def fill(self, seqs, capacity: int) -> None:
        self._lengths = [len(s) for s in seqs]

    def add_rows(self, seqs, capacity: int) -> None:
        self._lengths += [len(s) for s in seqs]

    def prefill(self, tokens, chunk: int = 512) -> None:
        self._lengths = [n + len(t) for n, t in zip(self._lengths, tokens)]

    def reserve(self, capacity: int) -> None:
        pass

    def truncate(self, lengths: list[int]) -> None:
        self._lengths = list(lengths)

    def select(self, rows: list[int]) -> None:
        self._lengths = [self._lengths[r] for r in rows]

    def keep_paths(self, old_lengths: list[int], paths) -> None:
        self._lengths = list(old_lengths)

    @torch.inference_mode()
    def forward(self, tokens, logits_at: str = "all", parents=None, tree_start=None) -> Tensor:
        """Slot j's logits: head d on the hidden state of the target's last token, d = j's depth below the pending
        token (past the last head: uniform)."""
        check_forward_args(logits_at, parents, tree_start)
        B = len(self._lengths)
        if len(tokens) != B:
            raise ValueError(f"got {len(tokens)} token lists for a batch of {B}")
        held = self.features.lengths(B)
        T = max((len(t) for t in tokens), default=0)
        if T == 0:
            raise ValueError("forward needs at least one new token in some row")
        depth = torch.zeros((B, T), dtype=torch.int64)  # [B, T]: slots past the pending token (head index)
        for b, row in enumerate(tokens):
            start = self._lengths[b] if tree_start is None else int(tree_start[b])
            for i in range(len(row)):
                pos = self._lengths[b] + i
                if parents is not None:  # a tree node sits at its tree start plus its depth - 1
                    d, p = 1, int(parents[b][self._lengths[b] - start + i])
                    while p >= 0:
                        d, p = d + 1, int(parents[b][p])
                    pos = start + d - 1
                depth[b, i] = pos - held[b] if held[b] > 0 else -1  # (no hidden state yet: uniform)
        H = self.heads.lm_heads[0].in_features
        base = torch.zeros((B, H), dtype=self.dtype, device=self.device)  # [B, H]: the target's last hidden state
        rows = [b for b in range(B) if held[b] > 0]
        if rows:
            r = torch.tensor(rows, device=self.device)
            last = torch.tensor([held[b] - 1 for b in rows], device=self.device)
            base[r] = self.features.read(r, last).to(self.dtype)
        logits = torch.zeros((B, T, self.vocab_size), dtype=torch.float32, device=self.device)
        for d in range(self.max_draft):
            at = (depth == d).nonzero().tolist()
            if at:
                out = self.heads.head(d, base[[b for b, _ in at]]).float()[..., : self.vocab_size]
                logits[[b for b, _ in at], [i for _, i in at]] = out
        self._lengths = [n + len(t) for n, t in zip(self._lengths, tokens)]
        self.tokens_computed += sum(len(t) for t in tokens)
        if logits_at == "last":
            last = torch.tensor([max(len(t) - 1, 0) for t in tokens])
            return logits[torch.arange(B), last]
        return logits
