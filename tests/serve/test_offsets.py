"""Legacy logprobs' text_offset: computed from the decoded text, not from each token decoded alone."""

from __future__ import annotations

from verispec.serve.completions import text_offsets


def sentencepiece_decode(vocab):
    """Llama-style SentencePiece: "▁" is a space, and the decoder drops the text's leading space."""

    def decode(ids):
        text = "".join(vocab[i] for i in ids).replace("▁", " ")
        return text[1:] if text.startswith(" ") else text

    return decode


def byte_decode(vocab):
    """Byte-level BPE: a character's bytes may be split over tokens; a partial one decodes to U+FFFD."""
    return lambda ids: b"".join(vocab[i] for i in ids).decode("utf-8", errors="replace")


def pieces(text, offsets):
    assert offsets == sorted(offsets) and all(0 <= o <= len(text) for o in offsets)
    return [text[a:b] for a, b in zip(offsets, [*offsets[1:], len(text)])]


def test_sentencepiece_spaces():
    decode = sentencepiece_decode(["▁Hello", "▁wor", "ld", "!", "▁the", "re"])
    ids = [0, 1, 2, 3, 4, 5]
    text = decode(ids)
    assert text == "Hello world! there"
    offsets = text_offsets(decode, ids, text)
    assert offsets == [0, 5, 9, 11, 12, 16]  # each token alone ("wor", "the") would give [0, 5, 8, 10, 11, 14]
    assert pieces(text, offsets) == ["Hello", " wor", "ld", "!", " the", "re"]


def test_a_character_split_over_tokens_belongs_to_the_token_that_completes_it():
    decode = byte_decode([b"caf", b"\xc3", b"\xa9", b" ok", b"\xe2\x82", b"\xac"])
    ids = [0, 1, 2, 3, 4, 5]
    text = decode(ids)
    assert text == "café ok€"
    offsets = text_offsets(decode, ids, text)
    assert offsets == [0, 3, 3, 4, 7, 7]
    assert pieces(text, offsets) == ["caf", "", "é", " ok", "", "€"]


def test_streamed_offsets_continue_and_stay_inside_the_text_the_client_has():
    decode = sentencepiece_decode(["▁Hello", "▁wor", "ld", "!", "▁the", "re"])
    ids = [0, 1, 2, 3, 4, 5]
    full = text_offsets(decode, ids, decode(ids))
    head = text_offsets(decode, ids[:3], "Hello world")
    tail = text_offsets(decode, ids, "Hello world! there", first=3, low=head[-1])
    assert head + tail == full
    cut = "Hello wo"  # a stop string cut the text (or the rest is held back while streaming)
    offsets = text_offsets(decode, ids, cut)
    assert offsets == [0, 5, 8, 8, 8, 8] and "".join(pieces(cut, offsets)) == cut
