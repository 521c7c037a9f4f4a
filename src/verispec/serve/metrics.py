"""Prometheus metrics named after vLLM's (prefix `verispec:` instead of `vllm:`), so dashboards and alerts carry over;
docs/guides/serving.md ("Metrics") lists them. Every choice is counted once where it ends, so
e2e_request_latency_seconds_count equals the sum of request_success. No `_created` series (as vLLM)."""

from __future__ import annotations

import time
from dataclasses import dataclass

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

__all__ = ["Metrics", "Snapshot"]

# vLLM's buckets, with finer ones at the short end for small models on CPUs
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40, 80)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1, 2.5, 5, 10)
_REQUEST_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1, 1.5, 2, 2.5, 5, 10, 15, 20, 30, 40, 60, 120, 300, 600, 1200)
REASONS = ("stop", "length", "abort", "error")


@dataclass(frozen=True)
class Snapshot:
    """The counters and gauges the periodic log line reads (`serve.logs`), at one time (`Metrics.snapshot`)."""

    time: float  # monotonic seconds
    prompt_tokens: float = 0.0
    generation_tokens: float = 0.0
    drafts: float = 0.0  # speculative steps that drafted, per row
    draft_tokens: float = 0.0
    accepted_tokens: float = 0.0
    accepted_per_pos: tuple[float, ...] = ()  # accepted draft tokens at position 0, 1, ... of a draft
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0  # 0 to 1


