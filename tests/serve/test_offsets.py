"""Legacy logprobs' text_offset: computed from the decoded text, not from each token decoded alone, in one pass;
and what joins an echoed prompt to its completion."""

from __future__ import annotations

import itertools
import random
from types import SimpleNamespace

from verispec.serve.completions import LegacyLogprobs, joiner, text_offsets


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


class Counting:
    """A decode that counts the tokens it was given."""

    def __init__(self, decode):
        self.decode, self.tokens, self.calls = decode, 0, 0

    def __call__(self, ids):
        self.tokens += len(ids)
        self.calls += 1
        return self.decode(ids)


def _tiny_decode():
    from ..engine.tiny import make_tokenizer

    tok = make_tokenizer()
    return tok, lambda ids: tok.decode(list(ids), skip_special_tokens=True)


def _common(a: str, b: str) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def test_offsets_agree_with_decoding_every_prefix():
    """The incremental offsets are the prefix definition's (token i starts where the text of ids[:i] ends)."""
    tok, decode = _tiny_decode()
    gen = random.Random(0)
    for _ in range(20):
        ids = [gen.randrange(len(tok)) for _ in range(gen.randrange(1, 30))]  # special tokens too
        text = decode(ids)
        cut = text[: gen.randrange(len(text) + 1)]
        for t in (text, cut):
            want = [_common(decode(ids[:i]), t) for i in range(len(ids))]
            assert text_offsets(decode, ids, t) == list(itertools.accumulate(want, max))


def test_echo_and_logprobs_of_a_long_prompt_decode_linearly_once_per_prompt():
    """Echo with logprobs of a 3000-token prompt, 4 choices, and a 3000-token completion streamed a token at a
    time: a few tokens decoded per token (decoding every prefix was 4.5 million per choice)."""
    tok, decode = _tiny_decode()
    n = 3000
    ids = tok(" ".join(chr(97 + i % 26) for i in range(n)), add_special_tokens=False)["input_ids"]
    assert len(ids) == n
    text = decode(ids)
    counting = Counting(decode)
    served = SimpleNamespace(decode=counting, namer=lambda as_ids: str)
    lp = LegacyLogprobs(served, 4, 0)
    echoes = [lp.echo(i, 0, ids, text, None) for i in range(4)]
    assert counting.tokens <= 4 * n  # once for the prompt, not per choice
    assert all(e.text_offset == echoes[0].text_offset for e in echoes)
    assert echoes[0].text_offset == [max(2 * i - 1, 0) for i in range(n)]  # "a b c ...": "a", " b", " c", ...
    counting.tokens = 0
    lp.glue[1] = 1  # the echo's " " between prompt and completion (`joiner`), as the handler sets it
    deltas = [decode([t]) if i == 0 else " " + decode([t]) for i, t in enumerate(ids)]  # the engine's, streamed
    offsets = [o for t, d in zip(ids, deltas) for o in lp.add(1, [t], d, [0.0], None).text_offset]
    assert counting.tokens <= 4 * n
    assert offsets == [len(text) + 2 * i for i in range(n)]  # after the prompt and its " "


def test_joiner_is_what_decoding_after_the_prompt_adds():
    tok, decode = _tiny_decode()
    a, b, c = (tok.convert_tokens_to_ids(w) for w in "abc")
    assert joiner(decode, [a, b, c, a], [b, c]) == " "  # "a b c a" + "b c" reads "a b c a b c"
    assert joiner(decode, [a], [tok.eos_token_id, b]) == " "  # a skipped special token first: the next one's
    assert joiner(decode, [], [b]) == "" and joiner(decode, [a], []) == ""
    sp = sentencepiece_decode(["▁Hello", "▁wor", "ld"])
    assert joiner(sp, [0], [1, 2]) == " " and joiner(sp, [1], [2]) == ""  # "Hello" + "world"; "wor" + "ld"
    assert joiner(byte_decode([b"caf", b"\xc3", b"\xa9"]), [0], [1, 2]) == ""  # byte-level: nothing between
