"""Tiny tokenizer pairs with different vocabularies, for cross-tokenizer speculative decoding tests (all built
locally, no downloads; text alphabet: letters a-h, space, newline, '.', ',' and 'é').

target_tokenizer() -- byte-level BPE in the GPT-2 / Qwen style (35 ids): ByteLevel pre-tokenizer (GPT-2 regex,
    no prefix space) and decoder; vocabulary = TARGET_CHARS (byte-level characters: 'Ġ' is b' ', 'Ċ' b'\\n', 'Ã'
    b'\\xc3', '©' b'\\xa9') + one token per TARGET_MERGES entry + TARGET_SPECIALS at the end ('<|endoftext|>',
    '<|im_start|>', '<|im_end|>'; eos '<|im_end|>', pad '<|endoftext|>'). No unknown token: only the alphabet encodes.
draft_tokenizer() -- SentencePiece / Llama style (39 ids): Metaspace('▁', prepend_scheme="never", so the round
    trip is exact) and BPE with byte_fallback; decoder Replace('▁', ' '), ByteFallback, Fuse. Vocabulary =
    DRAFT_SPECIALS first ('<unk>', '<s>', '</s>', '<|im_end|>', '<|im_start|>', '<|endoftext|>'; eos '<|im_end|>',
    bos '<s>'), then DRAFT_BYTES ('<0x0A>' '<0x20>' '<0x2E>' '<0x61>' '<0xA9>' '<0xC3>'), then DRAFT_CHARS (other
    order than the target's), then one token per DRAFT_MERGES entry. Against the target:
    - every shared string has another id on each side;
    - partial overlap (26 shared byte strings, specials included): draft-only 'bc', 'bcd', 'de', '▁b', '▁efg',
      '▁g', '▁gh', '<unk>', '<s>', '</s>'; target-only 'abc', 'abd', 'cd', 'efg', 'Ġabc', 'Ġabd', 'ĊĊ', 'Ã©'
      (b'\\xc3\\xa9'), 'ĠÃ©';
    - other splits: "abc abd\\nefg" is target [abc, Ġabd, Ċ, efg], draft [ab, c, ▁ab, d, <0x0A>, ef, g];
    - newline and 'é' have no ordinary draft piece: they encode by byte fallback (<0x0A>; <0xC3> <0xA9>, each a
      partial UTF-8 sequence shared with the target's 'Ã' / '©');
    - many-to-one: '<0x61>', '<0x20>', '<0x2E>' decode to the bytes of 'a', '▁', '.' (duplicate_draft_ids());
      encoding never yields them (the ordinary piece exists) but a draft model can propose them.
disjoint_tokenizer() -- character-level BPE over digits and A-Z with '<unk>', '<s>', '</s>' (39 ids): no token's
    byte string (special or not) is one of the target's.

The byte string of a token: byte-level BPE -> the bytes its characters stand for in GPT-2's bytes_to_unicode table;
SentencePiece -> '▁' is b' ', '<0xNN>' is bytes([NN]); a special token matches only a special token of the other
side with the same content. shared_strings() / shared_id_pairs() / duplicate_draft_ids() are computed here from
the construction lists, not by calling the tokenizers, so tests can check an implementation's intersection.

Both tokenizers carry the same ChatML-like template without role names (CHAT_TEMPLATE); SAMPLES round-trip
through both (decode(encode(text)) == text) and tokenize differently on each side.

Models: cross_pair(seed, agree, scale=16) -> (target, draft) LoadedModels: target = tiny.make_model(seed, vocab=35,
scale=16) (2-layer Llama, hidden 32; sharper than make_model's default 4, whose 35-way laws are near uniform so that
any draft agrees often); draft (vocab 39) with agree=True has the target's layers and, for each draft id whose byte
string the target has (shared_id_pairs(), 29 pairs), the target's embedding and lm_head rows for it plus Gaussian
noise (0.1 of the matrix's std), while draft-only ids get small random rows (about 0.1 of the draft's mass in all;
averaged over SAMPLES prefixes sum min(p_target, p_draft) over shared pairs is about 0.6, against 0.2 for
agree=False: an independent random 2-layer model). EOS (config and generation_config) is each tokenizer's
'<|im_end|>'. disjoint_pair(seed) pairs the target with a random model over disjoint_tokenizer().
save_cross_pair(folder) writes folder/"target" and folder/"draft" and checks they reload through AutoTokenizer /
AutoModelForCausalLM (same tokens for SAMPLES, same eos, same template, same logits).
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from verispec.model.loading import LoadedModel

from .tiny import make_model

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>{% endif %}"
)  # ChatML without role names (their letters are outside the alphabet)

SAMPLES = [
    "abc abd\nefg",
    "abcd bcd efg gh",
    "a b c d e f g h",
    "ab, cd. ef\n\ngh",
    "hgfedcba  aab",
    " abc\n",
    "café bé, é.",
    "d.e.f",
]

# --- target: byte-level BPE (GPT-2 / Qwen) ---------------------------------------------------------------------
TARGET_CHARS = [*"abcdefgh", "Ġ", "Ċ", ".", ",", "Ã", "©"]
TARGET_MERGES = [("Ġ", "a"), ("a", "b"), ("c", "d"), ("Ġa", "b"), ("ab", "c"), ("Ġ", "e"), ("Ġe", "f"), ("e", "f"),
                 ("g", "h"), ("ab", "d"), ("Ġab", "c"), ("Ġab", "d"), ("ef", "g"), ("Ġ", "c"), ("Ġc", "d"),
                 ("Ċ", "Ċ"), ("Ã", "©"), ("Ġ", "Ã©")]  # fmt: skip
TARGET_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TARGET_VOCAB = TARGET_CHARS + [a + b for a, b in TARGET_MERGES] + TARGET_SPECIALS  # id = position
TARGET_EOS = TARGET_VOCAB.index("<|im_end|>")

# --- draft: SentencePiece-style BPE with byte fallback (Llama) --------------------------------------------------
DRAFT_SPECIALS = ["<unk>", "<s>", "</s>", "<|im_end|>", "<|im_start|>", "<|endoftext|>"]
DRAFT_BYTES = ["<0x0A>", "<0x20>", "<0x2E>", "<0x61>", "<0xA9>", "<0xC3>"]
DRAFT_CHARS = ["▁", "e", "a", "b", "c", "d", "f", "g", "h", ".", ","]
DRAFT_MERGES = [("▁", "a"), ("a", "b"), ("b", "c"), ("e", "f"), ("▁", "e"), ("bc", "d"), ("▁e", "f"), ("▁ef", "g"),
                ("g", "h"), ("▁a", "b"), ("d", "e"), ("▁", "c"), ("▁c", "d"), ("▁", "g"), ("▁g", "h"),
                ("▁", "b")]  # fmt: skip
DRAFT_VOCAB = DRAFT_SPECIALS + DRAFT_BYTES + DRAFT_CHARS + [a + b for a, b in DRAFT_MERGES]
DRAFT_EOS = DRAFT_VOCAB.index("<|im_end|>")

# --- disjoint: characters the target has none of ------------------------------------------------------------------
DISJOINT_SPECIALS = ["<unk>", "<s>", "</s>"]
DISJOINT_VOCAB = DISJOINT_SPECIALS + [str(d) for d in range(10)] + [chr(65 + i) for i in range(26)]
DISJOINT_EOS = DISJOINT_VOCAB.index("</s>")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's table from bytes to the printable characters a byte-level vocabulary spells them with."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


_UNICODE_TO_BYTE = {c: b for b, c in _bytes_to_unicode().items()}


def _target_bytes(token: str) -> bytes:
    return bytes(_UNICODE_TO_BYTE[c] for c in token)


def _draft_bytes(token: str) -> bytes:
    if token.startswith("<0x") and token.endswith(">") and len(token) == 6:
        return bytes([int(token[3:5], 16)])
    return token.replace("▁", " ").encode()


def _side(vocab: list[str], specials: list[str], to_bytes) -> dict[tuple[bool, bytes], list[int]]:
    """(is special, byte string) -> the ids holding it."""
    out: dict[tuple[bool, bytes], list[int]] = {}
    for i, t in enumerate(vocab):
        key = (True, t.encode()) if t in specials else (False, to_bytes(t))
        out.setdefault(key, []).append(i)
    return out


def _target_side():
    return _side(TARGET_VOCAB, TARGET_SPECIALS, _target_bytes)


def _draft_side():
    return _side(DRAFT_VOCAB, DRAFT_SPECIALS, _draft_bytes)


def shared_strings() -> set[bytes]:
    """The byte strings both the target and the draft vocabulary hold (a special's content counts only if both sides
    have it as a special; here no special's content is also an ordinary token's byte string)."""
    return {b for _, b in _target_side().keys() & _draft_side().keys()}


def shared_special_strings() -> set[str]:
    """The special tokens (by content) both sides have."""
    return {b.decode() for special, b in _target_side().keys() & _draft_side().keys() if special}


def shared_id_pairs() -> set[tuple[int, int]]:
    """(target id, draft id) for every draft id whose byte string the target holds (a target id may pair with
    several draft ids: see duplicate_draft_ids)."""
    t, d = _target_side(), _draft_side()
    return {(ti, di) for key in t.keys() & d.keys() for ti in t[key] for di in d[key]}


def duplicate_draft_ids() -> list[tuple[int, ...]]:
    """Tuples of draft ids that share one byte string (an ordinary piece and its byte-fallback token)."""
    return sorted(tuple(ids) for ids in _draft_side().values() if len(ids) > 1)


def _wrap(tk: Tokenizer, specials: list[str], **names) -> PreTrainedTokenizerFast:
    tk.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, **names)
    tok.chat_template = CHAT_TEMPLATE
    return tok


def target_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE (GPT-2 / Qwen style) over TARGET_VOCAB; eos '<|im_end|>'."""
    tk = Tokenizer(models.BPE({t: i for i, t in enumerate(TARGET_VOCAB)}, list(TARGET_MERGES)))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    return _wrap(tk, TARGET_SPECIALS, eos_token="<|im_end|>", pad_token="<|endoftext|>")


