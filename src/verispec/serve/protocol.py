"""OpenAI-compatible request and response bodies (pydantic).

Requests: unknown fields are refused (400 naming the field): a sampling option the server cannot honour must
never be silently ignored. Responses: what the handlers return, field for field what OpenAI's API sends
(plus `usage.speculation`); stream chunks leave out what OpenAI leaves out (a chunk's `usage` until the last,
a delta's unset `role` / `content`)."""

from __future__ import annotations

from typing import Any, ClassVar, Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, StrictInt, model_serializer

MAX_SPECULATIVE_TOKENS = 64  # a per-request draft length above this is refused (as `--gamma` above 64 is)

# --- requests ----------------------------------------------------------------------------------------------


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = Field(1, ge=1, le=16)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None  # {"token id": bias in [-100, 100]}, added to the logits
    user: str | None = None  # metadata only
    # extra fields (send with the openai client's extra_body=)
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    allowed_token_ids: list[StrictInt] | None = None  # vLLM's: only these tokens may be sampled
    bad_words: list[str] | None = None  # vLLM's: never produced (tokenized with and without a leading space)
    # this request's draft length; 0 turns speculation off; the server caps it at its own maximum
    num_speculative_tokens: StrictInt | None = Field(None, ge=0, le=MAX_SPECULATIVE_TOKENS)
    ignore_eos: bool = False
    # vLLM's: token ids that end a choice like EOS (finish_reason "stop", the token not in the text), even with
    # ignore_eos
    stop_token_ids: list[StrictInt] | None = None
    # vLLM's extension: logprobs' `token` fields as "token_id:N" (exact ids, for RL trainers and certifiers)
    return_tokens_as_token_ids: bool = False


class CompletionRequest(_Common):
    # a string, a list of strings, token ids, or a list of lists of token ids (a mix is refused by the handler)
    prompt: str | list[str | StrictInt | list[StrictInt]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False


class TextContent(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextContent]
    name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(c.text for c in self.content)


class ChatCompletionRequest(_Common):
    messages: list[Message] = Field(min_length=1)
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
    text: str
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
