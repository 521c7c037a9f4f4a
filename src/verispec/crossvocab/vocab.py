"""Two vocabularies side by side: every token's byte string, the token-level intersection, and q moved from the
draft's vocabulary into the target's (Timor et al., ICML 2025, "token-level intersection").

A token's key is the bytes it stands for: byte-level BPE (GPT-2, Qwen, Llama 3, SmolLM2) maps each character to a
byte (`bytes_to_unicode`); SentencePiece (Llama 2, Mistral, Gemma) reads '▁' as a space and '<0xNN>' as byte NN;
anything else is the token decoded alone. Special tokens are keyed by their content and match only specials.

Exactness does not depend on the mapping: verification is handed the q the draft token was drawn from (the draft's
distribution moved into the target's ids, `VocabMap.target_logits`); a wrong key only costs acceptance. Several
draft ids with one key add their probabilities in the target's id; keeping only the last one written
(transformers' `AssistantToTargetTranslator`) hands verification another q and is lossy (`merge="last"`, for the
certificate).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from functools import cached_property, lru_cache

import torch
from torch import Tensor

__all__ = ["CrossVocabError", "VocabMap", "token_keys"]

FLOOR = 1e4  # target_logits: how far below the draft's lowest logit the ids outside the intersection sit
_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


class CrossVocabError(ValueError):
    """A draft and target pair that cross-vocabulary speculation cannot use (no token in common, a bad mode)."""


@lru_cache(maxsize=1)
def _unicode_to_byte() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the character standing for each byte -> the byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def _family(tokenizer) -> str:
    """'bytelevel', 'sentencepiece' or 'decode', from the fast tokenizer's decoder (a slow one: 'decode')."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return "decode"
    decoder = json.dumps(json.loads(backend.to_str()).get("decoder"))
    if '"ByteLevel"' in decoder:
        return "bytelevel"
    if '"ByteFallback"' in decoder or '"Metaspace"' in decoder or "\\u2581" in decoder:
        return "sentencepiece"
    return "decode"


def _piece_bytes(piece: str, family: str) -> tuple[bytes | None, bool]:
    """A vocabulary entry's bytes and whether it is a byte-fallback token (None: the family cannot read it)."""
    if family == "bytelevel":
        table = _unicode_to_byte()
        if all(c in table for c in piece):
            return bytes(table[c] for c in piece), False
        return piece.encode(), False  # an added, non-special token: literal text
    m = _BYTE_TOKEN.match(piece)
    if m:
        return bytes([int(m.group(1), 16)]), True
    return piece.replace("\u2581", " ").encode(), False


def token_keys(tokenizer, size: int) -> tuple[list[bytes | str | None], list[bool]]:
    """Per id < size: its key (bytes; 'special:<content>' for a special token; None for an id the tokenizer does
    not have) and whether it is a byte-fallback token ('<0xNN>')."""
    family = _family(tokenizer)
    pieces = tokenizer.convert_ids_to_tokens(list(range(size)))
    specials = {i: t.content for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if t.special}
    specials.update({i: tokenizer.convert_ids_to_tokens(i) for i in tokenizer.all_special_ids if i not in specials})
    added = {i for i in getattr(tokenizer, "added_tokens_decoder", {})}
    keys: list[bytes | str | None] = []
    fallback: list[bool] = []
    for i, piece in enumerate(pieces):
        if i in specials or piece is None:
            key, is_byte = (f"special:{specials[i]}" if i in specials else None), False
        elif family == "decode" or i in added:
            key, is_byte = (tokenizer.decode([i]).encode() if family == "decode" else piece.encode()), False
        else:
            key, is_byte = _piece_bytes(piece, family)
        keys.append(key)
        fallback.append(is_byte)
    return keys, fallback


def _canonical(keys: list, fallback: list[bool]) -> dict:
    """key -> the id a tokenizer would normally produce for it: not a byte-fallback token, then the lowest id."""
    best: dict = {}
    for i, k in enumerate(keys):
        if k is None or (isinstance(k, bytes) and not k):
            continue
        if k not in best or (fallback[best[k]] and not fallback[i]):
            best[k] = i
    return best


