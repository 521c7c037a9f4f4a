"""String-level exact match (SLEM, Timor et al. 2025), for sampling as well as greedy: the draft continues the text
greedily in its own vocabulary, the target's tokenizer re-tokenizes that text past a stable boundary, and those
target tokens are proposed as a chosen chain (one-hot q: exact at any temperature, like prompt lookup).

The boundary: the last `lookbehind` committed target tokens are re-tokenized with the draft's text, and the tokens
after them are proposed only where the re-tokenization starts with those exact tokens (else the draft's text alone
is tokenized). The last proposed token is dropped (more text could merge it with what follows). A draft special
token (EOS) ends the text, proposed as the target's special of the same content. The draft is greedy (whatever the
request's sampling): proposals are then a function of the committed tokens, as chosen drafts must be. A draft context
window (`draft_context`) bounds the draft's prefill as a draft model's does (`drafting.draft_model.draft_window`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from ..drafting.base import BatchView, Draft, Proposer
from ..drafting.draft_model import check_draft_context, draft_window
from ..model.fast import make_runner
from .runner import BridgedRunner
from .vocab import VocabMap

__all__ = ["SlemProposer"]


class SlemProposer(Proposer):
    name = "slem"
    cost_prior = 0.3  # a draft forward before one is timed, as a share of a target step (engine.adaptive)

    def __init__(
        self,
        model,
        target_tokenizer,
        vocab: VocabMap,
        v_target: int,
        v_draft: int,
        *,
        runner: Callable = make_runner,
        lookbehind: int = 4,
        extra: int = 2,
        draft_context: int | None = None,
    ):
        """model: the draft model (its vocabulary v_draft); vocab: the pair's VocabMap (how the draft reads the
        committed target tokens); runner: the factory (model, v_draft) -> the draft's own runner (bridged here into
        the target's ids); lookbehind: committed target tokens re-tokenized with the draft's text; extra: draft
        tokens drafted beyond the row's cap (the two tokenizations' lengths differ); draft_context: the draft reads
        only this many target tokens of a row when it joins, its first and its last (`draft_window`; None: all)."""
        self.model = model
        self.tokenizer = target_tokenizer
        self.map = vocab
        self.lookbehind, self.extra = lookbehind, extra
        self.draft_context = check_draft_context(draft_context)
        self._offset: list[int] = []  # per row: leading target tokens the draft's cache skips (`draft_window`)
        self._make_inner = lambda: runner(model, v_draft)
        self.runner = BridgedRunner(self._make_inner(), vocab, v_target)
        self._special_ids = {i for i, k in enumerate(vocab.draft_keys) if isinstance(k, str)}

    def start(self, view: BatchView, capacity: int) -> None:
        cached, self._offset = draft_window(view.seqs, self.draft_context)
        self.runner.fill(cached, capacity - min(self._offset, default=0))

    def add(self, view: BatchView, capacity: int) -> None:
        cached, offsets = draft_window(view.seqs, self.draft_context)
        self.runner.add_rows(cached, capacity - min(offsets, default=0))
        self._offset = self._offset + offsets

    def weights_changed(self, model) -> float:
        """A quantized draft is re-quantized when its own weights were replaced (the target's change nothing here)."""
        if model is self.model and getattr(self.runner.inner, "quant", None) is not None:
            t0 = time.perf_counter()
            self.runner.inner = self._make_inner()
            return time.perf_counter() - t0
        return 0.0

    def propose(self, view: BatchView, caps: list[int]) -> Draft:
        B = len(view.seqs)
        if max(caps, default=0) == 0:
            return Draft.empty(B, view.device)
        texts = self._greedy(view, caps)
        found = [self._retokenize(s, d, c) if c > 0 else [] for s, d, c in zip(view.seqs, texts, caps)]
        k = max((len(f) for f in found), default=0)
        ids = torch.full((B, k), -1, dtype=torch.int64)
        for b, f in enumerate(found):
            ids[b, : len(f)] = torch.as_tensor(f, dtype=torch.int64)
        return Draft.chain_of(ids.to(view.device), None, [len(f) for f in found])

    def select(self, rows: list[int]) -> None:
        self.runner.select(rows)
        self._offset = [self._offset[r] for r in rows]

    def release(self) -> None:
        self.runner.release()

    @torch.inference_mode()
    def _greedy(self, view: BatchView, caps: list[int]) -> list[list[int]]:
        """Per row, the draft's greedy continuation in its own ids (up to cap + extra; ends at a special token).
        The draft's own tokens leave its cache afterwards: it keeps only the committed target tokens."""
        runner = self.runner
        feed = [s[o + n :] if c > 0 else [] for s, o, n, c in zip(view.seqs, self._offset, runner.lengths, caps)]
        logits = runner.draft_forward(feed, logits_at="last")  # [B, V_d]: after each row's pending token
        want = [c + self.extra if c > 0 else 0 for c in caps]
        runner.room([max(want)])
        out: list[list[int]] = [[] for _ in caps]
        open_ = [w > 0 for w in want]
        for j in range(max(want)):
            tok = logits.argmax(-1).tolist()  # [B]
            for b, t in enumerate(tok):
                if open_[b]:
                    out[b].append(t)
                    open_[b] = len(out[b]) < want[b] and t not in self._special_ids
            if not any(open_) or j == max(want) - 1:
                break
            logits = runner.own_forward([[t] if o else [] for t, o in zip(tok, open_)])  # [B, V_d]
        runner.forget_own()
        return out

    def _retokenize(self, seq: list[int], drafted: list[int], cap: int) -> list[int]:
        """The target tokens that continue `seq` with the draft's text (at most cap)."""
        end = None
        if drafted and drafted[-1] in self._special_ids:
            content = self.map.draft_keys[drafted[-1]][len("special:") :]
            end = self.map.target_specials.get(content)
            drafted = drafted[:-1]
        text = self.map.draft_text_bytes(drafted)
        tokens = self._after(seq, text)
        if end is not None and self.map.target_text_bytes(tokens) == text:
            tokens = tokens + [end]  # the text ended: its last token is stable
        elif tokens:
            tokens = tokens[:-1]  # the last token may still merge with what follows
        tokens = tokens[:cap]
        for i, t in enumerate(tokens):  # an id the target's output layer lacks (tokenizer larger than the model)
            if t >= self.runner.vocab_size:
                return tokens[:i]
        return tokens

    def _after(self, seq: list[int], text: bytes) -> list[int]:
        """The target's tokens for `text` after the committed `seq`, past a stable boundary."""
        if not text:
            return []
        for n in (self.lookbehind, 0):
            tail = list(seq[-n:]) if n else []
            body = self.map.target_text_bytes(tail) + text
            decoded = _utf8_prefix(body)
            if decoded is None:
                continue
            ids = self.tokenizer(decoded, add_special_tokens=False)["input_ids"]
            if ids[: len(tail)] == tail:
                return list(ids[len(tail) :])
        return []


def _utf8_prefix(data: bytes) -> str | None:
    """data decoded, with up to 3 trailing bytes of an unfinished character dropped; None where it is not UTF-8
    otherwise (e.g. the look-behind starts mid-character)."""
    for cut in range(0, min(4, len(data) + 1)):
        try:
            return data[: len(data) - cut].decode("utf-8")
        except UnicodeDecodeError:
            continue
    return None
