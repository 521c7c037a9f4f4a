"""POST /v1/chat/completions: the tokenizer's chat template (or --chat-template's) over the messages, plain or
streamed."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, Request
from jinja2 import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ..engine.generator import Completion, StreamEvent
from .bodies import OffLoopRoute, offload
from .errors import APIError
from .jobs import Run, Served
from .protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatMessage,
    TokenLogprob,
    TopLogprob,
)

__all__ = ["check_chat_template", "encode_messages", "load_chat_template", "router"]

router = APIRouter(route_class=OffLoopRoute)  # large bodies validated off the event loop


class _Reply:
    """How a chat request answers (`Run.respond`)."""

    prefix, response, chunk = "chatcmpl", ChatCompletionResponse, ChatCompletionChunk

    def __init__(self, served: Served, req: ChatCompletionRequest, run: Run):
        self.name = served.namer(req.return_tokens_as_token_ids) if req.logprobs else None
        self.first = [ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content="")) for i in range(run.n)]

    def _top(self, token: int, logprob: float) -> TopLogprob:
        s = self.name(token)
        return TopLogprob(token=s, logprob=logprob, bytes=list(s.encode()))

    def _lp(self, out: Completion | StreamEvent) -> ChatLogprobs | None:
        if self.name is None:
            return None
        tops = out.top_logprobs
        alts = [[] if tops is None else [self._top(a, b) for a, b in tops[j]] for j in range(len(out.token_ids))]
        tokens = zip(out.token_ids, out.raw_logprobs, alts)
        return ChatLogprobs(
            content=[TokenLogprob(**self._top(t, v).model_dump(), top_logprobs=a) for t, v, a in tokens]
        )

    def final(self, index: int, c: Completion) -> ChatChoice:
        message = ChatMessage(content=c.text)
        return ChatChoice(index=index, message=message, finish_reason=c.finish_reason, logprobs=self._lp(c))

    def choice(self, ev: StreamEvent) -> ChatChunkChoice | None:
        lp, c = self._lp(ev) if ev.token_ids else None, ev.completion
        if not (ev.delta or lp or c is not None):
            return None
        reason = c.finish_reason if c is not None else None
        return ChatChunkChoice(
            index=ev.index, delta=ChatDelta(content=ev.delta or None), logprobs=lp, finish_reason=reason
        )


def load_chat_template(arg: str) -> str:
    """--chat-template: a file's contents, or the argument itself when it is a template (a one-line template's
    literal \\n and \\t become newline and tab, as a shell passes them); checked to compile. ValueError for a
    missing file or a template that does not compile."""
    path = Path(arg).expanduser()
    try:
        is_file = path.is_file()
    except OSError:  # e.g. a long template is no valid file name
        is_file = False
    if is_file:
        template = path.read_text()
    elif any(s in arg for s in ("{{", "{%")):
        template = arg if "\n" in arg else arg.replace("\\n", "\n").replace("\\t", "\t")
    else:
        raise ValueError(f"--chat-template {arg!r}: no such file, and no Jinja template either ({{{{ or {{% in it)")
    return check_chat_template(template)


def check_chat_template(template: str) -> str:
    """The template, once it compiles as transformers' apply_chat_template compiles it (its sandbox, with {% break %},
    {% continue %} and {% generation %}), so that every template it renders passes; ValueError otherwise."""
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template as compile_template
    except ImportError:  # a transformers without it: its environment's extensions, all but {% generation %}
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        compile_template = env.parse
    try:
        compile_template(template)
    except TemplateError as e:
        raise ValueError(f"--chat-template: the template does not compile: {e}") from None
    except ImportError as e:  # transformers' compiler needs a newer jinja2
        raise ValueError(f"--chat-template: cannot compile chat templates here: {e}") from None
    return template


def encode_messages(served: Served, messages: list[dict]) -> list[int]:
    """The messages through the chat template; 400 when the template has none or refuses them."""
    try:
        return served.gen.encode(messages, chat=True)
    except (ValueError, TemplateError) as e:  # a template's raise_exception(...) is the request's fault
        raise APIError(400, str(e), "messages") from None


@router.post("/v1/chat/completions")
async def chat(req: ChatCompletionRequest, request: Request):
    """OpenAI chat completions: the messages through the chat template, then speculative decoding (streamed
    as server-sent events when `stream` is true)."""
    served: Served = request.app.state.served
    messages = [{"role": m.role, "content": m.text()} for m in req.messages]
    size = sum(len(m["content"]) for m in messages)
    ids = await offload(size, encode_messages, served, messages)  # the template and tokenizer: off the loop
    if req.top_logprobs and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs=true", "top_logprobs")
    top_n = (req.top_logprobs or 0) if req.logprobs else 0
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    run = await served.submit(req, request, [ids], max_tokens, top_n, "messages")
    return await run.respond(_Reply(served, req, run))
