"""OpenAI-compatible request and response bodies (pydantic).

Requests: unknown fields are refused (400 naming the field): a sampling option the server cannot honour must
never be silently ignored. Responses: what the handlers return, field for field what OpenAI's API sends
(plus `usage.speculation`); stream chunks leave out what OpenAI leaves out (a chunk's `usage` until the last,
a delta's unset `role` / `content`)."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Generic, Literal, TypeVar

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictInt, model_serializer

MAX_SPECULATIVE_TOKENS = 64  # a per-request draft length above this is refused (as `--gamma` above 64 is)
# Caps checked when the body is validated, before any tokenizing (the body itself: --max-request-bytes)
MAX_PROMPTS = 1024  # prompts in one request (completions' list, /generate/'s)
MAX_STOP = 16384  # stop strings (matched by one automaton: the cost per step does not grow with their number)
MAX_STOP_CHARS = 1024  # characters in one stop string (the text a stream holds back is shorter)
MAX_BAD_WORDS = 128  # bad_words strings (vLLM's limit; each gives up to two token sequences)
MAX_WORD_CHARS = 1024  # characters in one bad word
MAX_TOKEN_LIST = 1 << 18  # allowed_token_ids / stop_token_ids entries (more than any vocabulary)
MAX_LOGIT_BIAS = 1024  # logit_bias entries
MAX_MESSAGES = 4096  # chat messages in one request


def _unicode(text: str) -> str:
    """A string that UTF-8 can encode: JSON's \\ud800 escapes decode to lone surrogates, which no tokenizer takes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(
            f"not valid Unicode: a lone surrogate U+{ord(text[e.start]):04X} at character {e.start}"
        ) from None
    return text


Text = Annotated[str, AfterValidator(_unicode)]  # every string a request sends
Stop = Annotated[str, Field(max_length=MAX_STOP_CHARS), AfterValidator(_unicode)]
StopList = Text | Annotated[list[Stop], Field(max_length=MAX_STOP)] | None

# --- requests ----------------------------------------------------------------------------------------------


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: Text
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = Field(1, ge=1, le=16)
    stop: StopList = None
    seed: StrictInt | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Annotated[dict[Text, float], Field(max_length=MAX_LOGIT_BIAS)] | None = (
        None  # {"token id": bias in [-100, 100]}, added to the logits
    )
    user: Text | None = None  # metadata only
    # extra fields (send with the openai client's extra_body=)
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    allowed_token_ids: Annotated[list[StrictInt], Field(max_length=MAX_TOKEN_LIST)] | None = (
        None  # vLLM's: only these tokens may be sampled
    )
    bad_words: (
        Annotated[list[Annotated[Text, Field(max_length=MAX_WORD_CHARS)]], Field(max_length=MAX_BAD_WORDS)] | None
    ) = None  # vLLM's: never produced (tokenized with and without a leading space)
    # this request's draft length; 0 turns speculation off; the server caps it at its own maximum
    num_speculative_tokens: StrictInt | None = Field(None, ge=0, le=MAX_SPECULATIVE_TOKENS)
    ignore_eos: bool = False
    # vLLM's: token ids that end a choice like EOS (finish_reason "stop", the token not in the text), even with
    # ignore_eos
    stop_token_ids: Annotated[list[StrictInt], Field(max_length=MAX_TOKEN_LIST)] | None = None
    # vLLM's extension: logprobs' `token` fields as "token_id:N" (exact ids, for RL trainers and certifiers)
    return_tokens_as_token_ids: bool = False


class CompletionRequest(_Common):
    # a string, a list of strings, token ids, or a list of lists of token ids (a mix is refused by the handler)
    prompt: Text | Annotated[list[Text | StrictInt | list[StrictInt]], Field(max_length=MAX_TOKEN_LIST)]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False


class TextContent(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: Text


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant"]
    content: Text | list[TextContent]
    name: Text | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(c.text for c in self.content)


class ChatCompletionRequest(_Common):
    messages: list[Message] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)


# --- responses ---------------------------------------------------------------------------------------------


class _OmitNone(BaseModel):
    """Serialises without the fields in `omit_if_none` that are None (OpenAI leaves them out, not null)."""

    omit_if_none: ClassVar[tuple[str, ...]] = ()

    @model_serializer(mode="wrap")
    def _omit(self, handler) -> dict[str, Any]:
        data = handler(self)
        return {k: v for k, v in data.items() if v is not None or k not in self.omit_if_none}


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class ModelCard(BaseModel):
    """One entry of GET /v1/models."""

    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str = "verispec"
    max_model_len: int | None = None  # the context, in tokens (vLLM's field)


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class Speculation(BaseModel):
    """`usage.speculation`: the request's speculative decoding, summed over its choices."""

    draft_tokens: int
    accepted_tokens: int
    acceptance_rate: float | None
    target_passes: int
    tokens_per_pass: float | None  # tau: tokens each target pass produced (EOS included), >= 1


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    speculation: Speculation


class _Choice(BaseModel):
    index: int
    finish_reason: str | None = None  # None in the stream chunks before a choice's last


C = TypeVar("C", bound=_Choice)


class _Envelope(_OmitNone, Generic[C]):
    """What every completion response and stream chunk carries; `usage` is left out of the chunks before the
    last."""

    omit_if_none: ClassVar[tuple[str, ...]] = ("usage", "weight_version")
    id: str
    object: str
    created: int
    model: str
    choices: list[C]
    usage: Usage | None = None
    weight_version: int | None = None  # (extension) the target's weights every choice was drawn under


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]  # None: an echoed prompt's first token
    top_logprobs: list[dict[str, float] | None] | None
    text_offset: list[int]  # where each token starts in the choice's text


class CompletionChoice(_Choice):
    text: Text
    logprobs: CompletionLogprobs | None = None


class CompletionResponse(_Envelope[CompletionChoice]):
    """A completion, or (stream) one chunk of it."""

    object: Literal["text_completion"] = "text_completion"


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class ChatMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class _ChatChoice(_Choice):
    logprobs: ChatLogprobs | None = None


class ChatChoice(_ChatChoice):
    message: ChatMessage


class ChatCompletionResponse(_Envelope[ChatChoice]):
    object: Literal["chat.completion"] = "chat.completion"


class ChatDelta(_OmitNone):
    omit_if_none: ClassVar[tuple[str, ...]] = ("role", "content")
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(_ChatChoice):
    delta: ChatDelta


class ChatCompletionChunk(_Envelope[ChatChunkChoice]):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
