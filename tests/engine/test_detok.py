"""The incremental detokenizer against whole-output decoding, on locally trained byte-level and SentencePiece-style
tokenizers (multi-byte characters split over tokens, leading spaces) and the tests' word-level one."""

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from verispec.engine.rows import IncrementalDecoder

from .tiny import make_tokenizer

TEXT = [
    "def f(x):\n    return x * 2  # doubles",
    "naïve café — 東京の天気は晴れ 🌤️ ok",
    "Ünïcödé ẞ ß ﬁ 😀😃😄 mixed with ascii words",
    "the quick brown fox jumps over the lazy dog",
]


def _bpe(byte_level: bool) -> PreTrainedTokenizerFast:
    tk = Tokenizer(models.BPE(unk_token=None if byte_level else "<unk>", byte_fallback=not byte_level))
    if byte_level:
        tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tk.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    else:  # SentencePiece-like: "▁" for spaces, byte fallback <0xNN> for unseen characters
        tk.pre_tokenizer = pre_tokenizers.Metaspace()
        tk.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace()])
        alphabet = []
    specials = ["<unk>", "</s>"] + ([] if byte_level else [f"<0x{i:02X}>" for i in range(256)])
    # few merges, and (SentencePiece) an alphabet too small for the non-ASCII characters: they split over tokens
    trainer = trainers.BpeTrainer(
        vocab_size=len(specials) + 300, special_tokens=specials, initial_alphabet=alphabet, limit_alphabet=40
    )
    tk.train_from_iterator(TEXT * 4, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="</s>", unk_token="<unk>")


@pytest.mark.parametrize("kind", ["byte-level", "sentencepiece", "word-level"])
def test_incremental_text_is_the_whole_decode_whenever_that_is_complete(kind):
    """At every step the incremental text is a prefix of decode(tokens), and equal to it unless decode ends in an
    incomplete character (U+FFFD); fed 1-4 tokens a step, as speculative steps do, EOS tokens included."""
    tok = make_tokenizer() if kind == "word-level" else _bpe(kind == "byte-level")
    rng = random.Random(0)
    texts = TEXT if kind != "word-level" else ["a b c x0 d e", "z y x1 b"]
    for text in texts:
        ids = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id] + tok.encode(text[::-1])
        tokens: list[int] = []
        dec = IncrementalDecoder()
        while len(tokens) < len(ids):
            tokens.extend(ids[len(tokens) : len(tokens) + rng.randint(1, 4)])
            inc = dec.update(tok, tokens)
            whole = tok.decode(tokens, skip_special_tokens=True)
            assert whole.startswith(inc), (kind, inc, whole)
            if not whole.endswith("\ufffd"):
                assert inc == whole, (kind, inc, whole)


def test_each_step_decodes_a_window_not_the_whole_output():
    """The work per step stays bounded: the decoded windows never cover more than the last two steps' tokens."""
    tok = _bpe(True)
    seen: list[int] = []

    class Counting:
        def decode(self, ids, **kw):
            seen.append(len(ids))
            return tok.decode(ids, **kw)

    ids = tok.encode(" ".join(TEXT[:1] * 20), add_special_tokens=False)
    dec = IncrementalDecoder()
    for n in range(2, len(ids) + 1, 2):
        dec.update(Counting(), ids[:n])
    assert dec.text == tok.decode(ids[: len(ids) // 2 * 2])
    assert max(seen) <= 8, max(seen)  # two steps of 2 tokens, plus a few when a character spans tokens
