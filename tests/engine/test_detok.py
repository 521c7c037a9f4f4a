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


class _Bytes:
    """A tokenizer whose tokens are byte strings (a multi-byte character can split over tokens)."""

    clean_up_tokenization_spaces = False

    def __init__(self, pieces):
        self.pieces = pieces

    def decode(self, ids, skip_special_tokens=True):
        return b"".join(self.pieces[i] for i in ids).decode("utf-8", errors="replace")


def _row(stop):
    import torch

    from verispec.engine.rows import Row
    from verispec.sampling import SamplingParams

    return Row(0, [0], SamplingParams(), torch.Generator(), [0], max_new=16, stop=stop)


def test_a_stop_string_is_seen_in_the_step_that_completes_it_even_before_an_incomplete_character():
    """Step 1 brings "ab", "STOP" and the first byte of a 3-byte character: the stop ends the row in step 1, and
    the tokens after "STOP" are neither kept nor streamed."""
    tok = _Bytes([b"ab", b"STOP", b"\xe6", b"\x9d\xb1", b"zz"])
    row = _row(("STOP",))
    row.take([0, 1, 2], [0.0] * 3, [0.0] * 3, None, set(), None)
    event = row.event(tok, 0)
    assert row.done is not None and row.done.token_ids == [0, 1] and row.done.text == "ab"
    assert event.token_ids == [0, 1] and event.delta == "ab"


def test_a_character_split_over_steps_is_streamed_once_complete():
    tok = _Bytes([b"ab", b"\xe6", b"\x9d\xb1", b"zz"])
    row = _row(())
    deltas = []
    for step in ([0, 1], [2], [3]):
        before = len(row.tokens)
        row.take(step, [0.0] * len(step), [0.0] * len(step), None, set(), None)
        deltas.append(row.event(tok, before).delta)
    assert deltas == ["ab", "\u6771", "zz"]


def test_a_tokenizer_that_cleans_up_spaces_is_decoded_whole():
    """clean_up_tokenization_spaces rewrites text across window edges ("a '" -> "a'"): such a tokenizer's text
    is decoded whole every step (as before incremental decoding), and the completion's text is the full decode."""
    tok = make_tokenizer(["<unk>", "<s>", "</s>", "a", "'", "b", "c", "."])
    tok.clean_up_tokenization_spaces = True
    ids = [3, 4, 5, 6, 7, 3, 4]
    assert tok.decode(ids) != " ".join(tok.convert_ids_to_tokens(ids))  # the clean-up does rewrite
    row = _row(())
    row.max_new = len(ids)
    for i in range(0, len(ids), 2):
        before = len(row.tokens)
        row.take(ids[i : i + 2], [0.0] * 2, [0.0] * 2, None, set(), None)
        row.event(tok, before)
        assert row.detok.whole and row.detok.update(tok, row.tokens) == tok.decode(row.tokens)
    assert row.done is not None and row.done.text == tok.decode(ids)


def test_tokens_that_never_complete_a_character_do_not_grow_the_window():
    """Stray UTF-8 continuation bytes never make a character: the window waits at most MAX_PENDING tokens, so the
    work stays linear (a quadratic decode would read ~n^2 / 2 = 20k tokens here) and the text still equals the whole
    decode."""
    from verispec.engine.rows import MAX_PENDING

    class Counting(_Bytes):
        read = 0

        def decode(self, ids, skip_special_tokens=True):
            Counting.read += len(ids)
            return super().decode(ids)

    tok = Counting([b"a", b"\x9d"])
    ids = [0] + [1] * 200
    dec = IncrementalDecoder()
    for n in range(1, len(ids) + 1):
        dec.update(tok, ids[:n])
    assert Counting.read <= 4 * (MAX_PENDING + 2) * len(ids)
    assert dec.text == _Bytes([b"a", b"\x9d"]).decode(ids)[: len(dec.text)] and len(dec.text) >= 190
