"""A draft model with another tokenizer, seen through the target's vocabulary: `BridgedRunner` implements the runner
protocol (`verispec.model.protocol.Runner`) in target ids over a runner in draft ids, so the draft-model drafter
(chains and trees, `verispec.drafting.draft_model`) runs a cross-vocabulary draft unchanged.

Each target token is fed to the draft as the draft ids `VocabMap.spell` gives it: one id for a token of the
intersection, its bytes spelled by the draft's tokens otherwise (a special token as the draft's special of the same
content). The draft thus reads the target's text, token by token, with no re-tokenization and no rollback of its
own. Logits come back in the target's vocabulary (`VocabMap.target_logits`): -inf outside the intersection.

Row bookkeeping: `_ends[b][n]` is the draft length after the row's first n target tokens (so `_ends[b][0] == 0`
and the draft runner's row length is `_ends[b][-1]`); `_ids[b]` the draft ids in the row's cache. Tree nodes are
drafts, always of the intersection: one draft id each, so a tree's slots line up in both vocabularies. `_last[b]` is
the draft's logits after the row's last draft id where `_fresh[b]`; a chain that starts with a token spelled by no
draft id after the row changed (fill, truncate, keep_paths, prefill, add_rows) re-feeds that id first (`_refresh`).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate

import torch
from torch import Tensor

from ..model.protocol import Chunk, Slots
from .vocab import VocabMap

__all__ = ["BridgedRunner"]

TREE_SLACK = 128  # draft slots kept free past a chain forward (a tree's nodes are written without growing the cache)


class BridgedRunner:
    """A runner over draft ids (`inner`) that takes and returns target ids and target-vocabulary logits."""

    def __init__(self, inner, vocab: VocabMap, vocab_size: int):
        self.inner = inner
        self.map = vocab
        self.vocab_size = vocab_size  # the target's: logits come back [..., vocab_size]
        self._ends: list[list[int]] = []  # [B] rows of draft lengths per target length
        self._last: Tensor | None = None  # [B, V_d]: each row's draft logits after its last fed token
        self._ids: list[list[int]] = []  # [B] rows of the draft ids in the draft's cache
        self._fresh: list[bool] = []  # [B] whether _last[b] is the draft's logits after _ids[b][-1]

    @property
    def _standin(self) -> int:
        return int(torch.nonzero(self.map.d2t >= 0)[0, 0])

    @property
    def calibration_ids(self) -> Tensor | None:
        """Target ids of the intersection [S]: what timing a draft step feeds (`measure_cost_curve`), one draft id
        each, as drafts are (None: no intersection, time any ids)."""
        ids = torch.unique(self.map.d2t[self.map.d2t >= 0])
        return ids if ids.numel() else None

    def __getattr__(self, name):  # device, max_positions, tokens_computed, kernels, ...: the draft runner's
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    # --- rows -----------------------------------------------------------------------------------------
    def _spelled(
        self, seqs: Sequence[Sequence[int]], one_each: bool = False
    ) -> tuple[list[list[int]], list[list[int]]]:
        """Draft ids per row and each row's draft lengths per target length. one_each (tree nodes, whose slots must
        line up in both vocabularies): one draft id per token — its spelling's first, or a stand-in where it has
        none; a node outside the intersection (drawn only where the request allowed no token of it) then gives its
        children a stand-in context, which costs acceptance, not exactness."""
        ids, ends = [], []
        for s in seqs:
            parts = [self.map.spell(int(t)) for t in s]
            if one_each:
                parts = [p[:1] or [self._standin] for p in parts]
            ids.append([d for p in parts for d in p])
            ends.append([0, *accumulate(len(p) for p in parts)])
        return ids, ends

    def _capacity(self, seqs, ids, capacity: int) -> int:
        """Draft slots for target rows of `capacity` tokens: the prompts as spelled, then two draft ids per target
        token (grown by `_room` where a row needs more)."""
        return max((len(d) + 2 * (capacity - len(s)) + 16 for s, d in zip(seqs, ids)), default=capacity)

    def start(self, batch: int, capacity: int) -> None:
        self.inner.start(batch, 2 * capacity + 16)
        self._ends = [[0] for _ in range(batch)]
        self._last = None
        self._ids, self._fresh = [[] for _ in range(batch)], [False] * batch

    def fill(self, seqs: Sequence[Sequence[int]], capacity: int) -> None:
        ids, ends = self._spelled(seqs)
        self.inner.fill(ids, self._capacity(seqs, ids, capacity))
        self._ends, self._last = ends, None
        self._ids, self._fresh = [list(d) for d in ids], [False] * len(ids)

    def add_rows(self, seqs: Sequence[Sequence[int]], capacity: int) -> None:
        ids, ends = self._spelled(seqs)
        self.inner.add_rows(ids, self._capacity(seqs, ids, capacity))
        self._ends += ends
        self._last = None
        self._ids, self._fresh = self._ids + [list(d) for d in ids], [False] * (len(self._ids) + len(ids))

    @property
    def lengths(self) -> list[int]:
        return [len(e) - 1 for e in self._ends]

    def truncate(self, lengths: list[int]) -> None:
        self.inner.truncate([e[n] for e, n in zip(self._ends, lengths)])
        self._fresh = [f and e[n] == e[-1] for f, e, n in zip(self._fresh, self._ends, lengths)]
        self._ids = [i[: e[n]] for i, e, n in zip(self._ids, self._ends, lengths)]
        self._ends = [e[: n + 1] for e, n in zip(self._ends, lengths)]

    def select(self, rows: list[int]) -> None:
        self.inner.select(rows)
        self._ends = [list(self._ends[r]) for r in rows]  # copies: a row may be selected twice
        self._ids, self._fresh = [list(self._ids[r]) for r in rows], [self._fresh[r] for r in rows]
        if self._last is not None:
            self._last = self._last[torch.tensor(rows, device=self._last.device)]

    def room(self, extra: list[int], slack: int = 0) -> None:
        """Room in the draft's cache for a forward of extra[b] draft ids per row (as the cache counts: the longest
        row plus the widest chunk), plus `slack` (chains keep a tree's worth: the llama.cpp runner cannot grow while
        a tree is open)."""
        need = max((e[-1] for e in self._ends), default=0) + max(extra, default=0) + slack
        if need > self.inner.capacity:
            self.inner.reserve(max(need, 2 * self.inner.capacity))

    # --- forward --------------------------------------------------------------------------------------
    def forward(
        self, tokens: Chunk, logits_at: str = "all", parents: Chunk | None = None, tree_start: Slots | None = None
    ) -> Tensor:
        """The draft runner's forward on the spelled tokens; logits [B, T, V_t] ("all") or [B, V_t] ("last")."""
        return self.map.target_logits(self.draft_forward(tokens, logits_at, parents, tree_start), self.vocab_size)

    def draft_forward(
        self, tokens: Chunk, logits_at: str = "all", parents: Chunk | None = None, tree_start: Slots | None = None
    ) -> Tensor:
        """`forward` with the draft's own logits: [B, T, V_d] ("all") or [B, V_d] ("last")."""
        ids, ends = self._spelled(tokens, one_each=parents is not None)  # ends[b][i]: draft ids up to token i - 1
        if parents is not None:
            if tree_start is not None:
                tree_start = [e[s] for e, s in zip(self._ends, tree_start)]
        else:  # rows whose chain starts with a token spelled by nothing need the logits after their last draft id
            stale = [b for b, e in enumerate(ends) if len(e) > 1 and e[1] == 0 and not self._fresh[b] and self._ids[b]]
            if stale:
                self._refresh(stale)
        self.room([len(d) for d in ids], slack=0 if parents is not None else TREE_SLACK)
        if not any(ids):  # nothing the draft can read: its logits after what it read last
            v = self.map.d2t.numel()
            logits = self._last if self._last is not None else torch.zeros(len(ids), v, device=self.inner.device)
            self._extend(ends, ids)
            return logits.unsqueeze(1).expand(-1, max(len(t) for t in tokens), -1) if logits_at == "all" else logits
        if logits_at == "last" and parents is None and all(e[-1] > e[-2] for e in ends if len(e) > 1):
            return self._last_only(ids, ends)
        out = self.inner.forward(ids, logits_at="all", parents=parents, tree_start=tree_start)  # [B, T_d, V_d]
        self._extend(ends, ids)
        self._fresh = [f or bool(d) for f, d in zip(self._fresh, ids)]
        return self._at_tokens(out, ends, logits_at)

    def _last_only(self, ids: list[list[int]], ends: list[list[int]]) -> Tensor:
        """A chain forward whose rows' last target tokens all have draft ids: the draft's logits after them [B, V_d]
        (the output layer runs at one position per row, as the drafter's chains ask)."""
        out = self.inner.forward(ids, logits_at="last")  # [B, V_d]
        self._keep_last([bool(d) for d in ids], out, self._prior(out))
        self._extend(ends, ids)
        self._fresh = [f or bool(d) for f, d in zip(self._fresh, ids)]
        return self._last

    # --- the draft's own tokens (string-level exact match drafts in the draft's vocabulary) ------------------
    def own_forward(self, ids: Sequence[Sequence[int]]) -> Tensor:
        """Feed draft ids of the draft's own choosing after each row (room reserved by `room` beforehand); the
        draft's logits after them [B, V_d]. They are not the target's tokens: `forget_own` drops them."""
        return self.inner.forward(ids, logits_at="last")

    def forget_own(self) -> None:
        """Roll the draft's cache back to the target's tokens (what `own_forward` added leaves it)."""
        self.inner.truncate([e[-1] for e in self._ends])

    def _extend(self, ends: list[list[int]], ids: list[list[int]]) -> None:
        for e, add, i, d in zip(self._ends, ends, self._ids, ids):
            base = e[-1]
            e.extend([base + a for a in add[1:]])
            i.extend(d)

    def _refresh(self, rows: list[int]) -> None:
        """_last for these rows: their last draft id leaves the draft's cache and is fed again."""
        self.inner.truncate([len(i) - (b in rows) for b, i in enumerate(self._ids)])
        self.room([1])
        out = self.inner.forward([[i[-1]] if b in rows else [] for b, i in enumerate(self._ids)], logits_at="last")
        self._keep_last([b in rows for b in range(len(self._ids))], out, self._prior(torch.zeros_like(out)))
        self._fresh = [f or b in rows for b, f in enumerate(self._fresh)]

    def _at_tokens(self, out: Tensor, ends: list[list[int]], logits_at: str) -> Tensor:
        """Draft logits after each target token [B, T, V_d] (or after the last, [B, V_d]); a token spelled by no draft
        id repeats the logits before it (the row's last ones at the chunk's start)."""
        B, V = out.shape[0], out.shape[-1]
        last = self._prior(out[:, 0])  # [B, V_d]
        T = max(len(e) - 1 for e in ends)
        pos = torch.tensor([[e[min(i + 1, len(e) - 1)] - 1 for i in range(T)] for e in ends])  # [B, T]
        picked = out.gather(1, pos.clamp(min=0).to(out.device).unsqueeze(-1).expand(B, T, V))  # [B, T, V_d]
        picked = torch.where((pos < 0).to(out.device).unsqueeze(-1), last.unsqueeze(1), picked)
        fed = [len(e) - 1 for e in ends]
        final = picked[torch.arange(B), torch.tensor([max(n - 1, 0) for n in fed])]  # [B, V_d]
        self._keep_last([n > 0 for n in fed], final, last)
        return picked if logits_at == "all" else final

    def _prior(self, fallback: Tensor) -> Tensor:
        """Each row's draft logits after what it read last [B, V_d]; `fallback` where none of this batch's shape."""
        return self._last if self._last is not None and self._last.shape == fallback.shape else fallback

    def _keep_last(self, fed: list[bool], new: Tensor, old: Tensor) -> None:
        """_last: new[b] [V_d] for the rows fed, old[b] for the others."""
        self._last = torch.where(torch.tensor(fed, device=new.device).unsqueeze(-1), new, old)

    def keep_paths(self, old_lengths: list[int], paths: Sequence[Sequence[int]]) -> None:
        """Row b keeps the chunk nodes paths[b]: the draft slots each node's ids took."""
        starts, dpaths = [], []
        for b, (old, path) in enumerate(zip(old_lengths, paths)):
            e = self._ends[b]
            base = e[old]
            starts.append(base)
            dpaths.append([s for n in path for s in range(e[old + n] - base, e[old + n + 1] - base)])
            sizes = [e[old + n + 1] - e[old + n] for n in path]
            self._ends[b] = e[: old + 1] + [base + c for c in accumulate(sizes)]
            self._ids[b] = self._ids[b][:base] + [self._ids[b][base + s] for s in dpaths[b]]
        self._fresh = [False] * len(self._ids)
        self.inner.keep_paths(starts, dpaths)

    def prefill(self, tokens: Sequence[Sequence[int]], chunk: int = 512) -> None:
        ids, ends = self._spelled(tokens)
        self.room([len(d) for d in ids])
        self.inner.prefill(ids, chunk)
        self._extend(ends, ids)
        self._fresh = [f and not d for f, d in zip(self._fresh, ids)]
