"""Legacy logprobs' text_offset: the engine's per-token offsets (`StreamEvent.text_offsets`, from its incremental
decoder; tests/engine/test_detok.py) after the echoed prompt, whose tokens the same decoder places in one pass;
and what joins an echoed prompt to its completion."""

from __future__ import annotations

import random
from types import SimpleNamespace

from verispec.engine.rows import IncrementalDecoder
from verispec.serve.completions import LegacyLogprobs, joiner


def sentencepiece_decode(vocab):
    """Llama-style SentencePiece: "▁" is a space, and the decoder drops the text's leading space."""

    def decode(ids):
        text = "".join(vocab[i] for i in ids).replace("▁", " ")
        return text[1:] if text.startswith(" ") else text

    return decode


def byte_decode(vocab):
    """Byte-level BPE: a character's bytes may be split over tokens; a partial one decodes to U+FFFD."""
    return lambda ids: b"".join(vocab[i] for i in ids).decode("utf-8", errors="replace")


class Decoding:
    """A tokenizer made of a decode function (as the engine's decoder calls it)."""

    clean_up_tokenization_spaces = False

    def __init__(self, decode):
        self.fn = decode

    def decode(self, ids, skip_special_tokens=True):
        return self.fn(list(ids))


def pieces(text, offsets):
    assert offsets == sorted(offsets) and all(0 <= o <= len(text) for o in offsets)
    return [text[a:b] for a, b in zip(offsets, [*offsets[1:], len(text)])]


def test_prompt_offsets_keep_sentencepiece_spaces_and_split_characters():
    """An echoed prompt's tokens are placed by the engine's decoder: each token decoded alone ("wor", "the") would
    give [0, 5, 8, 10, 11, 14]; a character split over tokens belongs to the token that completes it."""
    decode = sentencepiece_decode(["▁Hello", "▁wor", "ld", "!", "▁the", "re"])
    text = decode(range(6))
    offsets = IncrementalDecoder.offsets_of(Decoding(decode), list(range(6)))
    assert text == "Hello world! there" and offsets == [0, 5, 9, 11, 12, 16]
    assert pieces(text, offsets) == ["Hello", " wor", "ld", "!", " the", "re"]
    decode = byte_decode([b"caf", b"\xc3", b"\xa9", b" ok", b"\xe2\x82", b"\xac"])
    offsets = IncrementalDecoder.offsets_of(Decoding(decode), list(range(6)))
    assert decode(range(6)) == "café ok€" and offsets == [0, 3, 3, 4, 7, 7]
    assert pieces("café ok€", offsets) == ["caf", "", "é", " ok", "", "€"]


class Counting:
    """A decode that counts the tokens it was given."""

    def __init__(self, decode):
        self.decode, self.tokens, self.calls = decode, 0, 0

    def __call__(self, ids):
        self.tokens += len(ids)
        self.calls += 1
        return self.decode(ids)


def _tiny_decode():
    from ..helpers.tiny import make_tokenizer

    tok = make_tokenizer()
    return tok, lambda ids: tok.decode(list(ids), skip_special_tokens=True)


def _common(a: str, b: str) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def test_prompt_offsets_are_where_decoding_the_tokens_before_ends():
    """Token i starts where the text of ids[:i] ends (special tokens, skipped, too), and an echo's offsets stay inside
    the prompt as sent."""
    tok, decode = _tiny_decode()
    gen = random.Random(0)
    for _ in range(20):
        ids = [gen.randrange(len(tok)) for _ in range(gen.randrange(1, 30))]  # special tokens too
        assert IncrementalDecoder.offsets_of(tok, ids) == [len(decode(ids[:i])) for i in range(len(ids))]
    ids = tok("a b c", add_special_tokens=False)["input_ids"]
    served = SimpleNamespace(gen=SimpleNamespace(tokenizer=tok), namer=lambda as_ids: str)
    assert LegacyLogprobs(served, 1, 0).echo(0, 0, ids, "a b", None).text_offset == [0, 1, 3]  # not past "a b"


def test_echo_and_logprobs_of_a_long_prompt_decode_linearly_once_per_prompt():
    """Echo with logprobs of a 3000-token prompt, 4 choices, and a 3000-token completion streamed a token at a
    time: a few tokens decoded per prompt token, once per prompt (decoding every prefix was 4.5 million), and none
    for the completion's offsets (the engine's events carry them)."""
    tok, decode = _tiny_decode()
    n = 3000
    ids = tok(" ".join(chr(97 + i % 26) for i in range(n)), add_special_tokens=False)["input_ids"]
    assert len(ids) == n
    text = decode(ids)

    class CountingTokenizer:
        clean_up_tokenization_spaces = False
        tokens = 0

        def decode(self, ids, skip_special_tokens=True):
            CountingTokenizer.tokens += len(ids)
            return tok.decode(ids, skip_special_tokens=skip_special_tokens)

    counting = Counting(decode)
    served = SimpleNamespace(gen=SimpleNamespace(tokenizer=CountingTokenizer()), decode=counting, namer=lambda _: str)
    lp = LegacyLogprobs(served, 4, 0)
    echoes = [lp.echo(i, 0, ids, text, None) for i in range(4)]
    assert CountingTokenizer.tokens <= 4 * n  # once for the prompt, not per choice
    assert all(e.text_offset == echoes[0].text_offset for e in echoes)
    assert echoes[0].text_offset == [max(2 * i - 1, 0) for i in range(n)]  # "a b c ...": "a", " b", " c", ...
    CountingTokenizer.tokens = 0
    lp.glue[1] = 1  # the echo's " " between prompt and completion (`joiner`), as the handler sets it
    engine = [max(2 * i - 1, 0) for i in range(n)]  # the completion's own offsets, as its events carry them
    offsets = [o for i, t in enumerate(ids) for o in lp.add(1, [t], engine[i : i + 1], [0.0], None).text_offset]
    assert CountingTokenizer.tokens == counting.tokens == 0
    assert offsets == [len(text) + 2 * i for i in range(n)]  # after the prompt and its " "
    assert lp.add(1, [], [], [], None) is None


def test_joiner_is_what_decoding_after_the_prompt_adds():
    tok, decode = _tiny_decode()
    a, b, c = (tok.convert_tokens_to_ids(w) for w in "abc")
    assert joiner(decode, [a, b, c, a], [b, c]) == " "  # "a b c a" + "b c" reads "a b c a b c"
    assert joiner(decode, [a], [tok.eos_token_id, b]) == " "  # a skipped special token first: the next one's
    assert joiner(decode, [], [b]) == "" and joiner(decode, [a], []) == ""
    sp = sentencepiece_decode(["▁Hello", "▁wor", "ld"])
    assert joiner(sp, [0], [1, 2]) == " " and joiner(sp, [1], [2]) == ""  # "Hello" + "world"; "wor" + "ld"
    assert joiner(byte_decode([b"caf", b"\xc3", b"\xa9"]), [0], [1, 2]) == ""  # byte-level: nothing between
