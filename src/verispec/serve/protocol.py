"""OpenAI-compatible request and response bodies (pydantic). Requests refuse unknown fields (400 naming the field: an
option the server cannot honour is never silently ignored). Responses are field for field OpenAI's (plus
`usage.speculation`); stream chunks leave out what OpenAI leaves out (`usage` until the last, a delta's unset fields)."""

from __future__ import annotations

import difflib
import json
from typing import Annotated, Any, ClassVar, Generic, Literal, TypeVar

import pydantic
from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, StrictInt

from ..sampling.constraint import MAX_CONSTRAINT_CHARS

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
MAX_CONTENT_PARTS = 16384  # content parts over all of a request's messages (each part costs its validation)
MAX_CHOICES = 4096  # guided_choice / structured_outputs.choice strings (their JSON text: MAX_CONSTRAINT_CHARS)


def _unicode(text: str) -> str:
    """A string that UTF-8 can encode: JSON's \\ud800 escapes decode to lone surrogates, which no tokenizer takes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        why = f"a lone surrogate U+{ord(text[e.start]):04X} at character {e.start}"
        raise ValueError(f"not valid Unicode: {why}") from None
    return text


Text = Annotated[str, AfterValidator(_unicode)]  # every string a request sends
Stop = Annotated[str, Field(max_length=MAX_STOP_CHARS), AfterValidator(_unicode)]
StopList = Text | Annotated[list[Stop], Field(max_length=MAX_STOP)] | None


def _json_text(value: Any) -> Any:
    """A constraint's schema or choice list, capped before any work: its JSON text is at most MAX_CONSTRAINT_CHARS
    characters (`verispec.sampling.constraint`), and every string in it valid Unicode."""
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    if len(text) > MAX_CONSTRAINT_CHARS:
        raise ValueError(f"at most {MAX_CONSTRAINT_CHARS} characters (as JSON text), got {len(text)}")
    _unicode(text)
    return value


ConstraintText = Annotated[str, Field(max_length=MAX_CONSTRAINT_CHARS), AfterValidator(_unicode)]  # regex, grammar
Schema = Annotated[dict[str, Any], AfterValidator(_json_text)]  # a JSON schema object
SchemaOrText = Annotated[dict[str, Any] | ConstraintText, AfterValidator(_json_text)]  # vLLM's: an object or its JSON
ChoiceList = Annotated[list[ConstraintText], Field(min_length=1, max_length=MAX_CHOICES), AfterValidator(_json_text)]


def _backend(name: str) -> str:
    if name not in ("auto", "xgrammar"):
        why = "verispec compiles structured outputs with xgrammar: the backend must be 'auto' or 'xgrammar'"
        raise ValueError(f"{why}, got {name!r}")
    return name


Backend = Annotated[Text, Field(max_length=64), AfterValidator(_backend)]  # "auto" or "xgrammar"; others refused

# --- requests ----------------------------------------------------------------------------------------------


class Strict(BaseModel):
    """A request body (or part of one): unknown fields are refused (`did_you_mean` names the closest known one)."""

    model_config = ConfigDict(extra="forbid")


def _request_fields() -> tuple[str, ...]:
    """Every field name a request body (or a part of one) knows, as clients spell them (aliases): the models of
    every module imported (the server imports them all before it answers)."""
    names, todo = set(), [Strict]
    while todo:
        cls = todo.pop()
        todo += cls.__subclasses__()
        names |= {f.alias or name for name, f in cls.model_fields.items()}
    return tuple(sorted(names))


def did_you_mean(path: str) -> str:
    """For an unknown request field (`temprature`, `messages[0].contnet`): " (did you mean 'temperature'?)" naming the
    closest field a request knows, or "" when none is close."""
    close = difflib.get_close_matches(path.rsplit(".", 1)[-1], _request_fields(), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


class StreamOptions(Strict):
    include_usage: bool = False


class JsonSchemaFormat(Strict):
    """OpenAI's `response_format.json_schema`."""

    name: Annotated[Text, Field(max_length=256)]
    description: Annotated[Text, Field(max_length=MAX_CONSTRAINT_CHARS)] | None = None
    schema_: Schema = Field(alias="schema")
    strict: bool | None = Field(None, description="accepted either way: verispec enforces the schema")


