"""OpenAI-compatible request bodies (pydantic). Unknown fields are refused (400 naming the field): a sampling
option the server cannot honour must never be silently ignored."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


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
    user: str | None = None  # metadata only
    # extra fields (send with the openai client's extra_body=)
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    num_speculative_tokens: int | None = Field(None, ge=0)  # this request's draft length; 0 turns speculation off
    ignore_eos: bool = False


class CompletionRequest(_Common):
    prompt: str | list[int]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: Literal[False] = False


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
