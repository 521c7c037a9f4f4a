"""Continuations from an OpenAI-compatible HTTP endpoint (vLLM, SGLang, llama.cpp, `verispec serve`), for
`verispec certify generate --method openai`: one seeded completions request per continuation, every sampling knob
set explicitly (NEUTRAL), refused optional fields dropped and reported, ids read from "token_id:N", llama.cpp's
native ids or the token's text; every id of the EOS set one outcome (for users: docs/guides/certify.md)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from ..sampling import SamplingParams

__all__ = ["Endpoint", "EndpointError", "EndpointLog", "TokenMapper", "structured_outputs"]

OPTIONAL_FIELDS = ("return_tokens_as_token_ids",)
NEUTRAL = {"top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0, "repeat_penalty": 1.0}  # droppable at these values
RETRY_STATUS = (429, 500, 502, 503, 504)


class EndpointError(ValueError):
    """The endpoint cannot be certified as asked (refused a sampling field, kept failing, answered nonsense)."""


@dataclass
class EndpointLog:
    """What the run did with the endpoint, for the report."""

    requests: int = 0
    retries: int = 0
    dropped_fields: list[str] = field(default_factory=list)  # optional fields the server refused
    eos_appended: int = 0  # continuations that stopped early at an end-of-sequence token
    mapped_by_text: int = 0  # tokens whose id came from their text (no token_id:N)
    unmappable: list[str] = field(default_factory=list)  # samples whose token text several ids share
    speculation: dict = field(default_factory=dict)  # usage.speculation summed, where the server reports it


def structured_outputs(c) -> dict:
    """A Constraint as vLLM's `structured_outputs` field."""
    if c.whitespace:
        why = "a JSON constraint with any whitespace has no portable request field"
        raise EndpointError(f"{why}: certify it without (compact JSON)")
    if c.kind == "json_schema":
        return {"json": json.loads(c.source)}
    if c.kind == "json_object":
        return {"json_object": True}
    if c.kind == "choice":
        return {"choice": c.choices}
    return {c.kind: c.source}  # regex, grammar


