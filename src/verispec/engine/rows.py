"""One request while it generates (`Row`), and what it returns: `Completion` at the end, `StreamEvent` per step.

A row takes each step's tokens until EOS, its budget or the context end; its text is decoded, cut at the first
stop string (the tokens after it are dropped too), and streamed in deltas that never end inside a multi-byte
character or inside what may be the start of a stop string.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..sampling import SamplingParams
from .stats import SpecStats
from .stops import StopMatcher, matcher_of

__all__ = ["Completion", "IncrementalDecoder", "Row", "RowFault", "StreamEvent"]

MAX_PENDING = 8  # tokens a decoding window may wait for (a UTF-8 character is at most 4 bytes): bounds each step's work
MAX_WINDOW = 64  # the longest decoding window (context + new tokens) kept for runs of invisible tokens
TopLogprobs = list[tuple[int, float]]  # (token id, raw target logprob), best first


class RowFault(RuntimeError):
    """One request failed inside an engine step (its distribution was no distribution; its grammar, stop strings or
    detokenizer raised): it ends with finish_reason "error" and this as `Completion.error`, while the other rows of
    the batch go on unchanged. A ValueError cause (a parameter the request set) is kept as `__cause__`."""


@dataclass
class Completion:
    """A finished request: its tokens, text, logprobs (under the target, at each returned token) and speculation
    figures.

    Attributes:
        index: The request's position in its call (`generate` returns completions sorted by it).
        prompt_token_ids: The prompt as the model saw it (chat template applied).
        token_ids: The generated tokens (EOS excluded; cut at a stop string).
        text: The generated text (cut before the first stop string).
        finish_reason: "stop" (EOS, a stop token or a stop string), "length" (max_new_tokens or the end of the
            context), "abort" (cut short by its caller) or "error" (it failed inside a step: `error` says why; the
            other requests of the batch went on).
        stop_reason: The stop string, stop token or EOS id that ended it (None otherwise).
        logprobs: log p(x) of each token under the processed target distribution actually sampled from (token
            options, penalties, temperature, truncation; a greedy request gets 0.0).
        raw_logprobs: log softmax(target logits)(x) of each token, temperature 1, nothing truncated (what RL
            importance ratios usually need).
        stats: This request's speculation figures (drafted, accepted, tau, ...).
        top_logprobs: Per position, the most likely alternatives as (token id, raw logprob), best first, when
            asked for.
        key: The handle given to `GenerationSession.add`.
        eos_logprob: When EOS ended it: the EOS token's processed logprob, as `logprobs`.
        eos_raw_logprob: ... and its raw one, as `raw_logprobs`.
        text_offsets: Where each of `token_ids` starts in `text` (see `StreamEvent.text_offsets`); empty for a
            completion no row decoded.
        weight_version: The target's weight version it was drawn under.
        error: With finish_reason "error": the exception (a RowFault, or what the request's own code raised).
    """

    index: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    stop_reason: str | int | None
    logprobs: list[float] | None
    raw_logprobs: list[float] | None
    stats: SpecStats
    top_logprobs: list[TopLogprobs] | None = None
    key: object = None
    eos_logprob: float | None = None
    eos_raw_logprob: float | None = None
    text_offsets: list[int] = field(default_factory=list)
    weight_version: int | None = None
    error: Exception | None = None


@dataclass
class StreamEvent:
    """What one step added to one request, as `SpeculativeGenerator.stream` yields it.

    Attributes:
        index: The request's position in its call.
        delta: New text, safe to print: no half characters, no partial stop string.
        token_ids: The tokens accepted in this step.
        completion: Set on the request's last event: its Completion.
        key: The handle given to `GenerationSession.add`.
        raw_logprobs: The raw target logprob of each of `token_ids`.
        top_logprobs: Per token, the most likely alternatives as (token id, raw logprob), when asked for.
        text_offsets: Where each of `token_ids` starts in the completion's text, never past the text streamed so
            far (a character split over tokens belongs to the token that completes it).
    """

    index: int
    delta: str
    token_ids: list[int]
    completion: Completion | None = None
    key: object = None
    raw_logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[TopLogprobs] | None = None
    text_offsets: list[int] = field(default_factory=list)


@dataclass
class IncrementalDecoder:
    """The text of a growing token list, decoded a few tokens per step (as vLLM's incremental detokenizer), not whole
    every step (O(n^2) over a request): the new tokens are decoded after a window of decoded ones, tokens[prefix:read],
    which keeps what a tokenizer does at a boundary (SentencePiece's leading space, a character split over tokens).
    `update` returns what a whole decode gives, less a trailing incomplete character, so a stop string is seen in the
    step that completes it. A tokenizer that cleans up spaces (`clean_up_tokenization_spaces`), or that rewrote a
    window, has its text decoded whole every step (the windows go on: the offsets come from them).

    `offsets[i]`: where token i starts, the length of the text of tokens[:i] (complete characters), set once when
    it arrives (a step's first token where the text ends, each further one where the window up to it ends): n tokens
    cost O(n). `offsets_of` places a token list (a prompt) without decoding it whole."""

    prefix: int = 0  # tokens[prefix:read]: the context decoded again with the next tokens
    read: int = 0  # tokens[:read] are in text
    text: str = ""  # the text of tokens[:read]
    whole: bool = False  # decode everything every step (see the class docstring)
    offsets: list[int] = field(default_factory=list)  # where each token given so far starts in the text

    def update(self, tokenizer, tokens: list[int]) -> str:
        text = self.advance(tokenizer, tokens)
        if not (self.whole or getattr(tokenizer, "clean_up_tokenization_spaces", False)):
            return text
        self.whole = True
        whole = tokenizer.decode(tokens, skip_special_tokens=True)
        if self.read == len(tokens):  # the windows continue from the whole text
            self.text = whole
        return whole.rstrip("\ufffd")

    def advance(self, tokenizer, tokens: list[int]) -> str:
        """The windows' step: the new tokens placed, and the text of every complete character so far."""
        if len(tokens) <= self.read:
            return self.text
        before = tokenizer.decode(tokens[self.prefix : self.read], skip_special_tokens=True)
        after = tokenizer.decode(tokens[self.prefix :], skip_special_tokens=True)
        if after.startswith(before):
            common = len(before)
        else:  # the tokenizer rewrote the window: its text replaces the window's, and the text is decoded whole
            self.whole = True
            common = next((i for i, (a, b) in enumerate(zip(before, after)) if a != b), min(len(before), len(after)))
        head = self.text[: max(len(self.text) - len(before) + common, 0)]  # the text up to what the window adds
        new = after[common:]
        self._place(tokenizer, tokens, before, len(head) - common, len(head) + len(new))
        waiting = not new or new.endswith("\ufffd")  # nothing visible yet, or a character still incomplete
        if waiting and len(tokens) - self.read <= MAX_PENDING:  # the window waits; complete characters are shown
            return head + new.rstrip("\ufffd")
        self.text = head + new  # (past MAX_PENDING tokens a wait never ends, e.g. stray bytes: take the text as it is)
        if new or len(tokens) - self.prefix > MAX_WINDOW:  # invisible tokens (skipped specials) stay in the window:
            self.prefix = self.read  # a window of them alone would make the next token the first one decoded
        self.read = len(tokens)  # (SentencePiece then drops its leading space); MAX_WINDOW bounds the cost
        return self.text

    def _place(self, tokenizer, tokens: list[int], before: str, base: int, end: int) -> None:
        """Offsets for the tokens not placed yet: token j starts at `base` plus the length of the window's text up
        to it (tokens[prefix:j], complete characters), not past `end`, from the last offset on."""
        last = self.offsets[-1] if self.offsets else 0
        for j in range(len(self.offsets), len(tokens)):
            if j == self.read:
                at = base + len(before)
            else:
                upto = tokenizer.decode(tokens[self.prefix : j], skip_special_tokens=True)
                k = len(before) if upto.startswith(before) else 0
                at = base + k + len(upto[k:].rstrip("\ufffd"))
            last = max(min(at, end), last)
            self.offsets.append(last)

    @classmethod
    def offsets_of(cls, tokenizer, tokens: list[int]) -> list[int]:
        """Where each of `tokens` starts in their text, decoded a token at a time by the windows alone (O(n), also
        for a tokenizer whose text `update` decodes whole): e.g. an echoed prompt's tokens."""
        dec, seen = cls(), []
        for t in tokens:
            seen.append(t)
            dec.advance(tokenizer, seen)
        return dec.offsets


@dataclass
class Row:
    index: int
    prompt: list[int]
    params: SamplingParams
    generator: torch.Generator
    seq: list[int]  # prompt + generated tokens; the last one is pending (in no model's cache yet)
    seed: int = 0  # the request's seed (its generator's, and the coupling noise's key)
    max_new: int = 128
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    stop_token_ids: frozenset[int] = frozenset()  # end the row like EOS (even with ignore_eos), not returned
    gamma: int | None = None  # this request's draft length (0: no speculation); None: the generator's choice
    top_logprobs: int = 0  # alternatives per position to return (raw target log-softmax)
    key: object = None  # the caller's handle (abort)
    weight_version: int | None = None  # the weights it is drawn under (its job's)
    t_start: float = 0.0
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    raw_logprobs: list[float] = field(default_factory=list)
    top: list[TopLogprobs] = field(default_factory=list)
    sent: str = ""  # text already streamed
    evidence: dict = field(default_factory=dict)  # the gamma controller's acceptance counts for this row
    stats: SpecStats = field(default_factory=SpecStats)
    done: Completion | None = None
    detok: IncrementalDecoder = field(default_factory=IncrementalDecoder)  # the streamed text, incrementally
    grammar: object = None  # its structured-output GrammarState (verispec.structured), following its output
    stops: StopMatcher | None = field(init=False, repr=False, compare=False)  # `stop`'s matcher (None: no stop)

    def __post_init__(self) -> None:
        self.stops = matcher_of(self.stop)  # built once (shared by rows with the same stops): no per-step loop

    @classmethod
    def of(cls, req, weight_version: int | None, gamma: int | None) -> Row:
        """The row of a Request (engine.request) joining the batch: its own generator from its seed (the params'
        seed, or one drawn from torch's global RNG)."""
        ids = list(req.prompt_token_ids)
        seed = req.params.seed if req.params.seed is not None else int(torch.randint(0, 2**62, ()))
        return cls(
            req.index,
            ids,
            req.params,
            torch.Generator().manual_seed(seed),
            list(ids),
            seed=seed,
            max_new=req.max_new_tokens,
            stop=req.stop,
            ignore_eos=req.ignore_eos,
            stop_token_ids=req.stop_token_ids,
            gamma=gamma,
            top_logprobs=req.top_logprobs,
            key=req.key,
            weight_version=weight_version,
        )

    def observe(self, drafted: int, accepted: int, nodes: int) -> None:
        """One verification step: a draft `drafted` deep with `nodes` tokens, of which `accepted` were kept."""
        self.stats.observe(drafted, accepted, nodes)

    def take(
        self,
        new: list[int],
        lp: list[float],
        raw: list[float],
        top: list[TopLogprobs] | None,
        eos_ids: set[int],
        max_positions: int | None,
    ) -> list[int]:
        """Append a step's tokens to the output until EOS, the budget or the context end; returns those taken."""
        returned: list[int] = []
        for j, t in enumerate(new):
            if t in self.stop_token_ids or (not self.ignore_eos and t in eos_ids):
                self.finish("stop", t)
                self.done.eos_logprob, self.done.eos_raw_logprob = lp[j], raw[j]
                break
            self.tokens.append(t)
            self.logprobs.append(lp[j])
            self.raw_logprobs.append(raw[j])
            if self.top_logprobs:
                self.top.append(top[j][: self.top_logprobs])
            returned.append(t)
            if len(self.tokens) >= self.max_new:
                self.finish("length", None)
                break
        if self.done is None and max_positions is not None and len(self.seq) >= max_positions:
            self.finish("length", None)
        return returned

    def finish(self, reason: str, stop_reason) -> None:
        """The row's end: its Completion, whose tokens, text and logprobs `_complete` (or `fail`) fills in."""
        self.done = Completion(self.index, self.prompt, [], "", reason, stop_reason, None, None, self.stats)
        self.done.key, self.done.weight_version = self.key, self.weight_version

    def fail(self, error: Exception) -> StreamEvent:
        """End the row with finish_reason "error" (nothing decoded: the decoder may be what failed); its last event."""
        self.finish("error", None)
        self.done.error = error
        self.done.token_ids = list(self.tokens)
        return StreamEvent(self.index, "", [], completion=self.done, key=self.key)

    def event(self, tokenizer, before: int) -> StreamEvent:
        """This step's event: the text delta (stop strings applied) and the tokens kept since `before`.
        While the row runs, its text grows incrementally (a few tokens decoded per step); a stop string seen
        there, and the row's end, are settled on one decode of the whole output (the returned text)."""
        old = len(self.detok.text)
        text = self.detok.update(tokenizer, self.tokens)
        if self.detok.whole:  # a whole decode may rewrite text before the previous end: look at all of it
            old = 0
        stops = self.stops  # a stop string may straddle the previous text's end: look from stops.window(old) on
        if self.done is not None or (stops is not None and stops.found(text, stops.window(old))):
            text = tokenizer.decode(self.tokens, skip_special_tokens=True)
            hit = stops.first(text) if stops is not None else None
            if hit is not None:
                text = self._cut_at_stop(tokenizer, text, *hit, before)
        if self.done is not None:
            delta = text[len(self.sent) :] if text.startswith(self.sent) else ""
            self.sent = text
            self._complete(text)
        else:
            delta = self._safe_delta(text)
        kept = min(before, len(self.tokens))  # a stop string may cut tokens of this step
        shown = len(self.sent)  # offsets never point past the text streamed so far (this delta included)
        return StreamEvent(
            self.index,
            delta,
            self.tokens[kept:],
            completion=self.done,
            key=self.key,
            raw_logprobs=self.raw_logprobs[kept:],
            top_logprobs=self.top[kept:] if self.top_logprobs else None,
            text_offsets=[min(o, shown) for o in self.detok.offsets[kept : len(self.tokens)]],
        )

    def _cut_at_stop(self, tokenizer, text: str, cut: int, stop: str, before: int) -> str:
        """Drop the text from the stop string on, and the tokens after the shortest prefix that contains it."""
        n = before  # the stop string was not in the text before this step
        while n < len(self.tokens) and stop not in tokenizer.decode(self.tokens[:n], skip_special_tokens=True):
            n += 1
        del self.tokens[n:], self.logprobs[n:], self.raw_logprobs[n:], self.top[n:], self.detok.offsets[n:]
        self.finish("stop", stop)
        return text[:cut]

    def _complete(self, text: str) -> None:
        d = self.done
        d.text, d.token_ids = text, list(self.tokens)
        d.text_offsets = [min(o, len(text)) for o in self.detok.offsets[: len(self.tokens)]]
        d.logprobs, d.raw_logprobs = list(self.logprobs), list(self.raw_logprobs)
        d.top_logprobs = list(self.top) if self.top_logprobs else None

    def _safe_delta(self, text: str) -> str:
        safe = text.rstrip("\ufffd")  # an incomplete multi-byte character waits for its next token
        if self.stops is not None:  # hold back the longest suffix that may be the start of a stop string
            safe = safe[: len(safe) - self.stops.held(safe)]
        if safe.startswith(self.sent) and len(safe) > len(self.sent):
            delta, self.sent = safe[len(self.sent) :], safe
            return delta
        return ""