@dataclass
class VocabMap:
    """The draft's vocabulary (size V_d) against the target's (V_t).

    d2t: [V_d] int64, the target id a draft id stands for, -1 outside the intersection;
    t2d: [V_t] int64, the draft id fed to the draft for a target id in the intersection, -1 elsewhere;
    merge: how several draft ids with one key combine in the target's id: "sum" (exact) or "last" (lossy)."""

    d2t: Tensor
    t2d: Tensor
    target_keys: list  # [V_t] each target id's key (token_keys)
    draft_keys: list  # [V_d] each draft id's key
    draft_bytes: dict[bytes, int]  # the draft's ordinary tokens by their bytes (its canonical id per string)
    draft_specials: dict[str, int]  # special token content -> the draft's id
    target_specials: dict[str, int]  # special token content -> the target's id
    merge: str = "sum"
    _spell: dict[int, list[int]] = field(default_factory=dict, repr=False)

    @classmethod
    def build(
        cls, target_tok, draft_tok, v_target: int, v_draft: int, merge: str = "sum", need_overlap: bool = True
    ) -> VocabMap:
        """The map of a pair; need_overlap (token-level intersection): a CrossVocabError where no token is shared."""
        if merge not in ("sum", "last"):
            raise CrossVocabError(f"merge must be 'sum' or 'last', got {merge!r}")
        t_keys, t_fb = token_keys(target_tok, v_target)
        d_keys, d_fb = token_keys(draft_tok, v_draft)
        t_best, d_best = _canonical(t_keys, t_fb), _canonical(d_keys, d_fb)
        d2t = torch.tensor([t_best.get(k, -1) if k is not None else -1 for k in d_keys], dtype=torch.int64)
        t2d = torch.full((v_target,), -1, dtype=torch.int64)
        for k, t in t_best.items():
            if k in d_best:
                t2d[t] = d_best[k]
        if need_overlap and not bool((d2t >= 0).any()):
            raise CrossVocabError(
                "the draft and target tokenizers have no token in common (no byte string or special token of one is "
                "in the other): token-level intersection (cross_vocab=tli) cannot draft for this pair; string-level exact "
                "match (cross_vocab=slem) re-tokenizes the draft's text instead"
            )
        draft_bytes = {k: i for k, i in d_best.items() if isinstance(k, bytes)}
        draft_specials = {k[len("special:") :]: i for k, i in d_best.items() if isinstance(k, str)}
        target_specials = {k[len("special:") :]: i for k, i in t_best.items() if isinstance(k, str)}
        return cls(d2t, t2d, t_keys, d_keys, draft_bytes, draft_specials, target_specials, merge)

    @property
    def intersection(self) -> int:
        """Target ids the draft can propose."""
        return int(torch.unique(self.d2t[self.d2t >= 0]).numel())

    @property
    def shared_draft_ids(self) -> int:
        """Draft ids with a target id (more than `intersection` where several share one string)."""
        return int((self.d2t >= 0).sum())

    def target_logits(self, logits: Tensor, v_target: int) -> Tensor:
        """Draft logits [..., V_d] as target-vocabulary logits [..., V_t]. Where several draft ids stand for one target
        id, the log of their summed exp (so softmax at temperature 1 adds their probabilities); merge="last" keeps
        one of them instead (lossy, for the certificate). Outside the intersection: FLOOR below the row's lowest
        draft logit — probability 0 in float32 wherever the request allows a token of the intersection, and uniform
        over what it allows where it allows none (a grammar or token options left only target-only tokens), so
        drafting never fails where decoding would not. Exact either way: the draft token is drawn from this q."""
        src_ids, dst, injective = self._index(logits.device)
        src = logits.index_select(-1, src_ids)  # [..., S]
        floor = logits.amin(-1, keepdim=True).nan_to_num(neginf=-1e30) - FLOOR  # [..., 1]
        out = floor.expand(*logits.shape[:-1], v_target).clone()  # [..., V_t]
        if injective or self.merge == "last":
            out[..., dst] = src  # one draft id per target id (merge="last": the highest of several)
            return out
        top = src.amax(-1, keepdim=True)  # [..., 1]
        summed = torch.zeros_like(out).index_add_(-1, dst, (src - top).exp())  # [..., V_t]
        return torch.maximum(summed.log() + top, out)

    def _index(self, device) -> tuple[Tensor, Tensor, bool]:
        """(draft ids that have a target id [S], their target ids [S], whether no two share one), on `device`;
        merge="last" keeps, of several draft ids with one target id, only the highest."""
        cache = self.__dict__.setdefault("_index_cache", {})
        if device not in cache:
            src = torch.nonzero(self.d2t >= 0).squeeze(1)
            dst = self.d2t[src]
            injective = dst.numel() == torch.unique(dst).numel()
            if not injective and self.merge == "last":
                last = {int(t): int(i) for i, t in zip(src.tolist(), dst.tolist())}
                src = torch.tensor(sorted(last.values()), dtype=torch.int64)
                dst = self.d2t[src]
            cache[device] = (src.to(device), dst.to(device), injective)
        return cache[device]

    def spell(self, target_id: int) -> list[int]:
        """The draft ids fed for one target token: its draft id where it has one; a special token as the draft's
        special of the same content (or nothing); else its bytes spelled greedily by the draft's longest
        matching tokens (bytes the draft cannot spell are skipped)."""
        if target_id in self._spell:
            return self._spell[target_id]
        d = int(self.t2d[target_id]) if 0 <= target_id < self.t2d.numel() else -1
        key = self.target_keys[target_id] if 0 <= target_id < len(self.target_keys) else None
        if d >= 0:
            ids = [d]
        elif isinstance(key, str):
            ids = [self.draft_specials[key[len("special:") :]]] if key[len("special:") :] in self.draft_specials else []
        else:
            ids = self.spell_bytes(key or b"")
        self._spell[target_id] = ids
        return ids

    def spell_bytes(self, data: bytes) -> list[int]:
        """Bytes as draft ids, longest match first (greedy; skips a byte no draft token starts with)."""
        longest = self._longest
        ids, i = [], 0
        while i < len(data):
            for n in range(min(longest, len(data) - i), 0, -1):
                d = self.draft_bytes.get(data[i : i + n])
                if d is not None:
                    ids.append(d)
                    i += n
                    break
            else:
                i += 1
        return ids

    def draft_text_bytes(self, ids: list[int]) -> bytes:
        """The bytes of ordinary draft tokens, concatenated (special tokens and unknown ids add nothing)."""
        return b"".join(k for k in (self.draft_keys[i] for i in ids) if isinstance(k, bytes))

    def target_text_bytes(self, ids: list[int]) -> bytes:
        """The bytes of ordinary target tokens, concatenated."""
        return b"".join(k for k in (self.target_keys[i] for i in ids) if isinstance(k, bytes))

    @cached_property
    def _longest(self) -> int:
        return max((len(k) for k in self.draft_bytes), default=1)
