"""POST /v1/completions (the legacy text completions API), plain or streamed, with legacy logprobs.

`prompt`: a string, a list of strings, token ids, or a list of lists of token ids; the choices are indexed
prompt-major (prompt p's choice j is index p * n + j) and usage sums over them. `echo`: each choice's text starts
with its prompt (as sent; token ids decoded), and with `logprobs` its logprobs start with the prompt's tokens (the
first one's null), scored by one target forward (`serve.scoring`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

from fastapi import APIRouter, Request

from ..engine.generator import Completion, StreamEvent
from .engine import PromptLogprobs
from .errors import APIError
from .jobs import Run, Served, usage
from .protocol import CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse

__all__ = ["prompt_list", "router", "text_offsets"]

router = APIRouter()


def text_offsets(
    decode: Callable[[list[int]], str], ids: Sequence[int], text: str, first: int = 0, low: int = 0
) -> list[int]:
    """Where each token of ids[first:] starts in `text`, the text decoded from ids (or as much of it as the
    client has: cut at a stop string, or held back while a stop string may be starting).

    Token i starts where the text of ids[:i] ends, as far as that text agrees with `text`. Decoding the prefix,
    not each token alone, gets SentencePiece's spaces, WordPiece's joins and characters split over several
    tokens right (a split character belongs to the token that completes it). Monotone, from `low` on (the
    previous offset when streaming), never past len(text)."""
    out = []
    for i in range(first, len(ids)):
        prefix = decode(list(ids[:i])) if i else ""
        low = max(low, _agreeing(prefix, text))
        out.append(low)
    return out


def _agreeing(a: str, b: str) -> int:
    """How many leading characters a and b share."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    return next(i for i in range(n) if a[i] != b[i])


class LegacyLogprobs:
    """One request's legacy logprobs, choice by choice and (streamed) event by event: each choice's tokens and
    text so far, so that `text_offset` indexes the choice's whole text (after its echoed prompt, if any)."""

    def __init__(self, served: Served, n: int, top_n: int, as_ids: bool = False):
        self.served, self.top_n, self.piece = served, top_n, served.namer(as_ids)
        self.ids: list[list[int]] = [[] for _ in range(n)]
        self.text = [""] * n
        self.low = [0] * n
        self.shift = [0] * n  # characters before the completion's own text: the echoed prompt

    def _top(self, tops) -> list | None:
        if not self.top_n or tops is None:
            return None
        return [None if alts is None else {self.piece(a): b for a, b in alts} for alts in tops]

    def add(self, index: int, ids: list[int], text: str, lps: list[float], tops) -> CompletionLogprobs | None:
        """The logprobs of `ids`, new tokens of choice `index` that brought the new `text`; None without tokens."""
        first = len(self.ids[index])
        self.ids[index] += ids
        self.text[index] += text
        if not ids:
            return None
        offsets = text_offsets(self.served.decode, self.ids[index], self.text[index], first, self.low[index])
        self.low[index] = offsets[-1]
        shift = self.shift[index]
        return CompletionLogprobs(
            tokens=[self.piece(t) for t in ids],
            token_logprobs=lps,
            top_logprobs=self._top(tops),
            text_offset=[o + shift for o in offsets],
        )

    def echo(self, index: int, ids: list[int], text: str, scored: PromptLogprobs | None) -> CompletionLogprobs:
        """The echoed prompt's logprobs for choice `index` (the first token's are None; all are None when the
        prompt was never scored: a request cut short before it ran); the completion's offsets then follow `text`."""
        self.shift[index] = len(text)
        lps = scored.logprobs if scored is not None else [None] * len(ids)
        tops = scored.top if scored is not None else [None] * len(ids)
        return CompletionLogprobs(
            tokens=[self.piece(t) for t in ids],
            token_logprobs=lps,
            top_logprobs=self._top(tops),
            text_offset=text_offsets(self.served.decode, ids, text),
        )


def _join(a: CompletionLogprobs | None, b: CompletionLogprobs | None) -> CompletionLogprobs | None:
    if a is None or b is None:
        return a or b
    top = None if a.top_logprobs is None else a.top_logprobs + (b.top_logprobs or [])
    return CompletionLogprobs(
        tokens=a.tokens + b.tokens,
        token_logprobs=a.token_logprobs + b.token_logprobs,
        top_logprobs=top,
        text_offset=a.text_offset + b.text_offset,
    )


