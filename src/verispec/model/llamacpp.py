"""The llama.cpp runner: a GGUF model run by llama.cpp's own kernels (llama-cpp-python's low-level API), behind
`HFRunner`'s interface. Verification is exact for llama.cpp's law, not the torch runners' fp32 one; how rows,
shared prompts, rollback and trees map onto its unified KV cache, and why no cell is freed during a batch (dropped
cells go to a *graveyard* sequence nothing reads; live rows are compacted between steps): docs/guides/llamacpp.md.

A row's committed tokens sit at positions 0..length-1 of its main sequence. In a token tree the first child of a
node continues its parent's sequence; a further child gets a new sequence tagged onto the parent's path (seq_cp of
the positions up to the parent, plus the seq id on ancestors computed in the same batch): llama.cpp masks a query by
its first sequence id and position, so a node sees the prefix and its ancestors only. `keep_paths` makes the
accepted path's sequence the row's main sequence. Logits come back in the batch's order (llama_get_logits).
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
from torch import Tensor

from .protocol import Chunk, Slots
from .runner import check_forward_args
from .threads import set_threads

__all__ = ["DECODE_CHUNK", "INSTALL_HINT", "LlamaCppModel", "LlamaCppRunner", "StagedPrompt", "llamacpp_available"]

INSTALL_HINT = (
    'the llama.cpp runner needs llama-cpp-python: pip install -e ".[llamacpp]" (it compiles llama.cpp, ~10 min on '
    "2 cores)"
)
_BATCH = 512  # tokens per llama_decode call in a prefill (n_batch = n_ubatch)
# Tokens per llama_decode call in `forward`: up to 3 give logits bit-identical to one-token decoding on llama.cpp's
# CPU kernels, 4 or more do not (docs/guides/llamacpp.md): the target law is one-token decoding's at every batch size.
DECODE_CHUNK = 3
# A llama_decode of >= 64 tokens runs other kernels than a smaller one (logits after a prefill differ by up to 1.4
# with the size of its last call; calls of 64-720 tokens agree). A staged prompt is fed in calls of >= _GEMM_MIN
# tokens inside unchunked prefill's _BATCH-token calls: the same kernels as unchunked prefill. (Large calls also
# depend on where the row's cells lie, so a prompt's cache equals unchunked prefill's where the cells coincide.)
_GEMM_MIN = 64


def llamacpp_available() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def _lib():
    try:
        import llama_cpp
    except ImportError:
        raise ImportError(INSTALL_HINT) from None
    if not getattr(_lib, "ready", False):
        llama_cpp.llama_backend_init()
        llama_cpp.llama_log_set(_QUIET, None)
        _lib.ready = True
    return llama_cpp


@ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)
def _QUIET(level, text, data):  # llama.cpp logs every load and context to stderr; errors surface as return codes
    return None


class LlamaCppModel:
    """A GGUF file loaded by llama.cpp (weights mmapped, in the file's own quantization). Stands where a torch
    model stands in `LoadedModel.model`; `make_runner` gives it a `LlamaCppRunner`."""

    def __init__(self, path: str | os.PathLike, *, threads: int | None = None, gpu_layers: int = 0):
        """threads: the CPU threads of its contexts (None: the process's count, `verispec.model.threads`)."""
        lib = _lib()
        self.path = Path(path)
        params = lib.llama_model_default_params()
        params.n_gpu_layers = gpu_layers
        self.ptr = lib.llama_model_load_from_file(str(self.path).encode(), params)
        if not self.ptr:
            raise ValueError(f"llama.cpp could not load {self.path} (not a GGUF model it supports?)")
        self._free = lib.llama_model_free
        if lib.llama_model_is_recurrent(self.ptr) or lib.llama_model_is_hybrid(self.ptr):
            raise ValueError(f"{self.path} is a recurrent model: its state cannot be rolled back to a position")
        self.vocab = lib.llama_model_get_vocab(self.ptr)
        self.n_vocab = lib.llama_vocab_n_tokens(self.vocab)
        self.n_ctx_train = lib.llama_model_n_ctx_train(self.ptr)
        self.threads = threads or set_threads()  # n_threads and n_threads_batch of its contexts
        eog = [t for t in (lib.llama_vocab_eos(self.vocab), lib.llama_vocab_eot(self.vocab)) if t >= 0]
        self.generation_config = SimpleNamespace(eos_token_id=sorted(set(eog)))
        self.device = torch.device("cpu")  # logits come back to the host: verification runs on the CPU

    def __del__(self):
        if getattr(self, "ptr", None):
            self._free(self.ptr)
            self.ptr = None

    def __repr__(self) -> str:
        return f"LlamaCppModel({str(self.path)!r}, n_vocab={self.n_vocab})"


@dataclass
class _Node:
    """A tree node in the cache, not yet committed: its sequence, position and parent slot."""

    seq: int
    pos: int
    parent: int  # slot index of its parent (the prefix's last slot for a root)


@dataclass
class _Row:
    seq: int  # the main sequence: slots 0..base-1 are its positions 0..base-1
    base: int = 0
    nodes: list[_Node] = field(default_factory=list)  # slots base, base+1, ... (a tree being grown or verified)
    claimed: set[int] = field(default_factory=set)  # slots whose sequence a child already continues

    @property
    def length(self) -> int:
        return self.base + len(self.nodes)

    def slot(self, i: int) -> tuple[int, int]:
        """(sequence, position) of slot i."""
        return (self.seq, i) if i < self.base else (self.nodes[i - self.base].seq, self.nodes[i - self.base].pos)

    def seqs(self) -> set[int]:
        return {self.seq} | {n.seq for n in self.nodes}


class LlamaCppRunner:
    """`HFRunner`'s interface on llama.cpp. vocab_size slices the logits to the shared vocabulary."""

    verify_slope = 0.75  # Q4 kernels on a few CPU cores are compute-bound: T(2) / T(1) ~ 1.75 (engine.costs)

    def __init__(self, model: LlamaCppModel, vocab_size: int | None = None, *, decode_chunk: int = DECODE_CHUNK):
        """decode_chunk: tokens per llama_decode call in `forward` (see DECODE_CHUNK; larger: llama.cpp's batched
        kernels, whose logits differ from one-token decoding, the law then depends on the batch)."""
        if not 1 <= decode_chunk <= _BATCH:
            raise ValueError(f"decode_chunk must lie in [1, {_BATCH}], got {decode_chunk}")
        self.decode_chunk = decode_chunk
        self.lib = _lib()
        self.model = model
        self.vocab_size = min(vocab_size or model.n_vocab, model.n_vocab)
        self.max_positions = model.n_ctx_train or None
        self.device = model.device
        self.dtype = torch.float32
        self.n_seq_max = int(self.lib.llama_max_parallel_sequences())
        self.tokens_computed = 0
        self.ctx, self.n_ctx = None, 0
        self.rows: list[_Row] = []
        self._staged: list[StagedPrompt] = []  # rows being prefilled outside the batch (`stage`), in order
        self._free_seqs: list[int] = []
        self.grave = self.n_seq_max - 1  # the graveyard sequence (see the module docstring)
        self.taken = 0  # cells used since the cache was last cleared or compacted (live or in the graveyard)
        self.compactions = 0
        self.cache = None  # the torch runners' attribute; nothing to free here beyond the context

    def _free_context(self) -> None:
        if getattr(self, "ctx", None):
            self.lib.llama_free(self.ctx)
            self.ctx = None

    __del__ = _free_context

    def _context(self, cells: int) -> None:
        """A fresh context with room for `cells` KV cells (all rows together)."""
        self._free_context()
        p = self.lib.llama_context_default_params()
        p.n_ctx = max(256, -(-cells // 256) * 256)
        p.n_batch = p.n_ubatch = _BATCH
        p.n_outputs_max = p.n_outputs_max_per_seq = _BATCH
        p.n_seq_max = self.n_seq_max
        p.kv_unified = True
        p.n_threads = p.n_threads_batch = self.model.threads
        self.ctx = self.lib.llama_init_from_model(self.model.ptr, p)
        if not self.ctx:
            raise RuntimeError(f"llama.cpp could not create a context of {p.n_ctx} cells")
        self.n_ctx = p.n_ctx
        self.mem = self.lib.llama_get_memory(self.ctx)

    def _share(self, row: _Row) -> _Row:
        """A new row on a new sequence tagged onto `row`'s committed cells (seq_cp: nothing is computed)."""
        copy = _Row(self._seq(), row.base)
        self.lib.llama_memory_seq_cp(self.mem, row.seq, copy.seq, -1, -1)
        return copy

    def _seq(self) -> int:
        if not self._free_seqs:
            raise RuntimeError(f"llama.cpp runner: all {self.n_seq_max} sequences in use (batch rows x tree branches)")
        return self._free_seqs.pop()

    def _drop(self, seq: int, start: int = -1) -> None:
        """Drop a sequence's positions >= start (all with start -1): its cells go to the graveyard."""
        self.lib.llama_memory_seq_cp(self.mem, seq, self.grave, start, -1)
        self.lib.llama_memory_seq_rm(self.mem, seq, start, -1)
        if start < 0:
            self._free_seqs.append(seq)

    def _make_room(self, n: int) -> None:
        """At the start of a forward or prefill of n tokens: compact when fresh cells run low (only when no tree is
        open: a tree's nodes sit in several sequences), so nothing moves in the middle of a call."""
        fresh = self.n_ctx - self.taken
        if (fresh < n or fresh < self.n_ctx // 4) and not any(r.nodes for r in self.rows):
            self._restore(self._save())
            self.compactions += 1
        if self.n_ctx - self.taken < n:
            raise RuntimeError(f"llama.cpp context of {self.n_ctx} cells is full ({self.taken} taken, {n} more needed)")

    def _live(self) -> list[_Row]:
        """The rows whose cells are kept: the batch's, then the staged ones'."""
        return self.rows + [st.row for st in self._staged]

    def _save(self) -> list:
        """Every live row's cells, copied out (llama_state_seq_get_data); rows must have no open tree."""
        lib, saved = self.lib, []
        for r in self._live():
            size = lib.llama_state_seq_get_size(self.ctx, r.seq)
            buf = (ctypes.c_ubyte * size)()
            if lib.llama_state_seq_get_data(self.ctx, buf, size, r.seq) != size:
                raise RuntimeError("llama.cpp could not copy out a row's KV cells")
            saved.append(buf)
        return saved

    def _restore(self, saved: list) -> None:
        """The cache cleared and the live rows' saved cells written back side by side, in position order."""
        self.lib.llama_memory_clear(self.mem, True)
        live = self._live()
        for r, buf in zip(live, saved):
            if r.base and self.lib.llama_state_seq_set_data(self.ctx, buf, len(buf), r.seq) == 0:
                raise RuntimeError("llama.cpp could not restore a row's KV cells")
        self.taken = sum(r.base for r in live)

    def _reset(self, cells: int, capacity: int) -> None:
        """No rows (staged ones dropped too), and room for `cells` KV cells; the context is made anew only when it is
        too small."""
        if self.ctx is None or self.n_ctx < cells:
            self._context(cells)
        else:
            self.lib.llama_memory_clear(self.mem, True)
        self.rows, self._staged, self._free_seqs = [], [], list(range(self.n_seq_max - 2, -1, -1))
        self.capacity, self.taken = capacity, 0

    def start(self, batch: int, capacity: int) -> None:
        self._reset(2 * batch * capacity, capacity)
        self.rows = [_Row(self._seq()) for _ in range(batch)]

    def fill(self, seqs: Chunk, capacity: int) -> None:
        """Rows with seqs[i] prefilled into row i; identical sequences are computed once and shared. Staged rows
        (`stage`) keep their cells: then only the batch's rows are replaced."""
        if self._staged:
            self.select([])
            return self.add_rows(seqs, capacity)
        self._reset(2 * len(seqs) * capacity, capacity)
        self._append_rows(seqs)

    def add_rows(self, seqs: Chunk, capacity: int) -> None:
        if self.ctx is None:
            return self.fill(seqs, capacity)
        self._grow(len(seqs), capacity)
        self._append_rows(seqs)

    def _grow(self, rows: int, capacity: int) -> None:
        """Room for `rows` more rows of `capacity` tokens (at least the current one), two cells per slot of every
        live row: a context too small is made anew (at least twice the size), the live rows' cells copied into it."""
        capacity = max(capacity, self.capacity)
        need = 2 * (len(self._live()) + rows) * capacity
        if need > self.n_ctx:
            if any(r.nodes for r in self.rows):
                raise RuntimeError("rows cannot join while a tree is uncommitted")
            saved = self._save()
            self._context(max(need, 2 * self.n_ctx))
            self._restore(saved)
        self.capacity = capacity

    def reserve(self, capacity: int) -> None:
        """Room for at least `capacity` tokens per row, the rows kept (`add_rows` with no new row)."""
        if capacity > self.capacity:
            self.add_rows([], capacity)

    def _append_rows(self, seqs: Chunk) -> None:
        """Rows for seqs after the existing ones: each distinct sequence is computed once, its copies share it."""
        if len(seqs) > len(self._free_seqs):
            raise RuntimeError(f"llama.cpp runner: at most {self.n_seq_max - 1} sequences (rows x tree branches)")
        keys = [tuple(row) for row in self._check_tokens(seqs, len(seqs))]
        first: dict[tuple[int, ...], int] = {}
        for i, key in enumerate(keys):
            first.setdefault(key, i)
        start = len(self.rows)
        new = [_Row(self._seq()) for _ in keys]
        self.rows.extend(new)
        self.prefill([[]] * start + [list(k) if first[k] == i else [] for i, k in enumerate(keys)])
        for i, key in enumerate(keys):
            if first[key] != i:  # tag the first copy's cells with this row's sequence: nothing is computed
                self.lib.llama_memory_seq_cp(self.mem, new[first[key]].seq, new[i].seq, -1, -1)
                new[i].base = len(key)

    # --- chunked prefill: a row's prompt computed outside the running batch, a chunk at a time --------------
    def stage(self, tokens: Sequence[int], capacity: int) -> StagedPrompt:
        """A row holding `tokens`, prefilled outside the batch by `StagedPrompt.feed` (a sequence of its own in the
        same context, not among `rows`: forwards do not see it), then appended to the batch by `join`."""
        tokens = self._check_tokens([tokens], 1)[0]
        if self.ctx is None:
            self._reset(2 * capacity, capacity)
        self._grow(1, capacity)
        staged = StagedPrompt(self, _Row(self._seq()), tokens, capacity)
        self._staged.append(staged)
        return staged

    def join(self, staged: StagedPrompt, copies: int = 1, replace: bool = False) -> None:
        """The staged row, complete, joins after the batch's rows as `copies` rows sharing its cells (seq_cp: no
        recompute). replace: they become the batch (the runner's rows are dropped)."""
        if staged not in self._staged or staged.remaining:
            raise ValueError("only a staged prompt of this runner, completely fed, can join its batch")
        if copies < 1:
            raise ValueError(f"copies must be >= 1, got {copies}")
        if replace:
            self.select([])
        if copies > len(self._free_seqs) + 1:
            raise RuntimeError(f"llama.cpp runner: at most {self.n_seq_max - 1} sequences (rows x tree branches)")
        self._grow(copies - 1, staged.capacity)
        self._staged.remove(staged)
        self.rows += [staged.row] + [self._share(staged.row) for _ in range(copies - 1)]

    @property
    def lengths(self) -> list[int]:
        return [r.length for r in self.rows]

    def truncate(self, lengths: list[int]) -> None:
        if len(lengths) != len(self.rows) or any(not 0 <= n <= r.base for n, r in zip(lengths, self.rows)):
            raise ValueError(f"truncate to {lengths} is not a rollback of the committed lengths {self.lengths}")
        for n, r in zip(lengths, self.rows):
            self._clear_tree(r)
            self._drop(r.seq, n)
            r.base = n

    def select(self, rows: list[int]) -> None:
        """Keep these rows, in this order (a row listed twice is shared, not recomputed)."""
        rows = [int(i) for i in rows]
        if any(not 0 <= i < len(self.rows) for i in rows):
            raise ValueError(f"select {rows}: rows must lie in [0, {len(self.rows)})")
        if len(rows) != len(set(rows)) and any(r.nodes for r in self.rows):
            raise ValueError("rows cannot be duplicated while a tree is uncommitted")
        for i, r in enumerate(self.rows):
            if i not in rows:
                for s in r.seqs():
                    self._drop(s)
        self.rows = [self._share(self.rows[i]) if i in rows[:j] else self.rows[i] for j, i in enumerate(rows)]

    def _clear_tree(self, r: _Row) -> None:
        for s in r.seqs() - {r.seq}:
            self._drop(s)
        if r.nodes:
            self._drop(r.seq, r.base)
        r.nodes, r.claimed = [], set()

    def keep_paths(self, old_lengths: list[int], paths: Chunk) -> None:
        if len(paths) != len(self.rows) or len(old_lengths) != len(self.rows):
            raise ValueError(f"keep_paths needs one path and one old length per row ({len(self.rows)})")
        for b, (start, path, r) in enumerate(zip(old_lengths, paths, self.rows)):
            slots = [start + int(i) for i in path]
            if not 0 <= start <= r.base or any(s >= r.length for s in slots):
                raise ValueError(f"row {b}: path {list(path)} after slot {start} is outside its {r.length} slots")
            for j, s in enumerate(slots):  # each kept node hangs off the previous one (the first: off the prefix)
                parent = r.nodes[s - r.base].parent if s >= r.base else s - 1
                if parent != (slots[j - 1] if j else start - 1):
                    raise ValueError(f"row {b}: path {list(path)} is not a root-to-node path of its last chunk")
            end = start + len(slots)
            # the last node's sequence holds the whole path (a node's sequence is tagged on all its ancestors); the
            # nodes need not sit in adjacent slots (a draft feeds its tree level by level)
            keep = r.slot(slots[-1])[0] if slots else r.seq
            for s in r.seqs() - {keep}:
                self._drop(s)
            self._drop(keep, end)
            r.seq, r.base, r.nodes, r.claimed = keep, end, [], set()

    def _plan_tree(self, b: int, parents: Sequence[int], n_old: int, n_new: int, start: int):
        """Sequences for row b's new tree nodes: [(seq ids (own first), position, parent slot)] per node.
        Copies a parent's path onto a new sequence where a node is not its parent's first child."""
        r = self.rows[b]
        plan: list[tuple[list[int], int, int]] = []
        first_new = start + n_old  # the slot of the first new node
        for j in range(n_new):
            node = n_old + j
            p = int(parents[node])
            ps = start + p if p >= 0 else start - 1
            if ps >= first_new:  # the parent is computed in this batch too
                pseq, ppos = plan[ps - first_new][0][0], plan[ps - first_new][1]
            elif ps >= 0:
                pseq, ppos = r.slot(ps)
            else:
                pseq, ppos = r.seq, -1
            if ps not in r.claimed:
                r.claimed.add(ps)
                seqs = [pseq]
            else:
                seqs = [self._seq()]
                a = ps
                while a >= first_new:  # ancestors in this batch carry the new sequence too
                    plan[a - first_new][0].append(seqs[0])
                    a = plan[a - first_new][2]
                top = r.slot(a)[1] if a >= 0 else -1  # the deepest ancestor already in the cache
                src = r.slot(a)[0] if a >= 0 else r.seq
                self.lib.llama_memory_seq_cp(self.mem, src, seqs[0], -1, top + 1)
            plan.append((seqs, ppos + 1, ps))
        return plan

    def _decode(self, items: list[tuple[int, list[int], int, bool]]) -> np.ndarray | None:
        """One llama_decode over items (token, seq ids, position, wants logits); the logits [n_out, V]."""
        lib = self.lib
        if self.n_ctx - self.taken < len(items):
            raise RuntimeError(f"llama.cpp context of {self.n_ctx} cells is full ({self.taken} taken)")
        width = max(len(s) for _, s, _, _ in items)
        batch = lib.llama_batch_init(len(items), 0, width)
        try:
            fields = (batch.token, batch.pos, batch.n_seq_id, batch.logits)
            token, pos, nseq, want = (np.ctypeslib.as_array(f, shape=(len(items),)) for f in fields)
            for i, (t, seqs, p, w) in enumerate(items):
                token[i], pos[i], nseq[i], want[i] = t, p, len(seqs), w
                for j, s in enumerate(seqs):
                    batch.seq_id[i][j] = s
            batch.n_tokens = len(items)
            rc = lib.llama_decode(self.ctx, batch)
        finally:
            lib.llama_batch_free(batch)
        if rc != 0:
            raise RuntimeError(
                f"llama_decode failed (code {rc}) on {len(items)} tokens: "
                + ("no room in the KV cache" if rc == 1 else "invalid batch or internal error")
            )
        self.tokens_computed += len(items)
        self.taken += len(items)
        n_out = sum(1 for *_, w in items if w)
        if not n_out:
            return None
        return np.ctypeslib.as_array(lib.llama_get_logits(self.ctx), shape=(n_out, self.model.n_vocab))

    def _check_tokens(self, tokens: Chunk, rows: int | None = None) -> list[list[int]]:
        rows = len(self.rows) if rows is None else rows
        if len(tokens) != rows:
            raise ValueError(f"got {len(tokens)} token lists for a batch of {rows}")
        out = [[int(t) for t in row] for row in tokens]
        if any(not 0 <= t < self.model.n_vocab for row in out for t in row):
            raise ValueError(f"token ids must lie in [0, {self.model.n_vocab})")
        return out

    @torch.inference_mode()
    def forward(
        self, tokens: Chunk, logits_at: str = "all", parents: Chunk | None = None, tree_start: Slots | None = None
    ) -> Tensor:
        """Append tokens[b] to row b; float32 logits [B, T, V] ("all") or [B, V] ("last"). parents / tree_start:
        as `HFRunner.forward` (a token tree per row, grown over one or several forwards)."""
        check_forward_args(logits_at, parents, tree_start)
        tokens = self._check_tokens(tokens)
        n_new = [len(t) for t in tokens]
        T = max(n_new, default=0)
        if T == 0:
            raise ValueError("forward needs at least one new token in some row")
        if any(r.length + n > self.capacity for r, n in zip(self.rows, n_new)):
            raise RuntimeError(f"KV cache capacity {self.capacity} exceeded ({max(self.lengths) + T} slots needed)")
        starts = None if parents is None else self._tree_starts(n_new, parents, tree_start)
        self._make_room(sum(n_new))
        items, where = self._items(tokens, logits_at, parents, starts)
        B, V = len(self.rows), self.vocab_size
        out = torch.zeros((B, V) if logits_at == "last" else (B, T, V), dtype=torch.float32)
        done = 0
        for s in range(0, len(items), self.decode_chunk):  # tree nodes in order: tags and copies are planned
            logits = self._decode(items[s : s + self.decode_chunk])
            if logits is not None:  # the next outputs in `where`'s order
                at = [w[done : done + len(logits)] for w in where[: 1 if logits_at == "last" else 2]]
                out[tuple(at)] = torch.from_numpy(logits[:, :V])
                done += len(logits)
        if parents is None:  # a chain commits its tokens; tree nodes wait for keep_paths
            for r, n in zip(self.rows, n_new):
                r.base += n
        return out

    def _tree_starts(self, n_new: list[int], parents, tree_start) -> list[int]:
        """Check a tree forward's parents (before anything changes) and return each row's tree start slot."""
        B = len(self.rows)
        if len(parents) != B or (tree_start is not None and len(tree_start) != B):
            raise ValueError(f"a tree forward needs one parent list (and one tree start) per row ({B})")
        if sum(n_new) > _BATCH:
            raise ValueError(f"a tree forward takes at most {_BATCH} nodes over all rows, got {sum(n_new)}")
        starts = []
        for b, r in enumerate(self.rows):
            start = r.length if tree_start is None else int(tree_start[b])
            n_old = r.length - start
            if not r.base <= start <= r.length:
                raise ValueError(f"tree_start {start} of row {b} must lie in [{r.base}, {r.length}]")
            if len(parents[b]) != n_old + n_new[b]:
                raise ValueError(f"row {b}: {len(parents[b])} parents for {n_old} old and {n_new[b]} new tree nodes")
            for node in range(n_old, n_old + n_new[b]):
                if not -1 <= int(parents[b][node]) < node:
                    raise ValueError(f"row {b}: parent of node {node} must be -1 or an earlier node")
            starts.append(start)
        return starts

    def _items(self, tokens, logits_at, parents, starts):
        """The decode items of a forward and, for its outputs in order, their (rows, positions)."""
        items: list[tuple[int, list[int], int, bool]] = []
        rows_out: list[int] = []
        pos_out: list[int] = []
        for b, (row, r) in enumerate(zip(tokens, self.rows)):
            if parents is None and r.nodes:
                raise ValueError(f"row {b} holds an uncommitted tree: keep_paths before a chain forward")
            if parents is None:
                plan = [([r.seq], r.base + i, None) for i in range(len(row))]
            else:
                plan = self._plan_tree(b, parents[b], r.length - starts[b], len(row), starts[b])
            for i, (t, (seqs, pos, parent)) in enumerate(zip(row, plan)):
                want = logits_at == "all" or i == len(row) - 1
                items.append((t, seqs, pos, want))
                if parents is not None:
                    r.nodes.append(_Node(seqs[0], pos, parent))
                if want:
                    rows_out.append(b)
                    pos_out.append(i)
        return items, (torch.tensor(rows_out, dtype=torch.int64), torch.tensor(pos_out, dtype=torch.int64))

    def prefill(self, tokens: Chunk, chunk: int = _BATCH) -> None:
        tokens = self._check_tokens(tokens)
        if any(r.nodes for r, t in zip(self.rows, tokens) if t):
            raise ValueError("prefill into a row with an uncommitted tree")
        items = [(t, [r.seq], r.base + i, False) for row, r in zip(tokens, self.rows) for i, t in enumerate(row)]
        self._make_room(len(items))
        for s in range(0, len(items), chunk):
            self._decode(items[s : s + chunk])
        for row, r in zip(tokens, self.rows):
            r.base += len(row)


@dataclass(eq=False)
class StagedPrompt:
    """One row's prompt being prefilled outside a `LlamaCppRunner`'s batch (`LlamaCppRunner.stage`)."""

    runner: LlamaCppRunner
    row: _Row  # its sequence; base: the prompt tokens computed so far
    tokens: list[int]
    capacity: int

    @property
    def remaining(self) -> int:
        """Prompt tokens still to compute."""
        return len(self.tokens) - self.row.base

    def feed(self, n: int) -> int:
        """Compute the next min(n, remaining) prompt tokens, up to _GEMM_MIN - 1 more: a call never leaves fewer than
        _GEMM_MIN tokens of one of unchunked prefill's calls for later (see _GEMM_MIN); returns how many."""
        runner, r, total = self.runner, self.row, len(self.tokens)
        if self not in runner._staged:
            raise ValueError("this staged prompt has joined the batch or been dropped")
        start = pos = r.base
        end = min(total, start + max(0, n))
        calls = []  # [(first, end)] token positions of each llama_decode
        while pos < end:
            window = min(total, (pos // _BATCH + 1) * _BATCH)  # the end of unchunked prefill's call holding pos
            stop = min(window, max(end, pos + _GEMM_MIN))
            calls.append((pos, window if window - stop < _GEMM_MIN else stop))
            pos = calls[-1][1]
        if calls:
            runner._make_room(pos - start)
        for a, b in calls:
            runner._decode([(self.tokens[i], [r.seq], i, False) for i in range(a, b)])
            r.base = b
        return r.base - start

    def close(self) -> None:
        """Give up the row (its request ended before it joined): its cells go to the graveyard, its sequence is free."""
        if self in self.runner._staged:
            self.runner._staged.remove(self)
            self.runner._drop(self.row.seq)