def draft_tokenizer() -> PreTrainedTokenizerFast:
    """SentencePiece-style BPE with byte fallback over DRAFT_VOCAB; eos '<|im_end|>', bos '<s>' (not added)."""
    tk = Tokenizer(
        models.BPE({t: i for i, t in enumerate(DRAFT_VOCAB)}, list(DRAFT_MERGES), unk_token="<unk>", byte_fallback=True)
    )
    tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never")
    tk.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    return _wrap(tk, DRAFT_SPECIALS, eos_token="<|im_end|>", bos_token="<s>", unk_token="<unk>")


def disjoint_tokenizer() -> PreTrainedTokenizerFast:
    """Character-level over digits and A-Z; no byte string in common with target_tokenizer(); eos '</s>'."""
    tk = Tokenizer(models.BPE({t: i for i, t in enumerate(DISJOINT_VOCAB)}, [], unk_token="<unk>"))
    tk.decoder = decoders.Fuse()
    return _wrap(tk, DISJOINT_SPECIALS, eos_token="</s>", bos_token="<s>", unk_token="<unk>")


def _set_eos(model: torch.nn.Module, eos: int, bos: int | None) -> torch.nn.Module:
    for cfg in (model.config, model.generation_config):
        cfg.eos_token_id = eos
        cfg.bos_token_id = bos
        cfg.pad_token_id = None
    return model