class _Reply:
    def __init__(self, served: Served, req: CompletionRequest, run: Run, echo: list[tuple[list[int], str]] | None):
        as_ids = req.return_tokens_as_token_ids
        lp = LegacyLogprobs(served, run.n, req.logprobs or 0, as_ids) if req.logprobs is not None else None
        self.logprobs, self.run, self.echo, self.per_prompt = lp, run, echo, req.n
        self.echoed: set[int] = set()  # (streamed) choices whose prompt has been sent
        self.chunk = partial(
            CompletionResponse, id=f"cmpl-{run.job.id}", created=int(run.job.created), model=served.model_id
        )

    def _lp(self, index: int, ids: list[int], text: str, lps: list[float], tops) -> CompletionLogprobs | None:
        return None if self.logprobs is None else self.logprobs.add(index, ids, text, lps, tops)

    def _prefix(self, index: int) -> tuple[str, CompletionLogprobs | None]:
        """What choice `index` starts with: its echoed prompt's text and logprobs (once per choice)."""
        if self.echo is None or index in self.echoed:
            return "", None
        self.echoed.add(index)
        p = index // self.per_prompt
        ids, text = self.echo[p]
        if self.logprobs is None:
            return text, None
        return text, self.logprobs.echo(index, ids, text, self.run.prompt_logprobs.get(p))

    def answer(self, done: list[Completion]) -> CompletionResponse:
        choices = []
        for i, c in enumerate(done):
            text, head = self._prefix(i)
            lp = self._lp(i, c.token_ids, c.text, c.raw_logprobs, c.top_logprobs)
            choices.append(
                CompletionChoice(index=i, text=text + c.text, finish_reason=c.finish_reason, logprobs=_join(head, lp))
            )
        return self.chunk(choices=choices, usage=usage(self.run.prompt_tokens, done))

    def choice(self, ev: StreamEvent) -> CompletionChoice | None:
        text, head = self._prefix(ev.index)
        lp = _join(head, self._lp(ev.index, ev.token_ids, ev.delta, ev.raw_logprobs, ev.top_logprobs))
        c = ev.completion
        if not (text or ev.delta or lp or c is not None):
            return None
        return CompletionChoice(
            index=ev.index,
            text=text + ev.delta,
            logprobs=lp,
            finish_reason=c.finish_reason if c is not None else None,
        )


def prompt_list(prompt: str | list) -> list[str | list[int]]:
    """The request's prompts: a string, a list of strings, a list of token ids (one prompt), or a list of lists of
    token ids; 400 naming the first element of another kind than the first one's."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt must not be empty", "prompt")
    kind = type(prompt[0])
    for i, p in enumerate(prompt):
        if type(p) is not kind:
            raise APIError(
                400,
                f"prompt[{i}]: a list of prompts holds strings, token ids or lists of token ids, not a mix",
                f"prompt[{i}]",
            )
    return [list(prompt)] if kind is int else list(prompt)


def _encode(served: Served, prompts: list[str | list[int]]) -> list[list[int]]:
    out = []
    for i, p in enumerate(prompts):
        name = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
        try:
            out.append(served.gen.encode(p))
        except ValueError as e:
            raise APIError(400, str(e) if len(prompts) == 1 else f"{name}: {e}", name) from None
    return out


@router.post("/v1/completions")
async def completions(req: CompletionRequest, request: Request):
    served: Served = request.app.state.served
    prompts = prompt_list(req.prompt)
    ids = _encode(served, prompts)
    score_top = None
    if req.echo and req.logprobs is not None:
        if (why := served.scorer.unavailable) is not None:
            raise APIError(400, f"echo with logprobs: {why}", "echo")
        score_top = req.logprobs
    run = served.submit(req, request, ids, req.max_tokens, req.logprobs or 0, "prompt", score_top)
    echo = [(t, p if isinstance(p, str) else served.decode(t)) for p, t in zip(prompts, ids)] if req.echo else None
    reply = _Reply(served, req, run, echo)
    return await run.respond(reply.answer, reply.choice, reply.chunk)
