"""The incremental detokenizer against whole-output decoding, on locally trained byte-level and SentencePiece-style
tokenizers (multi-byte characters split over tokens, leading spaces) and the tests' word-level one."""

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from verispec.engine.rows import IncrementalDecoder

from ..helpers.tiny import make_tokenizer

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
    # (a byte-level alphabet must stay whole: a byte outside it would be dropped, not split)
    limit = {} if byte_level else {"limit_alphabet": 40}
    trainer = trainers.BpeTrainer(
        vocab_size=len(specials) + 300, special_tokens=specials, initial_alphabet=alphabet, **limit
    )
    tk.train_from_iterator(TEXT * 4, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="</s>", unk_token="<unk>")
    for text in TEXT:  # the tests below mean nothing on a tokenizer that loses characters
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text, text
    return tok


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


# --- per-token text offsets (StreamEvent.text_offsets, Completion.text_offsets) ------------------------------------


def _run(tok, ids, steps, stop=(), eos=()):
    """A row fed `ids` in steps of the given sizes (cycled): its events, the text streamed after each, and its end."""
    row = _row(tuple(stop))
    row.max_new = len(ids)
    events, shown, streamed = [], [], ""
    i = 0
    while row.done is None:
        n = steps[len(events) % len(steps)]
        before = len(row.tokens)
        row.take(ids[i : i + n], [0.0] * n, [0.0] * n, None, set(eos), None)
        i += n
        events.append(row.event(tok, before))
        streamed += events[-1].delta
        shown.append(streamed)
    return events, shown, row.done


def _prefix_offsets(tok, ids):
    """Token i's offset by definition: the length of the whole decode of ids[:i] (its complete characters)."""
    return [len(tok.decode(ids[:i], skip_special_tokens=True).rstrip("\ufffd")) for i in range(len(ids))]


def _check_offsets(tok, ids, text, offsets) -> int:
    """Each offset against the whole decode of the tokens before it, where that is well-defined; returns how many
    were. Complete text: its length; then a trailing incomplete character (U+FFFD): the length of the complete
    ones. After stray bytes (U+FFFD that stays, as a vocabulary the trainer left without some bytes makes; windows
    and a whole decode may group them differently) the offsets are only in order, inside the text."""
    assert offsets == sorted(offsets) and len(offsets) == len(ids) and offsets[-1:] <= [len(text)], offsets
    checked = 0
    for i, o in enumerate(offsets):
        p = tok.decode(ids[:i], skip_special_tokens=True)
        complete = p.rstrip("\ufffd")
        if "\ufffd" not in complete and (p == complete or not text[len(complete) :].startswith("\ufffd")):
            assert text.startswith(complete) and o == len(complete), (i, o, complete, text)
            checked += 1
    return checked


@pytest.mark.parametrize("kind", ["byte-level", "sentencepiece", "word-level"])
def test_event_offsets_are_where_the_whole_decode_of_the_tokens_before_ends(kind):
    """Fed 1-4 tokens a step (EOS kept as an invisible token): each token's offset in the completion is the length
    of decode(tokens before it), its complete characters (`_check_offsets`); streamed, the same up to the text
    streamed so far."""
    tok = make_tokenizer() if kind == "word-level" else _bpe(kind == "byte-level")
    texts = TEXT if kind != "word-level" else ["a b c x0 d e", "z y x1 b"]
    rng = random.Random(1)
    checked = total = 0
    for text in texts:
        ids = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id] + tok.encode(text[::-1])
        steps = [rng.randint(1, 4) for _ in range(7)]
        events, shown, done = _run(tok, ids, steps)
        assert done.token_ids == ids
        checked += _check_offsets(tok, ids, done.text, done.text_offsets)
        total += len(ids)
        n = 0  # each event's offsets: the completion's, up to the text streamed then (stray bytes wait to the end)
        for e, seen in zip(events, shown):
            assert e.text_offsets == [min(o, len(seen)) for o in done.text_offsets[n : n + len(e.token_ids)]]
            n += len(e.token_ids)
    # (the trained byte-level vocabulary lacks some bytes: a third to most of its offsets come after stray ones)
    assert checked == total if kind == "word-level" else checked >= total // 10, (checked, total)


def test_a_character_split_over_tokens_belongs_to_the_token_that_completes_it():
    """Token i starts where the complete characters of tokens[:i] end: "\\xc3" and "\\xa9" both start at "é"."""
    tok = _Bytes([b"caf", b"\xc3", b"\xa9", b" ok", b"\xe2\x82", b"\xac", b"\xf0\x9f", b"\x98", b"\x80!"])
    ids = list(range(9))
    for steps in ([1], [2], [3], [1, 4], [9]):
        events, _, done = _run(tok, ids, steps)
        assert done.text == "café ok€😀!"
        assert done.text_offsets == [0, 3, 3, 4, 7, 7, 8, 8, 8] == [o for e in events for o in e.text_offsets]
        assert [done.text[a:b] for a, b in zip(done.text_offsets, [*done.text_offsets[1:], None])] == [
            "caf", "", "é", " ok", "", "€", "", "", "😀!"
        ]  # fmt: skip
    assert IncrementalDecoder.offsets_of(tok, ids) == done.text_offsets


