"""Model runner: ragged chunks of tokens in, logits out, over a `RowKVCache` with rollback.

Works with any HF transformers decoder-only model whose attention accepts a ready-made 4D mask and
explicit position ids (Llama, Qwen2, Mistral, SmolLM2, ... — the families verispec tests). The runner
builds the mask itself: row b's query i sits at absolute position lengths[b] + i and sees slots
[0, lengths[b] + i]. Padding inside a chunk (rows with fewer new tokens) is written beyond the row's
length, hidden from real queries, and overwritten later, so the cache never needs compaction.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .cache import RowKVCache

__all__ = ["HFRunner"]


class HFRunner:
    """Runs one HF causal LM for a batch of rows. `vocab_size` slices the logits to the shared vocabulary."""

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
        self._base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
        self._head = model.get_output_embeddings()
        self._softcap = getattr(cfg, "final_logit_softcapping", None)

    # --- batch lifecycle ------------------------------------------------------------------------------
    def start(self, batch: int, capacity: int) -> None:
        """Allocate a fresh cache for `batch` rows of up to `capacity` tokens each."""
        self.cache = RowKVCache(self.num_layers, batch, self.num_kv_heads, self.head_dim, capacity,
                                self.dtype, self.device)

    @property
    def lengths(self) -> list[int]:
        return self.cache.lengths

    def truncate(self, lengths: list[int]) -> None:
        self.cache.truncate(lengths)

    def select(self, rows: list[int]) -> None:
        self.cache.select(rows)

    # --- forward --------------------------------------------------------------------------------------
    def _run(self, tokens: Sequence[Sequence[int]]) -> tuple[Tensor, list[int]]:
        """One forward over a ragged chunk; returns hidden states [B, T, H] and the rows' new-token counts."""
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
        position_ids = (torch.tensor(cache.lengths, device=self.device).unsqueeze(1)
                        + torch.arange(T, device=self.device))  # [B, T]: absolute positions
        cache.begin_chunk(T)
        keys = torch.arange(cache._used, device=self.device)  # [L]
        distance = position_ids.unsqueeze(-1) - keys.view(1, 1, -1)  # [B, T, L]: query position - key slot
        hidden = self._body(ids, self._masks(distance >= 0, distance), position_ids)
        cache.commit(n_new)
        return hidden, n_new

    def _body(self, ids: Tensor, masks, position_ids: Tensor) -> Tensor:
        """ids [B, T], masks (see `_masks`), position_ids [B, T] -> final hidden states [B, T, H]."""
        return self._base(input_ids=ids, attention_mask=masks, position_ids=position_ids, cache=self.cache,
                          use_cache=True).last_hidden_state

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
    def forward(self, tokens: Sequence[Sequence[int]], logits_at: str = "all") -> Tensor:
        """Append tokens[b] to row b (rows may differ in length, even be empty) and return float32 logits.

        logits_at="all":  [B, T, V] for every chunk position (T = longest row; padding positions are junk);
        logits_at="last": [B, V] at each row's last new token (a row with no new tokens gets junk).
        """
        if logits_at not in ("all", "last"):
            raise ValueError(f"logits_at must be 'all' or 'last', got {logits_at!r}")
        hidden, n_new = self._run(tokens)  # [B, T, H]
        if logits_at == "last":
            last = torch.tensor([max(n - 1, 0) for n in n_new], device=self.device)
            hidden = hidden[torch.arange(len(n_new), device=self.device), last]  # [B, H]
        return self._logits(hidden)

    @torch.inference_mode()
    def prefill(self, tokens: Sequence[Sequence[int]], chunk: int = 512) -> None:
        """Feed prompts into the cache without computing logits (chunked to bound memory)."""
        longest = max((len(t) for t in tokens), default=0)
        for s in range(0, longest, chunk):
            part = [list(t[s:s + chunk]) for t in tokens]
            if any(part):
                self._run(part)