def target_model(seed: int = 0, scale: float = 16.0) -> torch.nn.Module:
    """tiny.make_model over TARGET_VOCAB, sharper than its default (scale 4 leaves 35-way laws near uniform, where
    any draft agrees often)."""
    return _set_eos(make_model(seed, vocab=len(TARGET_VOCAB), scale=scale), TARGET_EOS, None)


@torch.no_grad()
def agreeing_draft(target: torch.nn.Module, noise: float = 0.1, seed: int = 0) -> torch.nn.Module:
    """The target's layers over the draft vocabulary: a shared draft id's embedding / lm_head rows are the target's
    rows for that byte string plus noise * std Gaussian noise; draft-only ids get small random rows."""
    g = torch.Generator().manual_seed(seed)
    draft = copy.deepcopy(target)
    draft.resize_token_embeddings(len(DRAFT_VOCAB), mean_resizing=False)
    t_emb, t_head = target.get_input_embeddings().weight, target.lm_head.weight
    d_emb, d_head = draft.get_input_embeddings().weight, draft.lm_head.weight
    for w, std in ((d_emb, t_emb.std()), (d_head, t_head.std())):
        w.copy_(0.1 * std * torch.randn(w.shape, generator=g))
    for ti, di in sorted(shared_id_pairs()):  # sorted: a set's order follows PYTHONHASHSEED
        d_emb[di] = t_emb[ti] + noise * t_emb.std() * torch.randn(t_emb.shape[1], generator=g)
        d_head[di] = t_head[ti] + noise * t_head.std() * torch.randn(t_head.shape[1], generator=g)
    draft.config.vocab_size = len(DRAFT_VOCAB)
    return _set_eos(draft, DRAFT_EOS, DRAFT_VOCAB.index("<s>")).eval()


