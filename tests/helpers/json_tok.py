"""A tiny character-level tokenizer for structured-output tests (vocabulary 64, built locally): its text is the
concatenation of its tokens, so a grammar over text (JSON, a regex) and the engine's decoded text agree. A few
multi-character tokens ('{"', '":', '",', 'true', ...) give a text several tokenizations, as real vocabularies do."""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

from .tiny import make_model

SPECIALS = ["<unk>", "<s>", "</s>"]
CHARS = list('{}[]:," ') + [str(d) for d in range(10)] + [chr(97 + i) for i in range(26)]  # 44
MERGES = [("{", '"'), ('"', ":"), ('"', ","), ('"', "}"), ("t", "r"), ("tr", "u"), ("tru", "e"), ("n", "u"),
          ("nu", "l"), ("nul", "l"), ("f", "a"), ("fa", "l"), ("fal", "s"), ("fals", "e"), ("a", "b"), ("1", "0"),
          ("e", "n")]  # fmt: skip
WORDS = SPECIALS + CHARS + ["".join(m) for m in MERGES]  # 64 tokens
V = len(WORDS)
EOS = 2


def make_json_tokenizer() -> PreTrainedTokenizerFast:
    """A BPE tokenizer over WORDS (no pre-tokenizer: the merges make the multi-character tokens)."""
    vocab = {w: i for i, w in enumerate(WORDS)}
    tk = Tokenizer(models.BPE(vocab, [(a, b) for a, b in MERGES], unk_token="<unk>"))
    tk.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    return tok


def json_model(seed: int, **kw):
    """A random 2-layer Llama over this vocabulary (see tiny.make_model; `scale` sharpens it)."""
    return make_model(seed, vocab=V, **kw)
