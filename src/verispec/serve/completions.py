"""POST /v1/completions (the legacy text completions API), plain or streamed, with legacy logprobs. Choices are indexed
prompt-major (docs/guides/serving.md, "Completions details"). `echo`: each choice's text starts with its prompt as sent,
then what decoding after the prompt puts between them (`joiner`), then the completion; with `logprobs` its logprobs
start with the prompt's tokens (the first one's null), scored by one target forward (`serve.scoring`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from fastapi import APIRouter, Request

from ..engine.generator import Completion, StreamEvent
from ..engine.rows import IncrementalDecoder
from .bodies import OffLoopRoute, offload
from .engine import PromptLogprobs
from .errors import APIError
from .jobs import Run, Served
from .protocol import MAX_PROMPTS, CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse

__all__ = ["LegacyLogprobs", "joiner", "prompt_list", "router"]

router = APIRouter(route_class=OffLoopRoute)  # large bodies validated off the event loop
_TAIL = 8  # echo: the prompt tokens decoded before a completion's first ones (its decoding context)
_HEAD = 16  # echo: at most this many completion tokens are tried to find what joins it to the prompt


def joiner(decode: Callable[[list[int]], str], tail: Sequence[int], ids: Sequence[int]) -> str:
    """What decoding a completion after its prompt's last tokens (`tail`) puts before the completion's own text: the
    space a WordPiece or SentencePiece tokenizer sets between words, nothing for byte-level BPE (as vLLM's detokenizer
    reads it). Found on the completion's shortest head that decodes to whole visible text; "" when there is none."""
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
    """One request's legacy logprobs, choice by choice and (streamed) event by event. `text_offset` indexes the choice's
    whole text: the engine's offsets of its tokens in its own text, after its echoed prompt and what joins the two; the
    echoed prompt's tokens are placed by the engine's decoder (`IncrementalDecoder.offsets_of`)."""

    def __init__(self, served: Served, n: int, top_n: int, as_ids: bool = False):
        self.served, self.top_n, self.piece = served, top_n, served.namer(as_ids)
        self.shift = [0] * n  # characters before the completion's own text: the echoed prompt
        self.glue = [0] * n  # and what joins the two (`joiner`): before the completion's tokens but its first
        self._echoed: dict[tuple[int, bool], CompletionLogprobs] = {}  # the prompts' (the same for their choices)

    def _make(self, ids: list[int], lps: list, tops, offsets: list[int]) -> CompletionLogprobs:
        top = None if not self.top_n or tops is None else [None if a is None else self._top(a) for a in tops]
        return CompletionLogprobs(
            tokens=[self.piece(t) for t in ids], token_logprobs=lps, top_logprobs=top, text_offset=offsets
        )

    def _top(self, alts) -> dict[str, float]:
        return {self.piece(a): b for a, b in alts}

    def add(self, index: int, ids: list[int], offsets: list[int], lps: list[float], tops) -> CompletionLogprobs | None:
        """The logprobs of `ids`, new tokens of choice `index` starting at `offsets` in its own text (the engine's);
        None without tokens."""
        shift, glue = self.shift[index], self.glue[index]
        return self._make(ids, lps, tops, [o + shift + (glue if o else 0) for o in offsets]) if ids else None

    def echo(
        self, index: int, prompt: int, ids: list[int], text: str, scored: PromptLogprobs | None
    ) -> CompletionLogprobs:
        """The echoed logprobs of prompt `prompt` (`ids`, `text` as sent) for choice `index`, computed once per prompt
        (all None when the prompt was never scored: a request cut short before it ran); the choice's own offsets then
        follow `text`."""
        self.shift[index] = len(text)
        key = (prompt, scored is None)
        if key not in self._echoed:
            none = [None] * len(ids)
            lps, tops = (scored.logprobs, scored.top) if scored is not None else (none, none)
            offsets = [min(o, len(text)) for o in IncrementalDecoder.offsets_of(self.served.gen.tokenizer, ids)]
            self._echoed[key] = self._make(ids, lps, tops, offsets)
        return self._echoed[key]


def _join(a: CompletionLogprobs | None, b: CompletionLogprobs | None) -> CompletionLogprobs | None:
    if a is None or b is None:
        return a or b
    top = None if a.top_logprobs is None else a.top_logprobs + (b.top_logprobs or [])
    tokens, lps, offsets = a.tokens + b.tokens, a.token_logprobs + b.token_logprobs, a.text_offset + b.text_offset
    return CompletionLogprobs(tokens=tokens, token_logprobs=lps, top_logprobs=top, text_offset=offsets)


class _Reply:
    """How a completions request answers (`Run.respond`)."""

    prefix, response, chunk, first = "cmpl", CompletionResponse, CompletionResponse, ()

    def __init__(self, served: Served, req: CompletionRequest, run: Run, echo: list[tuple[list[int], str]] | None):
        as_ids = req.return_tokens_as_token_ids
        lp = LegacyLogprobs(served, run.n, req.logprobs or 0, as_ids) if req.logprobs is not None else None
        self.served, self.logprobs, self.run, self.echo, self.per_prompt = served, lp, run, echo, req.n
        self.echoed: set[int] = set()  # (streamed) choices whose prompt has been sent
        self.joined: set[int] = set()  # (echo) choices whose text has begun, after what joins it to the prompt
        self.seen: dict[int, list[int]] = {}  # (streamed echo) a choice's tokens before its first text

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
        """(echo) What goes between the prompt's text and choice `index`'s own (`joiner`): decided and sent with the
        choice's first text, `text`, from its tokens so far (`ids` the latest)."""
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

    def _choice(self, index: int, out: Completion | StreamEvent, text: str, reason: str | None) -> CompletionChoice:
        head, head_lp = self._prefix(index)
        head += self._glue(index, out.token_ids, text)
        lp = None
        if self.logprobs is not None:
            lp = self.logprobs.add(index, out.token_ids, out.text_offsets, out.raw_logprobs, out.top_logprobs)
        return CompletionChoice(index=index, text=head + text, logprobs=_join(head_lp, lp), finish_reason=reason)

    def final(self, index: int, c: Completion) -> CompletionChoice:
        return self._choice(index, c, c.text, c.finish_reason)

    def choice(self, ev: StreamEvent) -> CompletionChoice | None:
        c = ev.completion
        out = self._choice(ev.index, ev, ev.delta, c.finish_reason if c is not None else None)
        return out if out.text or out.logprobs or c is not None else None


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
            why = "a list of prompts holds strings, token ids or lists of token ids, not a mix"
            raise APIError(400, f"prompt[{i}]: {why}", f"prompt[{i}]")
    return [list(prompt)] if kind is int else list(prompt)


def _prepare(served: Served, prompts: list[str | list[int]], echo: bool) -> tuple[list[list[int]], list | None]:
    """The prompts' token ids, and with echo each prompt's (ids, text as sent; token ids decoded)."""
    ids = []
    for i, p in enumerate(prompts):
        name = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
        try:
            ids.append(served.gen.encode(p))
        except ValueError as e:
            raise APIError(400, str(e) if len(prompts) == 1 else f"{name}: {e}", name) from None
    if not echo:
        return ids, None
    return ids, [(t, p if isinstance(p, str) else served.decode(t)) for p, t in zip(prompts, ids)]


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
    return await run.respond(_Reply(served, req, run, echo))
