"""POST /v1/completions (the legacy text completions API), plain or streamed, with legacy logprobs.

`prompt`: a string, a list of strings, token ids, or a list of lists of token ids; the choices are indexed
prompt-major (prompt p's choice j is index p * n + j) and usage sums over them (each prompt once). `echo`: each
choice's text starts with its prompt (as sent; token ids decoded), then the completion as decoded after the prompt
(`joiner`: "a b" + "c" reads "a b c" with a tokenizer that spaces words), and with `logprobs` its logprobs start
with the prompt's tokens (the first one's null), scored by one target forward (`serve.scoring`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

from fastapi import APIRouter, Request

from ..engine.generator import Completion, StreamEvent
from ..engine.rows import IncrementalDecoder
from .bodies import OffLoopRoute, offload
from .engine import PromptLogprobs
from .errors import APIError
from .jobs import Run, Served, usage
from .protocol import MAX_PROMPTS, CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse

__all__ = ["LegacyLogprobs", "joiner", "prompt_list", "router"]

router = APIRouter(route_class=OffLoopRoute)  # large bodies validated off the event loop
_TAIL = 8  # echo: the prompt tokens decoded before a completion's first ones (its decoding context)
_HEAD = 16  # echo: at most this many completion tokens are tried to find what joins it to the prompt


def joiner(decode: Callable[[list[int]], str], tail: Sequence[int], ids: Sequence[int]) -> str:
    """What decoding a completion after its prompt puts before the completion's own text (decoded alone): the
    space a WordPiece or SentencePiece tokenizer sets between words, nothing for byte-level BPE. So an echoed
    choice reads prompt text + this + its text, as decode(prompt + completion) does (vLLM's detokenizer decodes a
    completion with the prompt's last tokens before it). Found on the completion's shortest head that decodes to
    whole visible text, after `tail`, the prompt's last tokens; "" when there is none."""
    before = decode(list(tail))
    for k in range(1, min(len(ids), _HEAD) + 1):
        alone = decode(list(ids[:k]))
        if not alone or alone.endswith("\ufffd"):
            continue
        after = decode([*tail, *ids[:k]])
        if after.startswith(before) and after.endswith(alone) and len(after) >= len(before) + len(alone):
            return after[len(before) : len(after) - len(alone)]
        return ""
    return ""


class LegacyLogprobs:
    """One request's legacy logprobs, choice by choice and (streamed) event by event. `text_offset` indexes the
    choice's whole text: the engine's offsets of its tokens in its own text (`StreamEvent.text_offsets`,
    `Completion.text_offsets`, from the engine's incremental decoder), after its echoed prompt and what joins the
    two, if any; the echoed prompt's tokens are placed by the same decoder (`IncrementalDecoder.offsets_of`)."""

    def __init__(self, served: Served, n: int, top_n: int, as_ids: bool = False):
        self.served, self.top_n, self.piece = served, top_n, served.namer(as_ids)
        self.shift = [0] * n  # characters before the completion's own text: the echoed prompt
        self.glue = [0] * n  # and what joins the two (`joiner`): before the completion's tokens but its first
        self._echoed: dict[tuple[int, bool], CompletionLogprobs] = {}  # the prompts' (the same for their choices)

    def _top(self, tops) -> list | None:
        if not self.top_n or tops is None:
            return None
        return [None if alts is None else {self.piece(a): b for a, b in alts} for alts in tops]

    def add(self, index: int, ids: list[int], offsets: list[int], lps: list[float], tops) -> CompletionLogprobs | None:
        """The logprobs of `ids`, new tokens of choice `index` starting at `offsets` in its own text (the engine's);
        None without tokens."""
        if not ids:
            return None
        shift, glue = self.shift[index], self.glue[index]
        return CompletionLogprobs(
            tokens=[self.piece(t) for t in ids],
            token_logprobs=lps,
            top_logprobs=self._top(tops),
            text_offset=[o + shift + (glue if o else 0) for o in offsets],
        )

    def echo(
        self, index: int, prompt: int, ids: list[int], text: str, scored: PromptLogprobs | None
    ) -> CompletionLogprobs:
        """The echoed logprobs of prompt `prompt` (`ids`, `text`) for choice `index`; computed once per prompt (the
        first token's are None; all are None when the prompt was never scored: a request cut short before it
        ran). The choice's own offsets then follow `text`. The prompt's tokens are placed in one pass of the
        engine's decoder over them (linear), as far as `text`, the prompt as sent, goes."""
        self.shift[index] = len(text)
        key = (prompt, scored is None)
        if key not in self._echoed:
            lps = scored.logprobs if scored is not None else [None] * len(ids)
            tops = scored.top if scored is not None else [None] * len(ids)
            self._echoed[key] = CompletionLogprobs(
                tokens=[self.piece(t) for t in ids],
                token_logprobs=lps,
                top_logprobs=self._top(tops),
                text_offset=[min(o, len(text)) for o in IncrementalDecoder.offsets_of(self.served.gen.tokenizer, ids)],
            )
        return self._echoed[key]


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
        self.served, self.logprobs, self.run, self.echo, self.per_prompt = served, lp, run, echo, req.n
        self.echoed: set[int] = set()  # (streamed) choices whose prompt has been sent
        self.joined: set[int] = set()  # (echo) choices whose text has begun, after what joins it to the prompt
        self.seen: dict[int, list[int]] = {}  # (streamed echo) a choice's tokens before its first text
        envelope = partial(
            CompletionResponse, id=f"cmpl-{run.job.id}", created=int(run.job.created), model=served.model_id
        )
        self.chunk = lambda **kw: envelope(weight_version=run.job.weight_version, **kw)  # known once the job starts

    def _lp(self, index: int, ids: list[int], offsets: list[int], lps: list[float], tops) -> CompletionLogprobs | None:
        return None if self.logprobs is None else self.logprobs.add(index, ids, offsets, lps, tops)

    def _prefix(self, index: int) -> tuple[str, CompletionLogprobs | None]:
        """What choice `index` starts with: its echoed prompt's text and logprobs (once per choice)."""
        if self.echo is None or index in self.echoed:
            return "", None
        self.echoed.add(index)
        p = index // self.per_prompt
        ids, text = self.echo[p]
        if self.logprobs is None:
            return text, None
        return text, self.logprobs.echo(index, p, ids, text, self.run.prompt_logprobs.get(p))

    def _glue(self, index: int, ids: list[int], text: str) -> str:
        """(echo) What goes between the prompt's text and choice `index`'s own (`joiner`): decided and sent with
        the choice's first text, `text`, from its tokens so far (`ids` the latest)."""
        if self.echo is None or index in self.joined:
            return ""
        seen = self.seen.setdefault(index, [])
        seen += ids
        if not text:
            return ""
        self.joined.add(index)
        del self.seen[index]
        prompt = self.echo[index // self.per_prompt][0]
        glue = joiner(self.served.decode, prompt[-_TAIL:], seen)
        if self.logprobs is not None:
            self.logprobs.glue[index] = len(glue)
        return glue

    def answer(self, done: list[Completion]) -> CompletionResponse:
        choices = []
        for i, c in enumerate(done):
            text, head = self._prefix(i)
            text += self._glue(i, c.token_ids, c.text)
            lp = self._lp(i, c.token_ids, c.text_offsets, c.raw_logprobs, c.top_logprobs)
            choices.append(
                CompletionChoice(index=i, text=text + c.text, finish_reason=c.finish_reason, logprobs=_join(head, lp))
            )
        return self.chunk(choices=choices, usage=usage(self.run.prompt_tokens, done))

    def choice(self, ev: StreamEvent) -> CompletionChoice | None:
        text, head = self._prefix(ev.index)
        text += self._glue(ev.index, ev.token_ids, ev.delta)
        lp = _join(head, self._lp(ev.index, ev.token_ids, ev.text_offsets, ev.raw_logprobs, ev.top_logprobs))
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
    if kind is not int and len(prompt) > MAX_PROMPTS:
        raise APIError(400, f"prompt holds {len(prompt)} prompts; a request may send at most {MAX_PROMPTS}", "prompt")
    for i, p in enumerate(prompt):
        if type(p) is not kind:
            raise APIError(
                400,
                f"prompt[{i}]: a list of prompts holds strings, token ids or lists of token ids, not a mix",
                f"prompt[{i}]",
            )
    return [list(prompt)] if kind is int else list(prompt)


def _prepare(served: Served, prompts: list[str | list[int]], echo: bool) -> tuple[list[list[int]], list | None]:
    """The prompts' token ids, and with echo each prompt's (ids, text as sent; token ids decoded)."""
    ids = _encode(served, prompts)
    if not echo:
        return ids, None
    return ids, [(t, p if isinstance(p, str) else served.decode(t)) for p, t in zip(prompts, ids)]


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
    """OpenAI completions: one or more prompts (text or token ids), `n` choices each (streamed as server-sent
    events when `stream` is true)."""
    served: Served = request.app.state.served
    prompts = prompt_list(req.prompt)
    size = sum(len(p) for p in prompts)  # characters or token ids
    ids, echo = await offload(size, _prepare, served, prompts, req.echo)  # tokenizing: off the event loop
    score_top = None
    if req.echo and req.logprobs is not None:
        if (why := served.scorer.unavailable) is not None:
            raise APIError(400, f"echo with logprobs: {why}", "echo")
        score_top = req.logprobs
    run = await served.submit(req, request, ids, req.max_tokens, req.logprobs or 0, "prompt", score_top)
    reply = _Reply(served, req, run, echo)
    return await run.respond(reply.answer, reply.choice, reply.chunk)