class _SentencePiece(_Bytes):
    """Llama-style SentencePiece: "▁" is a space, and the decoder drops the text's leading space."""

    def decode(self, ids, skip_special_tokens=True):
        text = "".join(self.pieces[i] for i in ids).replace("▁", " ")
        return text[1:] if text.startswith(" ") else text


def test_sentencepiece_offsets_keep_the_space_before_a_word():
    """Each token decoded alone ("wor", "the") would give [0, 5, 8, 10, 11, 14]: decoded after its window, it keeps
    the space before it."""
    tok = _SentencePiece(["▁Hello", "▁wor", "ld", "!", "▁the", "re"])
    for steps in ([1], [2], [3, 1], [6]):
        events, _, done = _run(tok, list(range(6)), steps)
        assert done.text == "Hello world! there"
        assert done.text_offsets == [0, 5, 9, 11, 12, 16] == [o for e in events for o in e.text_offsets]


def test_offsets_at_a_stop_string_stay_inside_the_cut_text_and_the_streamed_one():
    """The text is cut at "STOP" (the tokens after the one completing it are dropped): the offsets of the tokens in
    it point at the cut's end. While streaming, a possible stop string's start is held back, and so are the
    offsets of tokens in it; when it turns out no stop string, they follow it."""
    tok = _Bytes([b"ab", b" S", b"T", b"O", b"P", b"zz", b"x"])
    for steps in ([1], [2], [6]):
        events, shown, done = _run(tok, [0, 1, 2, 3, 4, 5], steps, stop=["STOP"])
        assert done.finish_reason == "stop" and done.text == "ab " and done.token_ids == [0, 1, 2, 3, 4]
        assert done.text_offsets == [0, 2, 3, 3, 3] == [o for e in events for o in e.text_offsets]
    events, shown, done = _run(tok, [0, 1, 2, 6, 5], [1], stop=["STOP"])
    assert done.text == "ab STxzz" and done.text_offsets == [0, 2, 4, 5, 6] == _prefix_offsets(tok, [0, 1, 2, 6, 5])
    streamed = [o for e in events for o in e.text_offsets]
    assert streamed == [0, 2, 3, 5, 6]  # "T" came while " ST" could start "STOP": only "ab " was streamed then
    assert all(o <= len(seen) for e, seen in zip(events, shown) for o in e.text_offsets)


def test_event_offsets_cost_a_few_window_decodes_per_token():
    """3000 tokens, 4 a step: a few tokens decoded per token (decoding every prefix would be ~4.5 million)."""

    class Counting:
        clean_up_tokenization_spaces = False
        read = 0

        def decode(self, ids, skip_special_tokens=True):
            Counting.read += len(ids)
            return tok.decode(ids, skip_special_tokens=skip_special_tokens)

    tok = make_tokenizer()
    ids = [3 + i % 26 for i in range(3000)]
    *_, done = _run(Counting(), ids, [4])
    assert done.text_offsets == [max(2 * i - 1, 0) for i in range(len(ids))]  # "a", " b", " c", ...
    assert Counting.read <= 10 * len(ids), Counting.read  # the windows, and the completion's one whole decode


def test_a_tokenizer_that_cleans_up_spaces_still_gets_offsets_from_the_windows():
    """Its text is decoded whole every step, its offsets come from the windows (reset to the whole text after each
    step): where the whole decode of the tokens before one is a prefix of the text, the offset is its length; the
    others stay in order inside the text. A prompt's offsets (`offsets_of`) take no whole decode at all."""
    tok = make_tokenizer(["<unk>", "<s>", "</s>", "a", "'", "b", "c", ".", "s"])
    tok.clean_up_tokenization_spaces = True
    rng = random.Random(2)
    for _ in range(30):
        ids = [rng.randrange(3, 9) for _ in range(rng.randrange(2, 16))]
        events, _, done = _run(tok, ids, [rng.randint(1, 4)])
        assert done.text == tok.decode(ids, skip_special_tokens=True)
        offsets = done.text_offsets
        assert offsets == sorted(offsets) and offsets[-1] <= len(done.text)
        for i, want in enumerate(_prefix_offsets(tok, ids)):
            if done.text.startswith(tok.decode(ids[:i], skip_special_tokens=True)) and i in _step_starts(events):
                assert offsets[i] == want, (tok.convert_ids_to_tokens(ids), i)

    class Counting:
        clean_up_tokenization_spaces = True
        read = 0

        def decode(self, ids, skip_special_tokens=True):
            Counting.read += len(ids)
            return tok.decode(ids, skip_special_tokens=skip_special_tokens)

    ids = [3 + i % 6 for i in range(2000)]
    assert len(IncrementalDecoder.offsets_of(Counting(), ids)) == len(ids) and Counting.read <= 4 * len(ids)


def _step_starts(events):
    """The indices of each event's first token."""
    starts, n = set(), 0
    for e in events:
        starts.add(n)
        n += len(e.token_ids)
    return starts
