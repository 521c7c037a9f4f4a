"""Model runner: ragged chunks of tokens in, logits out, over a `RowKVCache` with rollback, for any transformers
decoder-only model whose attention takes a ready-made 4D mask and position ids (Llama, Qwen2, Mistral, ...).
Row b's query i sits at position lengths[b] + i and sees slots [0, lengths[b] + i]; padding (rows with fewer new
tokens) is written beyond the row's length, hidden from real queries and overwritten later: no compaction."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
from torch import Tensor

from ..sampling.tree import tree_ancestors
from .cache import RowKVCache
from .protocol import Chunk, Slots

__all__ = ["NORMED", "HFRunner", "StagedPrompt", "layer_inputs"]

NORMED = -1  # a capture id (`HFRunner.capture_hidden`): the final norm's output, what the output layer reads


@contextlib.contextmanager
def layer_inputs(decoder, ids: Sequence[int]):
    """While inside, a transformers decoder's forward records the input of layer i ([B, T, H]) in the yielded dict
    under i, for each i in ids (i == number of layers: the final norm's input); hooks removed on exit."""
    grabbed: dict[int, Tensor] = {}
    layers = decoder.layers

    def grab(i):
        def hook(module, args, kwargs):
            grabbed[i] = args[0] if args else kwargs["hidden_states"]

        return hook

    handles = [
        (layers[i] if i < len(layers) else decoder.norm).register_forward_pre_hook(grab(i), with_kwargs=True)
        for i in ids
        if 0 <= i <= len(layers)
    ]
    try:
        yield grabbed
    finally:
        for h in handles:
            h.remove()


def _tree_structure(parents: Chunk, n_new: list[int], T: int) -> tuple[Tensor, Tensor]:
    """Per-row parent lists -> depth [B, T] (0 for roots) and ancestor-or-self [B, T, T] (anc[b, i, j]: node j
    is node i or one of its ancestors). Padding nodes get depth 0 and see only themselves."""
    B = len(n_new)
    if len(parents) != B:
        raise ValueError(f"got {len(parents)} parent lists for a batch of {B}")
    par = torch.full((B, T), -1, dtype=torch.int64)  # [B, T]: padding nodes hang off the prefix
    for b, row in enumerate(parents):
        if len(row) != n_new[b]:
            raise ValueError(f"row {b}: {len(row)} parents for {n_new[b]} new tokens")
        par[b, : n_new[b]] = torch.as_tensor([int(p) for p in row], dtype=torch.int64)
    bad = (par < -1) | (par >= torch.arange(T))
    if bool(bad.any()):
        b, i = (int(x) for x in bad.nonzero()[0])
        raise ValueError(f"row {b}: parent of node {i} must be -1 or an earlier node, got {int(par[b, i])}")
    anc, depth = tree_ancestors(par)
    return depth - 1, anc


def check_forward_args(logits_at: str, parents, tree_start) -> None:
    """The checks every runner's `forward` makes on its options."""
    if logits_at not in ("all", "last"):
        raise ValueError(f"logits_at must be 'all' or 'last', got {logits_at!r}")
    if tree_start is not None and parents is None:
        raise ValueError("tree_start needs parents")


class HFRunner:
    """Runs one HF causal LM for a batch of rows. `vocab_size` slices the logits to the shared vocabulary."""

    # the prior cost of one more token per row in a pass, as a share of a one-token pass (`engine.costs`), until
    # measured: transformers' forward carries fixed per-call overhead, so extra tokens cost less than a step
    verify_slope = 0.5

    def __init__(self, model, vocab_size: int | None = None):
        self.model = model
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.config = cfg
        self.num_layers = cfg.num_hidden_layers
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.max_positions = getattr(cfg, "max_position_embeddings", None)
        self.vocab_size = vocab_size or model.get_output_embeddings().weight.shape[0]
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.cache: RowKVCache | None = None
        self.tokens_computed = 0  # token positions run through the model, over the runner's life
        self._base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
        self._head = model.get_output_embeddings()
        self._softcap = getattr(cfg, "final_logit_softcapping", None)
        self.capture: tuple[int, ...] = ()  # hidden states kept per token (`capture_hidden`)
        self.hidden_size = cfg.hidden_size
        self._grabbed: dict[int, Tensor] = {}  # capture id -> this forward's hidden states [B, T, H]

    # --- hidden states for drafters that read them (EAGLE, Medusa, MTP heads) -------------------------------
    def capture_hidden(self, layers: Sequence[int]) -> None:
        """From the next `start` / `fill` on, keep every token's hidden states at `layers` beside its keys and values
        (`cache.extras[0]`, [B, L, len(layers) * H]): id i < num_layers is layer i's input, num_layers the last
        layer's output, NORMED (-1) the final norm's. They come from the forwards that run anyway."""
        layers = tuple(int(i) for i in layers)
        if not layers or len(set(layers)) != len(layers) or any(not NORMED <= i <= self.num_layers for i in layers):
            raise ValueError(
                f"hidden-state layers must be distinct ids in [-1, {self.num_layers}] (this model has "
                f"{self.num_layers} layers), got {list(layers)}"
            )
        self.capture = layers

    def _captured(self, hidden: Tensor) -> Tensor:
        """This forward's captured hidden states [B, T, len(capture) * H] (hidden: the final norm's output)."""
        parts = [hidden if i == NORMED else self._grabbed.pop(i) for i in self.capture]
        return torch.cat(parts, -1) if len(parts) > 1 else parts[0]

    def start(self, batch: int, capacity: int) -> None:
        self.cache = self._new_cache(batch, capacity)

    def _new_cache(self, batch: int, capacity: int) -> RowKVCache:
        extras = (len(self.capture) * self.hidden_size,) if self.capture else ()
        return RowKVCache(
            self.num_layers, batch, self.num_kv_heads, self.head_dim, capacity, self.dtype, self.device, extras
        )

    def fill(self, seqs: Chunk, capacity: int) -> None:
        """Identical sequences (a group's samples share their prompt) are computed once, their KV rows copied."""
        unique: dict[tuple[int, ...], int] = {}
        rows = [unique.setdefault(tuple(s), len(unique)) for s in seqs]
        self.start(len(unique), capacity)
        self.prefill([list(s) for s in unique])
        if len(unique) < len(rows):
            self.cache.select(rows)

    def add_rows(self, seqs: Chunk, capacity: int) -> None:
        old = self.cache
        self.fill(seqs, capacity)
        if old is not None and old.batch_size:
            old.extend(self.cache)
            self.cache = old

    # --- chunked prefill: a row's prompt computed outside the running batch, a chunk at a time --------------
    def stage(self, tokens: Sequence[int], capacity: int) -> StagedPrompt:
        """`Staging.stage`: the row gets a cache of its own until it joins."""
        return StagedPrompt(self, tokens, capacity)

    def join(self, staged: StagedPrompt, copies: int = 1, replace: bool = False) -> None:
        if staged.runner is not self or staged.cache is None or staged.remaining:
            raise ValueError("only a staged prompt of this runner, completely fed, can join its batch")
        if copies < 1:
            raise ValueError(f"copies must be >= 1, got {copies}")
        new = staged.cache
        if copies > 1:
            new.select([0] * copies)
        staged.cache = None  # joined: it feeds no more
        if replace or self.cache is None or not self.cache.batch_size:
            self.cache = new
        else:
            self.cache.extend(new)

    @property
    def lengths(self) -> list[int]:
        return self.cache.lengths if self.cache is not None else []  # (no batch started yet: no rows)

    @property
    def capacity(self) -> int:
        return self.cache.capacity if self.cache is not None else 0

    def reserve(self, capacity: int) -> None:
        """Room for at least `capacity` tokens per row, the rows kept."""
        self.cache.reserve(capacity)

    def truncate(self, lengths: list[int]) -> None:
        self.cache.truncate(lengths)

    def select(self, rows: list[int]) -> None:
        self.cache.select(rows)

    def release(self) -> None:
        """Drop the KV cache (no batch runs; the next `start` / `fill` allocates one)."""
        self.cache = None

    def _run(
        self, tokens: Chunk, parents: Chunk | None = None, tree_start: Slots | None = None
    ) -> tuple[Tensor, list[int]]:
        """One forward over a ragged chunk (chains, or trees: `forward`'s parents and tree_start); returns hidden
        states [B, T, H] and the rows' new-token counts."""
        cache = self.cache
        B = cache.batch_size
        if len(tokens) != B:
            raise ValueError(f"got {len(tokens)} token lists for a batch of {B}")
        n_new = [len(t) for t in tokens]
        T = max(n_new)
        if T == 0:
            raise ValueError("forward needs at least one new token in some row")
        ids = torch.zeros((B, T), dtype=torch.int64)
        for b, t in enumerate(tokens):
            if n_new[b]:
                ids[b, : n_new[b]] = torch.as_tensor(list(t), dtype=torch.int64)
        ids = ids.to(self.device)
        tree = None if parents is None else self._tree_rows(parents, tree_start, n_new)  # checked before any write
        cache.begin_chunk(T)
        position_ids, visible, distance = self._chain_mask(T) if tree is None else self._tree_mask(T, *tree)
        hidden = self._body(ids, self._masks(visible, distance), position_ids)
        if self.capture:
            cache.write_extra(0, self._captured(hidden))
        cache.commit(n_new)
        self.tokens_computed += sum(n_new)
        return hidden, n_new

    def _tree_rows(self, parents: Chunk, tree_start: Slots | None, n_new: list[int]) -> tuple:
        """A tree forward's rows: ((depth, ancestors), start, old, total) per `_tree_structure`, where row b's tree
        began at slot start[b], holds old[b] nodes in the cache already and total[b] with the new ones."""
        lengths = self.cache.lengths
        start = list(lengths) if tree_start is None else [int(s) for s in tree_start]
        old = [n - s for n, s in zip(lengths, start)]  # tree nodes already in the cache
        if len(start) != len(lengths) or any(o < 0 for o in old):
            raise ValueError(f"tree_start {start} must give one slot <= each row's length {lengths}")
        total = [o + n for o, n in zip(old, n_new)]
        return _tree_structure(parents, total, max(total)), start, old, total

    def _chain_mask(self, T: int) -> tuple[Tensor, Tensor, Tensor]:
        """A chain: chunk token i sits at position length + i and sees every slot before it. Returns position_ids
        [B, T], visible [B, T, L] and distance [B, T, L] (query position - key position)."""
        dev = self.device
        position_ids = torch.tensor(self.cache.lengths, device=dev).unsqueeze(1) + torch.arange(T, device=dev)
        distance = position_ids.unsqueeze(-1) - torch.arange(self.cache._used, device=dev).view(1, 1, -1)
        return position_ids, distance >= 0, distance

    def _tree_mask(self, T: int, structure, start: list[int], old: list[int], total: list[int]) -> tuple:
        """`_chain_mask` for trees (`_tree_rows`): a node's position is its depth below the prefix, and it sees
        the prefix and its own ancestors."""
        dev = self.device
        depth, anc = structure[0].to(dev), structure[1].to(dev)  # [B, Tt], [B, Tt, Tt]: depth, ancestor-or-self
        B, Tt = depth.shape
        slots = torch.arange(self.cache._used, device=dev)  # [L]
        start = torch.tensor(start, device=dev).unsqueeze(1)  # [B, 1]
        node = (torch.tensor(old, device=dev).unsqueeze(1) + torch.arange(T, device=dev)).clamp(max=Tt - 1)
        position_ids = start + depth.gather(1, node)  # [B, T]
        rel = slots.view(1, -1) - start  # [B, L]: tree index of each slot (< 0: the committed prefix)
        in_tree = (rel >= 0) & (rel < torch.tensor(total, device=dev).unsqueeze(1))
        j = rel.clamp(0, Tt - 1)
        key_pos = torch.where(in_tree, start + depth.gather(1, j), slots.view(1, -1))  # [B, L]
        anc_q = anc.gather(1, node.unsqueeze(-1).expand(B, T, Tt))  # [B, T, Tt]: the queries' ancestors
        seen = anc_q.gather(2, j.unsqueeze(1).expand(B, T, -1)) & in_tree.unsqueeze(1)
        visible = (rel < 0).unsqueeze(1) | seen  # [B, T, L]
        return position_ids, visible, position_ids.unsqueeze(-1) - key_pos.unsqueeze(1)

    def _body(self, ids: Tensor, masks, position_ids: Tensor) -> Tensor:
        """ids [B, T], masks (see `_masks`), position_ids [B, T] -> final hidden states [B, T, H]."""
        with layer_inputs(self._base, self.capture) as self._grabbed:
            return self._base(
                input_ids=ids, attention_mask=masks, position_ids=position_ids, cache=self.cache, use_cache=True
            ).last_hidden_state

    def _additive(self, visible: Tensor) -> Tensor:  # [B, T, L] bool -> [B, 1, T, L] additive float mask
        mask = torch.zeros(visible.shape, dtype=self.dtype, device=self.device)
        mask.masked_fill_(~visible, torch.finfo(self.dtype).min)  # finite: padded queries never give NaN
        return mask.unsqueeze(1)

    def _masks(self, causal: Tensor, distance: Tensor):
        """The 4D mask(s) the model gets: causal, and for sliding-window layers also within the window
        (HF convention: a key is visible when query - key < sliding_window). Models with both kinds of
        layers (Qwen2 with use_sliding_window) take a dict keyed by layer type."""
        window = getattr(self.config, "sliding_window", None)
        types = set(getattr(self.config, "layer_types", None) or [])
        if not window or (types and "sliding_attention" not in types):
            return self._additive(causal)
        windowed = self._additive(causal & (distance < window))
        if types and types != {"sliding_attention"}:
            return {"full_attention": self._additive(causal), "sliding_attention": windowed}
        return windowed

    def _logits(self, hidden: Tensor) -> Tensor:
        logits = self._head(hidden)[..., : self.vocab_size].float()
        if self._softcap:
            logits = torch.tanh(logits / self._softcap) * self._softcap
        return logits

    @torch.inference_mode()
    def forward(
        self, tokens: Chunk, logits_at: str = "all", parents: Chunk | None = None, tree_start: Slots | None = None
    ) -> Tensor:
        """Append tokens[b] to row b (rows may differ in length, even be empty) and return float32 logits:
        [B, T, V] at every chunk position (logits_at="all"; padding positions are junk) or [B, V] at each row's last
        new token ("last"). parents: None (chains) or per row each new token's parent, -1 (the committed prefix) or
        an earlier token of the chunk: a token tree (a node sees the prefix and its ancestors, at the prefix length
        plus its depth); `keep_paths` then keeps one root-to-node path per row. tree_start: a tree grown over
        several forwards began at slot tree_start[b], and parents[b] covers all its nodes, old and new."""
        check_forward_args(logits_at, parents, tree_start)
        hidden, n_new = self._run(tokens, parents, tree_start)  # [B, T, H]
        if logits_at == "last":
            last = torch.tensor([max(n - 1, 0) for n in n_new], device=self.device)
            hidden = hidden[torch.arange(len(n_new), device=self.device), last]  # [B, H]
        return self._logits(hidden)

    def keep_paths(self, old_lengths: list[int], paths: Chunk) -> None:
        self.cache.keep_paths(old_lengths, paths)

    @torch.inference_mode()
    def prefill(self, tokens: Chunk, chunk: int = 512) -> None:
        """Feed prompts into the cache without computing logits (chunked to bound memory)."""
        longest = max((len(t) for t in tokens), default=0)
        for s in range(0, longest, chunk):
            part = [list(t[s : s + chunk]) for t in tokens]
            if any(part):
                self._run(part)


class StagedPrompt:
    """One row's prompt prefilled outside a torch runner's batch (`HFRunner.stage`): a cache of its own that `feed`
    fills a chunk at a time until `HFRunner.join` appends it to the batch."""

    def __init__(self, runner: HFRunner, tokens: Sequence[int], capacity: int):
        self.runner = runner
        self.tokens = [int(t) for t in tokens]
        self.cache: RowKVCache | None = runner._new_cache(1, capacity)  # [1 row]; None once joined

    @property
    def remaining(self) -> int:
        """Prompt tokens still to compute."""
        return len(self.tokens) - (self.cache.lengths[0] if self.cache is not None else len(self.tokens))

    @torch.inference_mode()
    def feed(self, n: int, chunk: int = 512) -> int:
        """Compute the next min(n, remaining) prompt tokens (forwards of at most `chunk`); returns how many."""
        if self.cache is None:
            raise ValueError("this staged prompt has joined the batch")
        done = self.cache.lengths[0]
        todo = self.tokens[done : done + max(0, n)]
        runner, batch = self.runner, self.runner.cache
        runner.cache = self.cache
        try:
            for s in range(0, len(todo), chunk):
                runner._run([todo[s : s + chunk]])
        finally:
            runner.cache = batch
        return len(todo)

    def close(self) -> None:
        """Give up the row (its request ended before it joined): nothing to free beyond its own cache."""
        self.cache = None