class Metrics:
    """The server's metrics, in a registry of its own (two servers in one process do not share counters)."""

    def __init__(self, model_name: str):
        prometheus_client.disable_created_metrics()  # before any metric is made: it is read at creation
        self.registry = CollectorRegistry()
        self._lbl = {"model_name": model_name}
        self.running = self._one(Gauge, "num_requests_running", "Choices in the running batch")
        self.waiting = self._one(Gauge, "num_requests_waiting", "Choices waiting for a batch slot")
        self.kv_usage = self._one(Gauge, "kv_cache_usage_perc", "Fraction of the allocated KV slots in use (0 to 1)")
        self.kv_slots = self._one(Gauge, "kv_cache_slots", "Token slots allocated in the target's KV cache")
        self.drafts = self._one(Counter, "spec_decode_num_drafts", "Speculative steps that drafted (per row)")
        self.draft_tokens = self._one(Counter, "spec_decode_num_draft_tokens", "Draft tokens proposed")
        self.accepted_tokens = self._one(Counter, "spec_decode_num_accepted_tokens", "Draft tokens accepted")
        self.accepted_per_pos = self._by(
            "spec_decode_num_accepted_tokens_per_pos", "Accepted draft tokens by position in the draft", "position"
        )
        self.prompt_tokens = self._one(Counter, "prompt_tokens", "Prompt tokens processed")
        self.generation_tokens = self._one(Counter, "generation_tokens", "Tokens generated")
        self.request_success = self._by("request_success", "Ended choices, by how they ended", "finished_reason")
        self.rejected = self._one(Counter, "request_rejected", "Requests refused because the queue was full")
        self.weight_updates = self._one(Counter, "weight_updates", "Weight updates applied (RL routes)")
        self.weight_version = self._one(Gauge, "weight_version", "Weight updates applied since the server started")
        self.latency = self._histogram("e2e_request_latency_seconds", "End-to-end request latency", _REQUEST_BUCKETS)
        self.queue_time = self._histogram(
            "request_queue_time_seconds", "Time waiting for a batch slot", _REQUEST_BUCKETS
        )
        self.ttft = self._histogram("time_to_first_token_seconds", "Time to first token", _TTFT_BUCKETS)
        self.itl = self._histogram("inter_token_latency_seconds", "Time between steps giving tokens", _ITL_BUCKETS)
        self.longest_draft = 0  # the most tokens one row drafted in a step (the per-position figures' width)

    def _one(self, kind, name: str, doc: str, **kw):
        """A metric of this server's model: `verispec:<name>{model_name}`."""
        return kind(f"verispec:{name}", doc, ["model_name"], registry=self.registry, **kw).labels(**self._lbl)

    def _histogram(self, name: str, doc: str, buckets) -> Histogram:
        return self._one(Histogram, name, doc, buckets=buckets)

    def _by(self, name: str, doc: str, label: str) -> Counter:
        """A counter with one more label besides model_name (set it and model_name with `.labels`)."""
        return Counter(f"verispec:{name}", doc, ["model_name", label], registry=self.registry)

    def set_queue(self, waiting: int, running: int) -> None:
        self.waiting.set(waiting)
        self.running.set(running)

    def set_kv(self, usage: float, slots: int) -> None:
        self.kv_usage.set(usage)
        self.kv_slots.set(slots)

    def observe_step(self, per_row: list[tuple[int, int]]) -> None:
        """(drafted, accepted) per row of one engine step."""
        for drafted, accepted in per_row:
            self.longest_draft = max(self.longest_draft, drafted)
            if drafted:
                self.drafts.inc()
                self.draft_tokens.inc(drafted)
                self.accepted_tokens.inc(accepted)
                for pos in range(accepted):
                    self.accepted_per_pos.labels(position=str(pos), **self._lbl).inc()

    def observe_admitted(self, prompt_tokens: int, queued: float) -> None:
        """A choice joined the batch after `queued` seconds (prompt_tokens: 0 but for its prompt's first choice)."""
        self.prompt_tokens.inc(prompt_tokens)
        self.queue_time.observe(queued)

    def observe_tokens(self, tokens: int, first: bool, seconds: float) -> None:
        """A choice's step output: `seconds` since its arrival (first) or since its previous tokens."""
        self.generation_tokens.inc(tokens)
        (self.ttft if first else self.itl).observe(seconds)

    def observe_end(self, reason: str, seconds: float, choices: int = 1) -> None:
        """`choices` choices ended `seconds` after their arrival."""
        self.request_success.labels(finished_reason=reason, **self._lbl).inc(choices)
        for _ in range(choices):
            self.latency.observe(seconds)

    def observe_weight_update(self, version: int) -> None:
        self.weight_updates.inc()
        self.weight_version.set(version)

    def value(self, name: str, **labels) -> float:
        """One series' current value (0 when it has none yet): `value("request_success_total", finished_reason=...)`."""
        v = self.registry.get_sample_value(f"verispec:{name}", {**self._lbl, **labels})
        return v or 0.0

    def snapshot(self, now: float | None = None) -> Snapshot:
        """The counters and gauges the periodic log line reads, now (`now`: monotonic seconds, default the clock)."""
        v = self.value
        per_pos = tuple(
            v("spec_decode_num_accepted_tokens_per_pos_total", position=str(p)) for p in range(self.longest_draft)
        )
        return Snapshot(
            time=time.monotonic() if now is None else now,
            prompt_tokens=v("prompt_tokens_total"),
            generation_tokens=v("generation_tokens_total"),
            drafts=v("spec_decode_num_drafts_total"),
            draft_tokens=v("spec_decode_num_draft_tokens_total"),
            accepted_tokens=v("spec_decode_num_accepted_tokens_total"),
            accepted_per_pos=per_pos,
            running=int(v("num_requests_running")),
            waiting=int(v("num_requests_waiting")),
            kv_usage=v("kv_cache_usage_perc"),
        )

    def summary(self) -> str:
        """One line for the log: how every choice ended, and the rejected requests."""
        ended = ", ".join(f"{r} {int(self.value('request_success_total', finished_reason=r))}" for r in REASONS)
        return f"choices ended: {ended}; requests rejected (queue full): {int(self.value('request_rejected_total'))}"

    def render(self) -> bytes:
        return generate_latest(self.registry)