def cross_pair(seed: int = 0, agree: bool = True, scale: float = 16.0) -> tuple[LoadedModel, LoadedModel]:
    """(target, draft): tiny random models over target_tokenizer() and draft_tokenizer(); agree=True makes the
    draft a remapped noisy copy of the target (agreeing_draft), agree=False an independent random model."""
    target = target_model(seed, scale)
    if agree:
        draft = agreeing_draft(target, seed=seed)
    else:
        draft = make_model(seed + 1, vocab=len(DRAFT_VOCAB), scale=scale)
        draft = _set_eos(draft, DRAFT_EOS, DRAFT_VOCAB.index("<s>"))
    kind = "agree" if agree else "indep"
    return (
        LoadedModel(target, target_tokenizer(), f"cross-target-{seed}"),
        LoadedModel(draft, draft_tokenizer(), f"cross-draft-{kind}-{seed}"),
    )


def disjoint_pair(seed: int = 0) -> tuple[LoadedModel, LoadedModel]:
    """(target, draft) whose vocabularies share no byte string: cross-vocabulary drafting must refuse it."""
    draft = _set_eos(make_model(seed + 1, vocab=len(DISJOINT_VOCAB)), DISJOINT_EOS, DISJOINT_VOCAB.index("<s>"))
    return (
        LoadedModel(target_model(seed), target_tokenizer(), f"cross-target-{seed}"),
        LoadedModel(draft, disjoint_tokenizer(), f"disjoint-draft-{seed}"),
    )


