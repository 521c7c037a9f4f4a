"""Prometheus metrics, named after vLLM's (prefix `verispec:` instead of `vllm:`) so existing dashboards and
alerts carry over: spec_decode_num_drafts / num_draft_tokens / num_accepted_tokens /
num_accepted_tokens_per_pos, num_requests_running / waiting, e2e_request_latency_seconds, token counters."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

__all__ = ["Metrics"]


class Metrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        lbl = {"model_name": model_name}
        self._lbl = lbl
        r = self.registry
        self.running = Gauge("verispec:num_requests_running", "Requests in the running batch", ["model_name"],
                             registry=r).labels(**lbl)
        self.waiting = Gauge("verispec:num_requests_waiting", "Requests waiting for a batch slot", ["model_name"],
                             registry=r).labels(**lbl)
        self.drafts = Counter("verispec:spec_decode_num_drafts", "Speculative steps that drafted (per row)",
                              ["model_name"], registry=r).labels(**lbl)
        self.draft_tokens = Counter("verispec:spec_decode_num_draft_tokens", "Draft tokens proposed",
                                    ["model_name"], registry=r).labels(**lbl)
        self.accepted_tokens = Counter("verispec:spec_decode_num_accepted_tokens", "Draft tokens accepted",
                                       ["model_name"], registry=r).labels(**lbl)
        self.accepted_per_pos = Counter("verispec:spec_decode_num_accepted_tokens_per_pos",
                                        "Accepted draft tokens by position in the draft", ["model_name", "position"],
                                        registry=r)
        self.prompt_tokens = Counter("verispec:prompt_tokens", "Prompt tokens processed", ["model_name"],
                                     registry=r).labels(**lbl)
        self.generation_tokens = Counter("verispec:generation_tokens", "Tokens generated", ["model_name"],
                                         registry=r).labels(**lbl)
        self.request_success = Counter("verispec:request_success", "Finished requests", ["model_name",
                                       "finished_reason"], registry=r)
        self.rejected = Counter("verispec:request_rejected", "Requests refused because the queue was full",
                                ["model_name"], registry=r).labels(**lbl)
        self.latency = Histogram("verispec:e2e_request_latency_seconds", "End-to-end request latency",
                                 ["model_name"], registry=r,
                                 buckets=(0.1, 0.3, 0.5, 1, 2.5, 5, 10, 20, 40, 60, 120, 300)).labels(**lbl)

    def set_queue(self, waiting: int, running: int) -> None:
        self.waiting.set(waiting)
        self.running.set(running)

    def observe_step(self, per_row: list[tuple[int, int]]) -> None:
        """(drafted, accepted) per row of one engine step."""
        for drafted, accepted in per_row:
            if drafted:
                self.drafts.inc()
                self.draft_tokens.inc(drafted)
                self.accepted_tokens.inc(accepted)
                for pos in range(accepted):
                    self.accepted_per_pos.labels(position=str(pos), **self._lbl).inc()

    def observe_request(self, prompt_tokens: int, generated: int, reason: str, seconds: float) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(generated)
        self.request_success.labels(finished_reason=reason, **self._lbl).inc()
        self.latency.observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