class ResponseFormat(Strict):
    """OpenAI's `response_format`: `{"type": "text"}` (no constraint), `{"type": "json_object"}` (any JSON object),
    or `{"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}`: the output is JSON valid
    under the schema. verispec enforces the schema whether `strict` is true or false (it masks every token the
    schema does not allow), and a choice ends with finish_reason "stop" only where the JSON is complete."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(Strict):
    """vLLM's `structured_outputs`: at most one of json (a schema, object or JSON text), regex, choice, grammar
    (EBNF: xgrammar's dialect, which reads llama.cpp's GBNF), json_object; backend only "auto" or "xgrammar"."""

    json_: SchemaOrText | None = Field(None, alias="json")
    regex: ConstraintText | None = None
    choice: ChoiceList | None = None
    grammar: ConstraintText | None = None
    json_object: StrictBool | None = None
    backend: Backend | None = None


class _Common(Strict):
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
    # {"token id": bias in [-100, 100]}, added to the logits
    logit_bias: Annotated[dict[Text, float], Field(max_length=MAX_LOGIT_BIAS)] | None = None
    user: Text | None = None  # metadata only
    # extra fields (send with the openai client's extra_body=)
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    allowed_token_ids: Annotated[list[StrictInt], Field(max_length=MAX_TOKEN_LIST)] | None = None  # only these
    bad_words: (
        Annotated[list[Annotated[Text, Field(max_length=MAX_WORD_CHARS)]], Field(max_length=MAX_BAD_WORDS)] | None
    ) = None  # vLLM's: never produced (tokenized with and without a leading space)
    # this request's draft length; 0 turns speculation off; the server caps it at its own maximum
    num_speculative_tokens: StrictInt | None = Field(None, ge=0, le=MAX_SPECULATIVE_TOKENS)
    ignore_eos: bool = False
    # vLLM's: token ids that end a choice like EOS (finish_reason "stop", not in the text), even with ignore_eos
    stop_token_ids: Annotated[list[StrictInt], Field(max_length=MAX_TOKEN_LIST)] | None = None
    # vLLM's extension: logprobs' `token` fields as "token_id:N" (exact ids, for RL trainers and certifiers)
    return_tokens_as_token_ids: bool = False
    # structured outputs (at most one constraint per request; `serve.jobs.request_constraint`)
    response_format: ResponseFormat | None = Field(
        None, description="OpenAI's: verispec enforces a json_schema whether strict is true or false"
    )
    structured_outputs: StructuredOutputs | None = None  # vLLM's
    guided_json: SchemaOrText | None = None  # vLLM's older fields, one constraint each
    guided_regex: ConstraintText | None = None
    guided_choice: ChoiceList | None = None
    guided_grammar: ConstraintText | None = None
    guided_decoding_backend: Backend | None = None


class CompletionRequest(_Common):
    # a string, a list of strings, token ids, or a list of lists of token ids (a mix is refused by the handler)
    prompt: Text | Annotated[list[Text | StrictInt | list[StrictInt]], Field(max_length=MAX_TOKEN_LIST)]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False


class TextContent(Strict):
    type: Literal["text"]
    text: Text


class Message(Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: Text | list[TextContent]
    name: Text | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(c.text for c in self.content)


def _content_parts(messages: Any) -> Any:
    """Messages whose list contents hold at most MAX_CONTENT_PARTS parts in all, counted before any is validated."""
    if isinstance(messages, list) and len(messages) <= MAX_MESSAGES:
        lists = (m.get("content") for m in messages if isinstance(m, dict))
        parts = sum(len(c) for c in lists if isinstance(c, list))
        if parts > MAX_CONTENT_PARTS:
            why = f"the messages hold {parts} content parts; a request may send at most {MAX_CONTENT_PARTS}"
            raise ValueError(f"{why} (join adjacent text parts)")
    return messages


Messages = Annotated[list[Message], Field(min_length=1, max_length=MAX_MESSAGES), BeforeValidator(_content_parts)]


class ChatCompletionRequest(_Common):
    messages: Messages
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)


# --- responses ---------------------------------------------------------------------------------------------


class _OmitNone(BaseModel):
    """Serialises without the fields in `omit_if_none` that are None (OpenAI leaves them out, not null)."""

    omit_if_none: ClassVar[tuple[str, ...]] = ()

    @pydantic.model_serializer(mode="wrap")
    def _omit(self, handler) -> dict[str, Any]:
        data = handler(self)
        return {k: v for k, v in data.items() if v is not None or k not in self.omit_if_none}


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
    """What every completion response and stream chunk carries (`usage` only in a stream's last chunk)."""

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
