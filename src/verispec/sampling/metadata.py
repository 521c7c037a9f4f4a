"""A batch's sampling parameters as tensors, built once per batch membership (vLLM's SamplingMetadata): the engine
builds one when rows join or leave and hands it to every `probs_from_logits` call of the batch (the target's p and
each drafter's q), instead of a host-to-device copy per call. Pure tensor code: it knows SamplingParams, not models.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .params import SamplingParams

__all__ = ["SamplingMetadata"]

_COLUMNS = ("temperature", "top_p", "min_p", "repetition", "presence", "frequency")


@dataclass(frozen=True, eq=False)
class SamplingMetadata:
    """Per-row SamplingParams of a batch of B rows over V tokens, as tensors on `device` (never modified): build it
    with `SamplingMetadata.build(params, vocab_size, device)`; `select(rows)` gives a subset's."""

    params: tuple[SamplingParams, ...]
    vocab_size: int
    device: torch.device
    temperature: Tensor  # [B] float64: the divisor (1 for greedy rows, which never divide)
    greedy: Tensor  # [B] bool
    top_k: Tensor  # [B] int64: V where disabled
    top_p: Tensor  # [B] float64
    min_p: Tensor  # [B] float64
    repetition: Tensor  # [B] float64
    presence: Tensor  # [B] float64
    frequency: Tensor  # [B] float64
    blocked: Tensor | None  # [B, V] bool: never sampled (outside allowed_token_ids, one-token bad words)
    bias_ids: Tensor | None  # [B, K] int64: logit_bias tokens (padding: token 0 with bias 0)
    bias: Tensor | None  # [B, K] float64: their biases
    bad_last: Tensor | None  # [B, W] int64: each multi-token bad word's last token (padding: 0, invalid)
    bad_prefix: Tensor | None  # [B, W, M] int64: its other tokens, most recent first: word[-2], word[-3], ...
    bad_free: Tensor | None  # [B, W, M] bool: beyond the word's prefix (matches any context token)
    bad_valid: Tensor | None  # [B, W] bool: a real word (not padding)
    bad_depth: int  # M: context tokens the bad words look back at (0: no multi-token bad word)
    any_greedy: bool
    all_greedy: bool
    any_penalties: bool
    any_truncation: bool
    any_top_p: bool
    any_min_p: bool
    any_temperature: bool  # a sampled row's temperature is not 1 (else the temperature step is skipped)
    any_constraint: bool  # a row has a structured-output constraint (its grammar's mask must be passed)
    all_identity: bool  # every row samples softmax(logits) itself (SamplingParams.is_identity)
    _cast: dict = field(default_factory=dict, repr=False)  # (name, dtype) -> a column in a logits dtype

    @property
    def batch_size(self) -> int:
        return len(self.params)

    @classmethod
    def build(
        cls, params: Sequence[SamplingParams], vocab_size: int, device: torch.device | str = "cpu", check: bool = True
    ) -> SamplingMetadata:
        """The metadata of rows with these params; ParamError (a ValueError) when a token id is outside the
        vocabulary (check=False: the params were checked already, e.g. by `select`)."""
        rows = tuple(params)
        for r in rows:
            if not isinstance(r, SamplingParams):
                raise ValueError(f"params must be SamplingParams, got {type(r).__name__}")
            if check:
                r.check_vocab(vocab_size)
        dev, V = torch.device(device), int(vocab_size)

        def f64(values: list[float]) -> Tensor:
            return torch.tensor(values, dtype=torch.float64).to(dev)

        return cls(
            rows,
            V,
            dev,
            temperature=f64([r.temperature if r.temperature > 0 else 1.0 for r in rows]),
            greedy=torch.tensor([r.greedy for r in rows], dtype=torch.bool).to(dev),
            top_k=torch.tensor([r.top_k if 0 < r.top_k < V else V for r in rows], dtype=torch.int64).to(dev),
            top_p=f64([r.top_p for r in rows]),
            min_p=f64([r.min_p for r in rows]),
            repetition=f64([r.repetition_penalty for r in rows]),
            presence=f64([r.presence_penalty for r in rows]),
            frequency=f64([r.frequency_penalty for r in rows]),
            **_token_options(rows, V, dev),
            any_greedy=any(r.greedy for r in rows),
            all_greedy=bool(rows) and all(r.greedy for r in rows),
            any_penalties=any(r.uses_penalties for r in rows),
            any_truncation=any(r.uses_truncation for r in rows),
            any_top_p=any(r.top_p < 1.0 for r in rows),
            any_min_p=any(r.min_p > 0 for r in rows),
            any_temperature=any(r.temperature not in (0.0, 1.0) for r in rows),
            any_constraint=any(r.constraint is not None for r in rows),
            all_identity=all(r.is_identity for r in rows),
        )

    def select(self, rows: Sequence[int]) -> SamplingMetadata:
        """The metadata of these rows (in this order), e.g. after others left the batch."""
        return SamplingMetadata.build([self.params[b] for b in rows], self.vocab_size, self.device, check=False)

    def col(self, name: str, dtype: torch.dtype) -> Tensor:
        """A [B] parameter column as [B, 1, 1] in `dtype` (cast once per dtype, then reused)."""
        key = (name, dtype)
        if key not in self._cast:
            self._cast[key] = getattr(self, name).to(dtype).view(-1, 1, 1)
        return self._cast[key]

    def bias_as(self, dtype: torch.dtype) -> Tensor:  # [B, 1, K]
        key = ("bias", dtype)
        if key not in self._cast:
            self._cast[key] = self.bias.to(dtype).unsqueeze(1)
        return self._cast[key]

    def check(self, batch: int, vocab: int, device: torch.device) -> None:
        if batch != self.batch_size or vocab != self.vocab_size:
            raise ValueError(
                f"the SamplingMetadata is for {self.batch_size} rows over {self.vocab_size} tokens; "
                f"the logits have {batch} rows over {vocab} tokens"
            )
        same = device.type == self.device.type and None in (device.index, self.device.index)
        if not (same or device == self.device):
            raise ValueError(f"the SamplingMetadata lives on {self.device}, the logits on {device}")