class TokenMapper:
    """A token's id from what a server prints for it: "token_id:N", or its text when that text is one id's."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._by_text: dict[str, int | None] | None = None

    def by_text(self) -> dict[str, int | None]:
        if self._by_text is None:
            self._by_text = {}
            for i, s in enumerate(self.tokenizer.batch_decode([[i] for i in range(len(self.tokenizer))])):
                self._by_text[s] = i if s not in self._by_text else None  # None: shared by several ids
        return self._by_text

    def ids(self, tokens: Sequence[str]) -> tuple[list[int], int, str | None]:
        """(ids, how many came from text, the first token text that maps to no single id or None)."""
        out, by_text = [], 0
        for t in tokens:
            if t.startswith("token_id:") and t[9:].isdigit():
                out.append(int(t[9:]))
                continue
            i = self.by_text().get(t)
            if i is None:
                return out, by_text, t
            out.append(i)
            by_text += 1
        return out, by_text, None


@dataclass
class Endpoint:
    """An OpenAI-compatible completions endpoint, and how politely to draw from it."""

    base_url: str
    model: str
    api_key: str | None = None
    max_in_flight: int = 8
    timeout_s: float = 120.0
    retries: int = 8
    backoff_s: float = 0.5
    log: EndpointLog = field(default_factory=EndpointLog)
    transport: object = None  # an httpx transport (tests: httpx.MockTransport); None = the network

    def __post_init__(self):
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"base URL must start with http:// or https://, got {self.base_url!r}")
        if self.max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {self.max_in_flight}")
        self._lock = threading.Lock()
        self._dropped: set[str] = set()
        self.prompt_text: str | None = None  # the prompt as text, for a server that refuses token ids (draw sets it)

    def url(self) -> str:
        base = self.base_url.rstrip("/")
        return f"{base}/completions" if base.endswith("/v1") else f"{base}/v1/completions"

    def body(self, prompt: list[int], params: SamplingParams, seed: int, length: int) -> dict:
        if params.repetition_penalty != 1.0 or params.presence_penalty or params.frequency_penalty:
            raise ValueError("penalties are not certified here (certify generate scores temperature / top-k / top-p)")
        as_text = "prompt as token ids" in self._dropped
        body = dict(model=self.model, prompt=self.prompt_text if as_text else list(prompt), max_tokens=length)
        body |= dict(temperature=params.temperature, top_p=params.top_p, seed=seed, n=1, stream=False, logprobs=1)
        body |= dict(return_tokens_as_token_ids=True, top_k=params.top_k, min_p=params.min_p)
        body |= dict(repetition_penalty=1.0, repeat_penalty=1.0)  # every knob set, NEUTRAL ones explicitly
        if params.constraint is not None:
            body["structured_outputs"] = structured_outputs(params.constraint)
        with self._lock:
            dropped = set(self._dropped)
        return {k: v for k, v in body.items() if k not in dropped}

    def complete(self, client, prompt: list[int], params: SamplingParams, seed: int, length: int) -> dict:
        """The first choice of one completions request, retried and field-negotiated."""
        for attempt in range(self.retries + 1):
            body = self.body(prompt, params, seed, length)
            try:
                r = client.post(self.url(), json=body, headers=self._headers())
            except Exception as e:  # connection refused / reset / timed out: retried like a 503 (refused: 3 times)
                refused = type(e).__name__ == "ConnectError"
                if attempt == self.retries or (refused and attempt >= 3):
                    raise EndpointError(f"{self.url()}: {type(e).__name__}: {e}") from None
                self._wait(attempt, None)
                continue
            # a refusal naming a field (llama-cpp-python answers a validation error with 500) before a retry
            refusal = r.status_code in (400, 422) or (r.status_code == 500 and "validation" in r.text.lower())
            if refusal and self._drop_refused(r.text, body):
                continue
            if r.status_code in RETRY_STATUS and attempt < self.retries:
                self._wait(attempt, r.headers.get("retry-after"))
                continue
            if r.status_code != 200:
                raise EndpointError(f"{self.url()} answered {r.status_code}: {r.text[:300]}")
            with self._lock:
                self.log.requests += 1
            try:
                reply = r.json()
            except ValueError:
                raise EndpointError(f"{self.url()} answered 200 with a body that is not JSON: {r.text[:200]}") from None
            choices = reply.get("choices") or []
            if not choices:
                raise EndpointError(f"{self.url()} answered without choices: {r.text[:300]}")
            self._check_prompt_tokens(body, reply, len(prompt))
            self._add_speculation((reply.get("usage") or {}).get("speculation"))
            return choices[0]
        raise EndpointError(f"{self.url()}: still failing after {self.retries} retries")

    def _headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def _wait(self, attempt: int, retry_after: str | None) -> None:
        with self._lock:
            self.log.retries += 1
        delay = self.backoff_s * 2**attempt
        if retry_after and retry_after.replace(".", "", 1).isdigit():
            delay = max(delay, float(retry_after))
        time.sleep(min(delay, 30.0))

    def _check_prompt_tokens(self, body: dict, reply: dict, n: int) -> None:
        got = (reply.get("usage") or {}).get("prompt_tokens")
        if isinstance(body["prompt"], str) and got is not None and got != n:
            raise EndpointError(
                f"the endpoint tokenized the prompt (sent as text: it refused token ids) into {got} tokens, the "
                f"certifier's tokenizer into {n}: they condition on different prompts (BOS? another tokenizer?)"
            )

    def _add_speculation(self, spec) -> None:
        """Sum the numeric counters of verispec's usage.speculation (draft_tokens, accepted_tokens, ...)."""
        if not isinstance(spec, dict):
            return
        with self._lock:
            for k, v in spec.items():
                if isinstance(v, int) and not isinstance(v, bool):
                    self.log.speculation[k] = self.log.speculation.get(k, 0) + v

    def _drop(self, f: str) -> None:
        with self._lock:
            if f not in self._dropped:
                self._dropped.add(f)
                self.log.dropped_fields.append(f)

    def _drop_refused(self, text: str, body: dict) -> bool:
        """Drop an optional field, or a knob at its neutral value, that the server names in its refusal; send the
        prompt as text when token ids are refused. True when something changed (retry)."""
        droppable = OPTIONAL_FIELDS + tuple(NEUTRAL)
        named = _refused_param(text)  # the field the refusal names (an OpenAI error's `param`), where it says
        for f in droppable:
            if named in droppable and named != f:  # (a message may name others: "did you mean 'repetition_penalty'")
                continue
            if f in body and f in text and (f in OPTIONAL_FIELDS or body[f] == NEUTRAL[f]):
                self._drop(f)
                return True
        as_string = "string" in text or "str" in text.split()  # a prompt validated as a string: token ids refused
        if "prompt" in text and as_string and isinstance(body["prompt"], list) and self.prompt_text is not None:
            self._drop("prompt as token ids")
            return True
        needed = ("top_k", "min_p", "seed", "top_p", "prompt", "structured_outputs")
        sampling = [f for f in needed if f in body and f in text]
        if sampling:
            raise EndpointError(
                f"the endpoint refused {sampling[0]!r} ({text[:200]}): without it the certificate would test "
                "another law than the one it states"
            )
        return False

    def draw(
        self,
        prompt: list[int],
        params: SamplingParams,
        seeds: Sequence[int],
        length: int,
        mapper: TokenMapper,
        eos: Sequence[int] = (),
        prompt_text: str | None = None,
    ) -> tuple[list, list]:
        """One continuation per seed (token ids; None for one whose token text cannot be mapped back) and its
        returned logprobs (None where the server gave none). eos: the EOS set, its first id the outcome written
        for all (module docstring). prompt_text: the prompt as text, sent only to a server that refuses ids."""
        import httpx

        self.prompt_text = prompt_text
        with (
            httpx.Client(timeout=self.timeout_s, transport=self.transport) as client,
            ThreadPoolExecutor(self.max_in_flight) as pool,
        ):
            choices = list(pool.map(lambda s: self.complete(client, prompt, params, s, length), seeds))
        tokens, logprobs = [], []
        for seed, c in zip(seeds, choices):
            ids, lps = self._parse(c, mapper, seed)
            if ids is not None:
                ids, lps = self._end_at_eos(ids, lps, c.get("finish_reason"), length, list(eos))
            tokens.append(ids)
            logprobs.append(lps)
        return tokens, logprobs

    def _end_at_eos(self, ids: list[int], lps, finish, length: int, eos: list[int]):
        """Cut after the first EOS-set id and write it as eos[0]; append eos[0] to a continuation that stopped
        early ("stop") without returning the EOS it stopped at. Its logprob is NaN (not compared)."""
        if not eos:
            return ids, lps
        cut = next((i for i, t in enumerate(ids) if t in eos), None)
        if cut is not None:
            ids, lps = ids[: cut + 1], None if lps is None else lps[: cut + 1]
            ids[cut] = eos[0]
        elif len(ids) < length and finish == "stop":
            ids, lps = ids + [eos[0]], None if lps is None else lps + [float("nan")]
            with self._lock:
                self.log.eos_appended += 1
        else:
            return ids, lps
        if lps is not None:
            lps[-1] = float("nan")
        return ids, lps

    def _parse(self, choice: dict, mapper: TokenMapper, seed: int) -> tuple[list[int] | None, list[float] | None]:
        """(ids or None when a token text maps to no single id, logprobs or None): the legacy shape (`tokens`,
        `token_logprobs`) or llama.cpp's native one (`content: [{id, token, logprob}]`)."""
        lp = choice.get("logprobs") or {}
        if isinstance(lp.get("content"), list):  # llama.cpp's native server
            items = lp["content"]
            names = [f"token_id:{d['id']}" if isinstance(d.get("id"), int) else d.get("token", "") for d in items]
            values = [d.get("logprob") for d in items]
        else:
            names, values = lp.get("tokens"), lp.get("token_logprobs")
        if names is None and not choice.get("text"):  # no token at all (stopped at once): no logprobs to give
            names, values = [], []
        if names is None:
            raise EndpointError(
                "the endpoint returned no logprobs tokens: certify generate needs the sampled tokens "
                "(completions with logprobs >= 1, ideally with return_tokens_as_token_ids)"
            )
        ids, by_text, bad = mapper.ids(names)
        with self._lock:
            self.log.mapped_by_text += by_text
            if bad is not None:
                self.log.unmappable.append(f"seed {seed}: token text {bad!r} is no single id's text")
        if bad is not None:
            return None, None
        lps = None if values is None else [float("nan") if v is None else float(v) for v in values[: len(ids)]]
        return ids, lps


def _refused_param(text: str) -> str | None:
    """The `param` of an OpenAI-style error body (`{"error": {"param": ...}}`), or None where the body has none."""
    try:
        param = json.loads(text).get("error", {}).get("param")
    except (ValueError, AttributeError):
        return None
    return param if isinstance(param, str) else None