def save_cross_pair(folder: Path, seed: int = 0) -> tuple[Path, Path]:
    """cross_pair(seed) saved as folder/"target" and folder/"draft" (model + tokenizer); checks that both reload
    with AutoTokenizer / AutoModelForCausalLM, tokenize SAMPLES as in memory and give the same logits."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = Path(folder)
    dirs = []
    for lm, name in zip(cross_pair(seed), ("target", "draft")):
        path = folder / name
        lm.model.save_pretrained(path)
        lm.tokenizer.save_pretrained(path)
        tok = AutoTokenizer.from_pretrained(path)
        for text in SAMPLES:
            assert tok.encode(text) == lm.tokenizer.encode(text), (name, text)
        assert tok.eos_token_id == lm.model.config.eos_token_id, name
        assert tok.chat_template == CHAT_TEMPLATE, name
        model = AutoModelForCausalLM.from_pretrained(path).eval()
        ids = torch.tensor([lm.tokenizer.encode(SAMPLES[0])])
        with torch.no_grad():
            assert torch.allclose(model(ids).logits, lm.model(ids).logits, atol=1e-5), name
        dirs.append(path)
    return dirs[0], dirs[1]


if __name__ == "__main__":
    import tempfile
    import time

    torch.set_num_threads(1)  # tiny forwards: threads only contend
    t0 = time.perf_counter()
    tt, dt, xt = target_tokenizer(), draft_tokenizer(), disjoint_tokenizer()
    for tok, vocab in ((tt, TARGET_VOCAB), (dt, DRAFT_VOCAB), (xt, DISJOINT_VOCAB)):
        assert len(tok) == len(vocab) and all(tok.convert_tokens_to_ids(t) == i for i, t in enumerate(vocab))
    print(f"vocab sizes: target {len(tt)}, draft {len(dt)}, disjoint {len(xt)}")
    print(f"eos: target {tt.eos_token_id} (config {TARGET_EOS}), draft {dt.eos_token_id} (config {DRAFT_EOS})")
    for text in SAMPLES:
        a, b = tt.encode(text), dt.encode(text)
        assert tt.decode(a) == text and dt.decode(b) == text, text
        assert a != b
        print(f"{text!r}\n  target {tt.convert_ids_to_tokens(a)}\n  draft  {dt.convert_ids_to_tokens(b)}")
    assert xt.decode(xt.encode("AB12Z")) == "AB12Z"
    # the hand-computed byte strings agree with what the tokenizers decode (ordinary tokens)
    for tok, side in ((tt, _target_side()), (dt, _draft_side())):
        for (special, bs), ids in side.items():
            for i in ids:
                if not special and bs.decode(errors="ignore") == bs.decode(errors="replace"):
                    assert tok.decode([i]) == bs.decode(), (i, bs)
    shared = shared_strings()
    print(f"shared strings ({len(shared)}): {sorted(shared)}")
    print(f"shared specials: {sorted(shared_special_strings())}; shared id pairs: {len(shared_id_pairs())}")
    print(f"duplicate draft ids: {[(ids, [DRAFT_VOCAB[i] for i in ids]) for ids in duplicate_draft_ids()]}")
    x_bytes = {_target_bytes(t) for t in TARGET_CHARS + [a + b for a, b in TARGET_MERGES]}
    assert not (x_bytes | {s.encode() for s in TARGET_SPECIALS}) & {t.encode() for t in DISJOINT_VOCAB}
    print(f"draft: {len(DRAFT_VOCAB) - len(shared_id_pairs())} draft-only ids, target-only strings: "
          f"{sorted(set(map(_target_bytes, TARGET_CHARS + [a + b for a, b in TARGET_MERGES])) - shared)}")  # fmt: skip
    t1 = time.perf_counter()
    d_shared = sorted({d for _, d in shared_id_pairs()})
    for agree in (True, False):
        target, draft = cross_pair(0, agree)
        only, overlap, n = 0.0, 0.0, 0
        for text in SAMPLES:  # next-token laws after every prefix of the samples, each side on its own tokens
            for cut in range(1, len(text)):
                with torch.no_grad():
                    pt = target.model(torch.tensor([tt.encode(text[:cut])])).logits[0, -1].softmax(-1)
                    pd = draft.model(torch.tensor([dt.encode(text[:cut])])).logits[0, -1].softmax(-1)
                only += 1 - float(pd[d_shared].sum())
                overlap += sum(min(float(pt[t]), float(pd[d])) for t, d in shared_id_pairs())
                n += 1
        print(f"agree={agree}: {target.name} / {draft.name}: mean over {n} prefixes of the draft's mass on "
              f"draft-only ids {only / n:.3f}, of sum min(p_target, p_draft) over shared pairs {overlap / n:.3f}")  # fmt: skip
        chat = tt.apply_chat_template([{"role": "user", "content": "abc"}], add_generation_prompt=True, tokenize=False)
        assert (
            chat
            == "<|im_start|>abc<|im_end|>\n<|im_start|>"
            == dt.apply_chat_template([{"role": "user", "content": "abc"}], add_generation_prompt=True, tokenize=False)
        )
    t2 = time.perf_counter()
    with tempfile.TemporaryDirectory() as d:
        print("saved and reloaded:", [p.name for p in save_cross_pair(Path(d))])
    print(
        f"build tokenizers+checks {t1 - t0:.2f}s, two pairs {t2 - t1:.2f}s, save+reload {time.perf_counter() - t2:.2f}s"
    )
