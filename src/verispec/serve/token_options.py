"""A request's token options as SamplingParams fields: OpenAI's `logit_bias` (string keys of token ids) and vLLM's
`allowed_token_ids` and `bad_words` (strings, tokenized with the served model's tokenizer as vLLM does: each word
alone and with a leading space). Token ids are checked against the served vocabulary, so a bad one is a 400 naming
the field, never an engine error."""

from __future__ import annotations

from ..sampling import ParamError, SamplingParams, bad_words_from_text
from .errors import APIError

__all__ = ["check_token_options", "token_options"]


def token_options(req, tokenizer) -> dict:
    """SamplingParams keyword arguments for the request's logit_bias, allowed_token_ids and bad_words."""
    bias = None
    if req.logit_bias:
        bias = {}
        for key, value in req.logit_bias.items():
            try:
                token = int(key)
            except ValueError:
                raise APIError(
                    400, f"logit_bias keys must be token ids (strings of integers), got {key!r}", "logit_bias"
                ) from None
            bias[token] = value
    words = ()
    if req.bad_words:
        try:
            words = bad_words_from_text(req.bad_words, lambda s: tokenizer.encode(s, add_special_tokens=False))
        except ParamError as e:
            raise APIError.bad_value(e) from None
    return {"logit_bias": bias, "allowed_token_ids": req.allowed_token_ids, "bad_words": words}


def check_token_options(params: SamplingParams, vocab_size: int) -> None:
    """400 naming the field when a token option's id is outside the served vocabulary."""
    try:
        params.check_vocab(vocab_size)
    except ParamError as e:
        raise APIError.bad_value(e) from None
