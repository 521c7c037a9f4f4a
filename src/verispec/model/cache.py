"""A preallocated KV cache with one length per row: append writes at each row's own offset, rollback is
a length change.

It plugs into HF transformers models as their `cache` argument (a `transformers.Cache` whose `update`
writes the new keys / values at the rows' write offsets and returns the whole used prefix). Row b's valid
entries are always slots [0, lengths[b]); slots beyond hold stale or padding values that the runner's
attention mask hides and later writes overwrite. Nothing is ever copied to remove a rejected draft.
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers.cache_utils import Cache

__all__ = ["RowKVCache"]


class RowKVCache(Cache):
    """Per-layer key / value buffers [B, H_kv, capacity, D]; `lengths` (host ints) are the committed lengths.

    extras: widths F of per-slot row buffers [B, capacity, F] kept beside the keys and values (a target's hidden
    states for a hidden-state drafter, a head's own outputs): every rollback, reorder and join moves them with the
    slots, so what a drafter reads at slot i always belongs to the token at slot i."""

    def __init__(
        self,
        num_layers: int,
        batch: int,
        num_kv_heads: int,
        head_dim: int,
        capacity: int,
        dtype: torch.dtype,
        device: torch.device | str,
        extras: tuple[int, ...] = (),
    ):
        super().__init__(layers=[])
        shape = (batch, num_kv_heads, capacity, head_dim)
        self.keys: list[Tensor] = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values: list[Tensor] = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.extras: list[Tensor] = [torch.zeros((batch, capacity, f), dtype=dtype, device=device) for f in extras]
        self.capacity = capacity
        self.lengths: list[int] = [0] * batch  # committed tokens per row
        self._write_at: Tensor | None = None  # [B, T] int64 slot indices of the chunk being written
        self._uniform_start: int | None = None  # all rows write at the same offset: plain slice copy
        self._used = 0  # slots the current forward attends over

    @property
    def batch_size(self) -> int:
        return len(self.lengths)

    def begin_chunk(self, chunk_len: int) -> None:
        """Prepare a forward that writes `chunk_len` slots at every row's current length."""
        end = max(self.lengths) + chunk_len
        if end > self.capacity:
            raise RuntimeError(f"KV cache capacity {self.capacity} exceeded ({end} slots needed)")
        self._used = end
        if len(set(self.lengths)) == 1:
            self._uniform_start = self.lengths[0]
            self._write_at = None
        else:
            self._uniform_start = None
            dev = self.keys[0].device
            self._write_at = torch.tensor(self.lengths, device=dev)[:, None] + torch.arange(chunk_len, device=dev)

    def commit(self, new_tokens: list[int]) -> None:
        """After a forward: row b keeps the first new_tokens[b] slots of the chunk it just wrote."""
        self.lengths = [n + k for n, k in zip(self.lengths, new_tokens)]

    def truncate(self, lengths: list[int]) -> None:
        """Rollback: row b keeps its first lengths[b] tokens (no data moves)."""
        if len(lengths) != len(self.lengths) or any(not 0 <= n <= m for n, m in zip(lengths, self.lengths)):
            raise ValueError(f"truncate to {lengths} is not a rollback of {self.lengths}")
        self.lengths = list(lengths)

    def keep_paths(self, old_lengths: list[int], paths) -> None:
        """Row b keeps chunk slots old_lengths[b] + paths[b][i], moved to old_lengths[b] + i (a tree's accepted
        path becomes the contiguous continuation of the prefix)."""
        if len(paths) != len(self.lengths) or len(old_lengths) != len(self.lengths):
            raise ValueError(f"keep_paths needs one path and one old length per row ({len(self.lengths)})")
        new_lengths = []
        for b, (start, path) in enumerate(zip(old_lengths, paths)):
            path = [int(i) for i in path]
            if any(i < 0 or start + i >= self.lengths[b] for i in path) or path != sorted(set(path)):
                raise ValueError(f"row {b}: path {path} is not a list of increasing nodes of its last chunk")
            if path and path != list(range(len(path))):
                src = torch.tensor([start + i for i in path], device=self.keys[0].device)
                for buf in (*self.keys, *self.values):
                    buf[b, :, start : start + len(path)] = buf[b, :, src]
                for buf in self.extras:
                    buf[b, start : start + len(path)] = buf[b, src]
            new_lengths.append(start + len(path))
        self.lengths = new_lengths

    def _each(self, kv, extra) -> None:
        """Replace every key and value buffer [B, H, L, D] t by kv(t), every extras buffer [B, L, F] by extra(t)."""
        self.keys, self.values = [kv(k) for k in self.keys], [kv(v) for v in self.values]
        self.extras = [extra(e) for e in self.extras]

    def reserve(self, capacity: int) -> None:
        """Room for at least `capacity` tokens per row (buffers reallocated only when they are smaller)."""
        if capacity > self.capacity:
            self._each(lambda t: _padded(t, 2, capacity), lambda t: _padded(t, 1, capacity))
            self.capacity = capacity

    def extend(self, other: RowKVCache) -> None:
        """Append other's rows after this cache's rows (continuous batching: requests join between steps).
        The capacity becomes the larger of the two; buffers are reallocated once per join."""
        cap = max(self.capacity, other.capacity)
        self.keys = [torch.cat([_padded(a, 2, cap), _padded(b, 2, cap)]) for a, b in zip(self.keys, other.keys)]
        self.values = [torch.cat([_padded(a, 2, cap), _padded(b, 2, cap)]) for a, b in zip(self.values, other.values)]
        self.extras = [torch.cat([_padded(a, 1, cap), _padded(b, 1, cap)]) for a, b in zip(self.extras, other.extras)]
        self.capacity = cap
        self.lengths = self.lengths + other.lengths

    def select(self, rows: list[int]) -> None:
        """Keep only these rows (finished requests leave the batch)."""
        idx = torch.tensor(rows, device=self.keys[0].device)
        self._each(lambda t: t.index_select(0, idx), lambda t: t.index_select(0, idx))
        self.lengths = [self.lengths[r] for r in rows]

    def write_extra(self, i: int, values: Tensor) -> None:
        """Write values [B, T, F] into extras[i] at the slots of the chunk being written (after `begin_chunk`)."""
        buf = self.extras[i]
        T = values.shape[1]
        if self._uniform_start is not None:
            s = self._uniform_start
            buf[:, s : s + T] = values
        else:
            B, _, F = values.shape
            buf.scatter_(1, self._write_at.view(B, T, 1).expand(B, T, F), values.to(buf.dtype))

    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args, **kwargs):
        kb, vb = self.keys[layer_idx], self.values[layer_idx]
        T = key_states.shape[-2]
        if self._uniform_start is not None:
            s = self._uniform_start
            kb[:, :, s : s + T] = key_states
            vb[:, :, s : s + T] = value_states
        else:
            B, H, _, D = key_states.shape
            idx = self._write_at.view(B, 1, T, 1).expand(B, H, T, D)
            kb.scatter_(2, idx, key_states.to(kb.dtype))
            vb.scatter_(2, idx, value_states.to(vb.dtype))
        return kb[:, :, : self._used], vb[:, :, : self._used]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return max(self.lengths) if self.lengths else 0

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self._used, 0

    def __len__(self) -> int:
        return len(self.keys)

    @property
    def is_compileable(self) -> bool:
        return False


def _padded(buf: Tensor, dim: int, capacity: int) -> Tensor:
    """buf with zero slots appended along `dim` up to `capacity` (buf itself when it has them)."""
    extra = capacity - buf.shape[dim]
    return buf if extra <= 0 else torch.cat([buf, buf.new_zeros((*buf.shape[:dim], extra, *buf.shape[dim + 1 :]))], dim)
