"""POST /v1/completions (the legacy text completions API), plain or streamed, with legacy logprobs."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

from fastapi import APIRouter, Request

from ..engine.generator import Completion, StreamEvent
from .errors import APIError
from .jobs import Run, Served, usage
from .protocol import CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse

__all__ = ["router", "text_offsets"]

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
    text so far, so that `text_offset` indexes the choice's whole text."""

    def __init__(self, served: Served, n: int, top_n: int, as_ids: bool = False):
        self.served, self.top_n, self.piece = served, top_n, served.namer(as_ids)
        self.ids: list[list[int]] = [[] for _ in range(n)]
        self.text = [""] * n
        self.low = [0] * n

    def add(self, index: int, ids: list[int], text: str, lps: list[float], tops) -> CompletionLogprobs | None:
        """The logprobs of `ids`, new tokens of choice `index` that brought the new `text`; None without tokens."""
        first = len(self.ids[index])
        self.ids[index] += ids
        self.text[index] += text
        if not ids:
            return None
        offsets = text_offsets(self.served.decode, self.ids[index], self.text[index], first, self.low[index])
        self.low[index] = offsets[-1]
        piece = self.piece
        top = [{piece(a): b for a, b in alts} for alts in tops] if self.top_n and tops is not None else None
        return CompletionLogprobs(
            tokens=[piece(t) for t in ids], token_logprobs=lps, top_logprobs=top, text_offset=offsets
        )


class _Reply:
    def __init__(self, served: Served, req: CompletionRequest, run: Run):
        as_ids = req.return_tokens_as_token_ids
        lp = LegacyLogprobs(served, run.n, req.logprobs or 0, as_ids) if req.logprobs is not None else None
        self.logprobs = lp
        self.prompt_tokens = run.prompt_tokens
        self.chunk = partial(
            CompletionResponse, id=f"cmpl-{run.job.id}", created=int(run.job.created), model=served.model_id
        )

    def _lp(self, index: int, ids: list[int], text: str, lps: list[float], tops) -> CompletionLogprobs | None:
        return None if self.logprobs is None else self.logprobs.add(index, ids, text, lps, tops)

    def answer(self, done: list[Completion]) -> CompletionResponse:
        choices = [
            CompletionChoice(
                index=i,
                text=c.text,
                finish_reason=c.finish_reason,
                logprobs=self._lp(i, c.token_ids, c.text, c.raw_logprobs, c.top_logprobs),
            )
            for i, c in enumerate(done)
        ]
        return self.chunk(choices=choices, usage=usage(self.prompt_tokens, done))

    def choice(self, ev: StreamEvent) -> CompletionChoice | None:
        lp = self._lp(ev.index, ev.token_ids, ev.delta, ev.raw_logprobs, ev.top_logprobs)
        c = ev.completion
        if not (ev.delta or lp or c is not None):
            return None
        return CompletionChoice(
            index=ev.index, text=ev.delta, logprobs=lp, finish_reason=c.finish_reason if c is not None else None
        )


@router.post("/v1/completions")
async def completions(req: CompletionRequest, request: Request):
    served: Served = request.app.state.served
    try:
        ids = served.gen.encode(req.prompt)
    except ValueError as e:
        raise APIError(400, str(e), "prompt") from None
    run = served.submit(req, request, ids, req.max_tokens, req.logprobs or 0, "prompt")
    reply = _Reply(served, req, run)
    return await run.respond(reply.answer, reply.choice, reply.chunk)
