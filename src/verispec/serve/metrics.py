"""Prometheus metrics, named after vLLM's (prefix `verispec:` instead of `vllm:`) so existing dashboards and
alerts carry over: spec_decode_num_drafts / num_draft_tokens / num_accepted_tokens /
num_accepted_tokens_per_pos, num_requests_running / waiting, e2e_request_latency_seconds, token counters, and
request_success{finished_reason}: "stop" / "length" for finished choices, "abort" for those whose client went
away, "error" for those an engine fault ended (each choice of a request counts once). The RL routes' rollouts count
the same way (one per sample, "abort" for those `/abort_request` ended), plus weight_updates and weight_version."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

__all__ = ["Metrics"]


class Metrics:
    """The server's metrics, in a registry of its own (two servers in one process do not share counters)."""

    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        self._lbl = {"model_name": model_name}
        self.running = self._one(Gauge, "num_requests_running", "Requests in the running batch")
        self.waiting = self._one(Gauge, "num_requests_waiting", "Requests waiting for a batch slot")
        self.drafts = self._one(Counter, "spec_decode_num_drafts", "Speculative steps that drafted (per row)")
        self.draft_tokens = self._one(Counter, "spec_decode_num_draft_tokens", "Draft tokens proposed")
        self.accepted_tokens = self._one(Counter, "spec_decode_num_accepted_tokens", "Draft tokens accepted")
        self.accepted_per_pos = self._by(
            "spec_decode_num_accepted_tokens_per_pos", "Accepted draft tokens by position in the draft", "position"
        )
        self.prompt_tokens = self._one(Counter, "prompt_tokens", "Prompt tokens processed")
        self.generation_tokens = self._one(Counter, "generation_tokens", "Tokens generated")
        self.request_success = self._by("request_success", "Finished requests", "finished_reason")
        self.rejected = self._one(Counter, "request_rejected", "Requests refused because the queue was full")
        self.weight_updates = self._one(Counter, "weight_updates", "Weight updates applied (RL routes)")
        self.weight_version = self._one(Gauge, "weight_version", "Weight updates applied since the server started")
        self.latency = self._one(
            Histogram,
            "e2e_request_latency_seconds",
            "End-to-end request latency",
            buckets=(0.1, 0.3, 0.5, 1, 2.5, 5, 10, 20, 40, 60, 120, 300),
        )

    def _one(self, kind, name: str, doc: str, **kw):
        """A metric of this server's model: `verispec:<name>{model_name}`."""
        return kind(f"verispec:{name}", doc, ["model_name"], registry=self.registry, **kw).labels(**self._lbl)

    def _by(self, name: str, doc: str, label: str) -> Counter:
        """A counter with one more label besides model_name (set it and model_name with `.labels`)."""
        return Counter(f"verispec:{name}", doc, ["model_name", label], registry=self.registry)

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

    def observe_rollouts(self, rollouts, seconds: float) -> None:
        """The samples of one RL-route call (`Rollout`s), which ran outside the engine thread."""
        for r in rollouts:
            st = r.stats
            self.drafts.inc(sum(steps for drafted, steps in st.steps_by_drafted.items() if drafted > 0))
            self.draft_tokens.inc(st.drafted)
            self.accepted_tokens.inc(st.accepted)
            for pos, n in enumerate(st.accepted_at):
                if n:
                    self.accepted_per_pos.labels(position=str(pos), **self._lbl).inc(n)
            self.observe_request(len(r.prompt_token_ids), len(r.completion_token_ids), r.finish_reason, seconds)

    def observe_weight_update(self, version: int) -> None:
        self.weight_updates.inc()
        self.weight_version.set(version)

    def observe_dropped(self, choices: int, reason: str = "abort") -> None:
        """Choices that ended without finishing: "abort" (the client went away) or "error" (an engine fault)."""
        self.request_success.labels(finished_reason=reason, **self._lbl).inc(choices)

    def render(self) -> bytes:
        return generate_latest(self.registry)