def _token_options(rows: tuple[SamplingParams, ...], V: int, dev: torch.device) -> dict:
    """The tensors of logit_bias, allowed_token_ids and bad_words (None where no row uses the option)."""
    B = len(rows)
    out: dict = dict(blocked=None, bias_ids=None, bias=None, bad_last=None, bad_prefix=None, bad_free=None)
    out.update(bad_valid=None, bad_depth=0)
    if any(r.allowed_token_ids is not None or r.banned_token_ids for r in rows):
        blocked = torch.zeros((B, V), dtype=torch.bool)
        for b, r in enumerate(rows):
            if r.allowed_token_ids is not None:
                blocked[b] = True
                blocked[b, list(r.allowed_token_ids)] = False
            blocked[b, list(r.banned_token_ids)] = True
        out["blocked"] = blocked.to(dev)
    K = max((len(r.logit_bias) for r in rows), default=0)
    if K:
        ids, bias = torch.zeros((B, K), dtype=torch.int64), torch.zeros((B, K), dtype=torch.float64)
        for b, r in enumerate(rows):
            for i, (t, v) in enumerate(r.logit_bias):
                ids[b, i], bias[b, i] = t, v
        out.update(bias_ids=ids.to(dev), bias=bias.to(dev))
    words = [[w for w in r.bad_words if len(w) > 1] for r in rows]
    W, M = max(map(len, words), default=0), max((r.bad_word_depth for r in rows), default=0)
    if W:
        last, valid = torch.zeros((B, W), dtype=torch.int64), torch.zeros((B, W), dtype=torch.bool)
        prefix, free = torch.zeros((B, W, M), dtype=torch.int64), torch.ones((B, W, M), dtype=torch.bool)
        for b, row in enumerate(words):
            for i, w in enumerate(row):
                last[b, i], valid[b, i] = w[-1], True
                prefix[b, i, : len(w) - 1] = torch.tensor(w[-2::-1])
                free[b, i, : len(w) - 1] = False
        out.update(bad_last=last.to(dev), bad_prefix=prefix.to(dev), bad_free=free.to(dev), bad_valid=valid.to(dev))
        out["bad_depth"] = M
    return out
