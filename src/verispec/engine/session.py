"""The scheduler: a `GenerationSession` runs jobs of requests on an `EngineCore` — requests join the batch (whole
groups, at most `max_batch` rows) and leave it (they finish, or are aborted) between steps: continuous batching — and
runs `Barrier`s (weight updates) between jobs, so that every job is drawn under one weight version, which its
completions report. While rows run, a prompt longer than `prefill_chunk` is prefilled outside the batch, one chunk
per step, and joins once complete (chunked prefill). One step is `engine.step`'s; then each row takes its tokens (EOS,
budget, stop strings) and yields a `StreamEvent`. Its books (jobs waiting, running, by key, deadlines) are the only
ones: a caller follows its jobs through `Job.on_admit` and `Job.on_event`. Not thread-safe: drive it from one thread
(the server's engine thread does); `Barrier.wait` is the one call meant for other threads.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import torch
from torch import Tensor

from ..drafting.batch import BatchView
from ..model.protocol import Staged, Staging
from ..sampling import SamplingMetadata, SamplingParams
from .core import EngineCore, check_prefill_chunk
from .request import Barrier, Job, Request
from .rows import Completion, Row, StreamEvent
from .stats import SpecStats
from .step import row_fault, speculative_step
from .verify import StepOutput

__all__ = ["GenerationSession"]


@dataclass(eq=False)
class _Prefill:
    """Admitted rows sharing a long prompt being prefilled (`Staged`, a chunk per step); they hold batch slots."""

    rows: list[Row]
    staged: Staged


class GenerationSession:
    """Continuous batching and scheduling over one EngineCore; `step()` admits what the queue allows and runs one step
    for every row in the batch. `max_batch`: the most rows at once (None: no bound), rows being prefilled included.
    `prefill_chunk`: while rows run, a longer prompt is prefilled outside the batch, at most this many prompt tokens
    per step in all, and joins once complete; 0: every prompt whole at admission; None: the core's."""

    def __init__(self, core: EngineCore, max_batch: int | None = None, prefill_chunk: int | None = None):
        core = getattr(core, "core", core)  # a SpeculativeGenerator passes its core
        if max_batch is not None and (isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1):
            raise ValueError(f"max_batch must be None or an integer >= 1, got {max_batch!r}")
        self.core = core
        self.max_batch = max_batch
        self.prefill_chunk = check_prefill_chunk(core.prefill_chunk if prefill_chunk is None else prefill_chunk)
        self.rows: list[Row] = []  # in the batch, in cache row order
        self.prefilling: list[_Prefill] = []  # admitted rows whose prompts are being prefilled, in admission order
        self.queue: deque[Job | Barrier] = deque()  # jobs not fully admitted and barriers, in submission order
        self.stats = SpecStats()  # pooled over this session
        self.prompt_mask: Tensor | None = None  # [B, V] bool: tokens in each row's prompt
        self.counts: Tensor | None = None  # [B, V] float32: each row's generated-token counts
        self.last_step: list[tuple[int, int]] = []  # (drafted, accepted) per row of the last step, for metrics
        self.sampling: SamplingMetadata | None = None  # self.rows' params as tensors (rebuilt in _join / _keep)
        self._live: dict[object, Job] = {}  # job key -> the job, while unfinished (in submission order)
        self._owner: dict[object, Job] = {}  # request key -> its job, while the request is unfinished

    # --- submitting ---------------------------------------------------------------------------------------
    @property
    def pending(self) -> list[Request]:
        """Submitted requests not in the batch yet (being prefilled, then queued), in the order they will join."""
        staged = [r for p in self.prefilling for row in p.rows for r in self._unfinished(row.key)]
        return staged + [r for job in self.queue if isinstance(job, Job) for r in job.requests[job.admitted :]]

    @property
    def num_running(self) -> int:
        """Requests admitted and unfinished: in the batch or being prefilled."""
        return len(self.rows) + sum(len(p.rows) for p in self.prefilling)

    @property
    def jobs(self) -> list[Job]:
        """The unfinished jobs, in submission order."""
        return list(self._live.values())

    def job(self, key: object) -> Job | None:
        """An unfinished job by its key, or by the key of one of its unfinished requests (None: neither)."""
        return self._live.get(key) or self._owner.get(key)

    @property
    def num_active(self) -> int:
        """Requests in the batch or waiting to join it."""
        return len(self.rows) + len(self.pending)

    @property
    def idle(self) -> bool:
        """Nothing to run: no row, no prompt being prefilled, no queued job, no barrier."""
        return not self.rows and not self.prefilling and not self.queue

    def submit(self, job: Job) -> object:
        """Queue a job (its requests checked against the core now, those no core has checked: `EngineCore.check`);
        it starts once every barrier submitted before it has run. Returns its key."""
        if job.key in self._live:
            raise ValueError(f"a job with key {job.key!r} is already in this session")
        for req in job.requests:
            if req.checked is not self.core:
                self.core.check(req)
            if req.key in self._owner:
                raise ValueError(f"a request with key {req.key!r} is already in this session")
        job.weight_version, job.admitted, job.open = None, 0, len(job.requests)  # (submitted again: anew)
        self._live[job.key] = job
        self._owner.update((req.key, job) for req in job.requests)
        self.queue.append(job)
        return job.key

    def add(self, prompt, params: SamplingParams = SamplingParams(), **options) -> object:
        """Queue one request as a job of its own; returns its key. options: `EngineCore.request`'s (max_new_tokens,
        stop, stop_token_ids, chat, ignore_eos, gamma, top_logprobs, key, index), checked now."""
        req = self.core.request(prompt, params, **options)
        self.submit(Job([req], key=("request", req.key)))
        return req.key

    def barrier(self, fn, on_done=None) -> Barrier:
        """Run fn() with the model to itself once every job submitted so far has finished; jobs submitted after it
        wait for it. The Barrier holds its result or exception (`Barrier.wait` from another thread)."""
        b = fn if isinstance(fn, Barrier) else Barrier(fn, on_done)
        self.queue.append(b)
        return b

    def abort(self, *keys: object, error: Exception | None = None) -> list[StreamEvent]:
        """End jobs (by their keys) or single requests (by theirs) now: each unfinished request's last event, with
        finish_reason "abort" and the tokens it has (none when it had not joined the batch), or with `error`: "error"
        (`Completion.error`). Unknown keys: nothing. Each event goes to its job's `on_event` too."""
        reqs = [r for k in keys for r in self._unfinished(k)]
        running = {r.key: b for b, r in enumerate(self.rows)}
        events = []
        for req in reqs:
            job, b = self._owner.get(req.key), running.get(req.key)
            if job is None:  # (named twice)
                continue
            if b is None:
                event = _aborted(req, job.weight_version, error)
            elif error is not None:
                event = self.rows[b].fail(error)
            else:
                self.rows[b].finish("abort", None)
                event = self.rows[b].event(self.core.tokenizer, len(self.rows[b].tokens))
            events.append((job, event))
            self._closed(req.key)
        self._unstage()
        self._keep([b for b, r in enumerate(self.rows) if r.key in self._owner])
        self.queue = deque(x for x in self.queue if isinstance(x, Barrier) or self._waiting(x))
        return _notify(events)

    def expire(self, now: float | None = None) -> list[StreamEvent]:
        """Abort the jobs whose `Job.deadline` has passed (at `now`, a time.perf_counter() time); their events."""
        now = time.perf_counter() if now is None else now
        late = [j.key for j in self._live.values() if j.deadline is not None and j.deadline <= now]
        return self.abort(*late) if late else []

    def reset(self, error: Exception, everything: bool = False) -> list[StreamEvent]:
        """After a failed step or admission (the batch's state untrusted): every started job (every job, with
        `everything`) ends with `error` (`abort`, no tokens) and the batch starts afresh; the rest stays queued."""
        self.close()
        self.rows = []
        return self.abort(*[j.key for j in self._live.values() if everything or j.admitted], error=error)

    def step(self) -> list[StreamEvent]:
        """Admit what the queue allows (running barriers that are due), then one step (`run`); the step's events."""
        self.schedule()
        return self.run()

    def run(self) -> list[StreamEvent]:
        """One speculative step for the rows in the batch (`speculative_step`; none: no events); its events."""
        if not self.rows:
            return []
        owners = {r.key: self._owner[r.key] for r in self.rows}
        view = self._view(penalties=any(r.params.uses_penalties for r in self.rows))
        out, faults = speculative_step(self.core, self.rows, view, self.sampling.all_identity, self.stats)
        self.last_step = list(zip(out.drafted, out.accepted))
        return _notify([(owners[e.key], e) for e in self._emit(out, faults)])

    # --- scheduling ---------------------------------------------------------------------------------------
    def schedule(self) -> None:
        """Move queued requests into the batch in submission order while rows are free (a group whole when it fits,
        in parts only into an empty batch), then feed the prompts being prefilled one chunk (`_prefill`); a barrier
        at the head runs once the batch is empty, and holds back everything behind it until then."""
        joining: list[Row] = []
        while self.queue:
            head = self.queue[0]
            if isinstance(head, Barrier):
                if self.rows or self.prefilling or joining:
                    break
                self.queue.popleft()
                head.run()
                continue
            if not self._take(head, joining):
                break
            self.queue.popleft()
        if joining:
            self._join(joining)
        if self.prefilling:
            self._prefill()

    def _take(self, job: Job, joining: list[Row]) -> bool:
        """Rows for the job's next groups while they fit; True once every request of the job has joined."""
        if job.weight_version is None:
            job.weight_version = self.core.weight_version
        while job.admitted < len(job.requests):
            held = self.num_running + len(joining)  # rows being prefilled hold their slots
            free = (self.max_batch or 1 << 30) - held
            size = min(job.group - job.admitted % job.group, len(job.requests) - job.admitted)
            if free <= 0 or (size > free and held):
                return False
            for req in job.requests[job.admitted : job.admitted + min(size, free)]:
                job.admitted += 1
                if req.key not in self._owner:  # aborted before it joined
                    continue
                row = Row.of(req, job.weight_version, 0 if self.core.proposer is None else req.gamma)
                row.grammar = self.core.grammar_state(req)
                joining.append(row)
                if job.on_admit is not None:
                    job.on_admit(req)
        return True

    def _waiting(self, job: Job) -> bool:
        """Whether the job still has requests to admit (not aborted)."""
        return any(r.key in self._owner for r in job.requests[job.admitted :])

    def _unfinished(self, key: object) -> list[Request]:
        """The unfinished requests a key names: a job's, or one request's (none: unknown)."""
        if key in self._live:
            return [r for r in self._live[key].requests if self._owner.get(r.key) is self._live[key]]
        return [r for r in self._owner[key].requests if r.key == key] if key in self._owner else []

    def _closed(self, key: object) -> None:
        """A request ended (finished or aborted): its job ends with its last one."""
        job = self._owner.pop(key, None)
        if job is not None:
            job.open -= 1
            if job.open == 0:
                self._live.pop(job.key, None)

    # --- membership -----------------------------------------------------------------------------------
    def _view(self, rows: list[Row] | None = None, penalties: bool = True, prompt_mask=None, counts=None) -> BatchView:
        core = self.core
        if rows is None:
            rows, prompt_mask, counts = self.rows, self.prompt_mask, self.counts
        return BatchView(
            seqs=[r.seq for r in rows],
            params=[r.params for r in rows],
            generators=[r.generator for r in rows],
            prompt_mask=prompt_mask if penalties else None,
            output_counts=counts if penalties else None,
            vocab_size=core.vocab_size,
            device=core.device,
            seeds=[r.seed for r in rows],
            positions=[len(r.tokens) for r in rows],
            randomness=core.randomness,
            keyed=[r.params.seed is not None and not r.params.greedy for r in rows],  # random=auto couples these
            sampling=self.sampling if rows is self.rows else None,  # the batch's, built at its last membership change
            grammars=[r.grammar for r in rows] if any(r.grammar is not None for r in rows) else None,
        )

    def _capacity(self, rows: list[Row]) -> int:
        """KV slots the rows can need: prompt, budget, the largest draft and the pending token."""
        core = self.core
        tree = core.tree
        chain = core.controller.max_gamma + core.jump + core.randomness.lookahead  # a chain, then grammar-forced tokens
        slack = max(chain, tree.cache_slots if tree is not None else 0) + 2
        capacity = max(len(r.prompt) + r.max_new + slack for r in rows)
        if core.max_positions is not None:
            capacity = min(capacity, core.max_positions + slack)
        return capacity

    def _join(self, new: list[Row]) -> None:
        """Rows admitted now join the batch, their prompts prefilled whole, except, while other rows run or are being
        prefilled, those whose prompts are longer than one chunk: they are staged (`_stage`), each prompt once."""
        chunk = self.prefill_chunk
        staging = bool(chunk) and isinstance(self.core.runner, Staging)
        now: list[Row] = []
        long: list[Row] = []
        for r in new:
            (long if staging and len(r.seq) - 1 > chunk else now).append(r)  # seq[:-1]: the tokens to prefill
        busy = bool(self.rows or self.prefilling)  # before `now` joins: rows admitted together delay no one
        if now:
            self._enter(now)
        if long and not busy:
            self._enter(long)  # no one to delay: whole
        elif long:
            self._stage(long)

    def _stage(self, rows: list[Row]) -> None:
        """The rows wait outside the batch while their prompts are prefilled; rows sharing a prompt (a group's
        samples) share one staged row, computed once."""
        groups: dict[tuple[int, ...], list[Row]] = {}
        for r in rows:
            groups.setdefault(tuple(r.seq[:-1]), []).append(r)
        for prompt, same in groups.items():
            self.prefilling.append(_Prefill(same, self.core.runner.stage(prompt, self._capacity(same))))

    def _prefill(self) -> None:
        """Feed the staged prompts, oldest first, at most `prefill_chunk` tokens in all while rows run (with none
        running, whole: no one to delay), and let each group whose prompt is complete join the batch."""
        budget = self.prefill_chunk
        for p in list(self.prefilling):
            if not self.rows:
                p.staged.feed(p.staged.remaining)
            elif budget > 0:
                budget -= p.staged.feed(budget)
            if p.staged.remaining == 0:
                self.prefilling.remove(p)
                self._enter(p.rows, p.staged)

    def close(self) -> None:
        """Free the prompts being prefilled (llama.cpp: sequences of the shared context), dropping a busy session."""
        for p in self.prefilling:
            p.staged.close()
        self.prefilling.clear()

    def _unstage(self) -> None:
        """Staged rows whose requests ended (aborted) leave; a staged prompt no row waits for is dropped."""
        for p in list(self.prefilling):
            p.rows = [r for r in p.rows if r.key in self._owner]
            if not p.rows:
                self.prefilling.remove(p)
                p.staged.close()

    def _enter(self, new: list[Row], staged: Staged | None = None) -> None:
        """The rows join the batch: their prompts into the target's cache (prefilled now, or the complete staged
        prompt they share) and the drafter's."""
        core = self.core
        V, dev = core.vocab_size, core.device
        mask = torch.zeros((len(new), V), dtype=torch.bool, device=dev)
        for b, r in enumerate(new):
            mask[b, torch.as_tensor(r.prompt, device=dev)] = True
        counts = torch.zeros((len(new), V), dtype=torch.float32, device=dev)
        capacity = self._capacity(new)
        # a draft cache may lag behind by a backlog fed in one chunk (plain steps; rows another drafter served for
        # several steps: up to a whole output), and a ragged chunk is written up to the longest row + the longest chunk
        draft_capacity = capacity + max(r.max_new for r in new) + 2
        view = self._view(new, True, mask, counts)
        fresh = not self.rows  # the runner's rows, if any, are those that left: replaced
        if staged is not None:
            core.runner.join(staged, len(new), replace=fresh)
        elif fresh:
            core.runner.fill([r.seq[:-1] for r in new], capacity)  # a group's shared prompt is computed once
        else:
            core.runner.add_rows([r.seq[:-1] for r in new], capacity)
        if core.proposer is not None:
            (core.proposer.start if fresh else core.proposer.add)(view, draft_capacity)
        if fresh:
            self.prompt_mask, self.counts = mask, counts
        else:
            self.prompt_mask, self.counts = torch.cat([self.prompt_mask, mask]), torch.cat([self.counts, counts])
        now = time.perf_counter()
        for r in new:
            r.t_start = now
        self.rows.extend(new)
        self.sampling = SamplingMetadata.build([r.params for r in self.rows], V, dev)  # once per membership change

    def _keep(self, keep: list[int]) -> None:
        if len(keep) == len(self.rows):
            return
        self.rows = [self.rows[b] for b in keep]
        if not self.rows:
            return  # the next admission starts fresh caches
        core = self.core
        core.runner.select(keep)
        if core.proposer is not None:
            core.proposer.select(keep)
        idx = torch.tensor(keep, device=core.device)
        self.prompt_mask, self.counts = self.prompt_mask.index_select(0, idx), self.counts.index_select(0, idx)
        self.sampling = self.sampling.select(keep)

    # --- emit ------------------------------------------------------------------------------------------
    def _emit(self, out: StepOutput, faults: dict[int, Exception]) -> list[StreamEvent]:
        """Each row takes its tokens and gives its event; a row in `faults`, or whose stop strings, grammar or
        detokenizer raise now, ends with finish_reason "error" (`Row.fail`) and the others go on unchanged."""
        events: list[StreamEvent] = []
        keep: list[int] = []
        ended: list[object] = []  # closed once the batch has its new membership (a failure before: still open)
        for b, r in enumerate(self.rows):
            event = None if b in faults else self._take_tokens(b, r, out)
            if isinstance(event, Exception):
                faults[b] = event
            if b in faults:
                event = r.fail(faults[b])
            if r.done is not None:
                r.stats.output_tokens = len(r.done.token_ids)
                r.stats.wall_time = time.perf_counter() - r.t_start  # this request's latency
                self.stats.output_tokens += len(r.done.token_ids)
                ended.append(r.key)
                events.append(event)
            else:
                keep.append(b)
                if event.delta or event.token_ids:
                    events.append(event)
        self._keep(keep)
        for key in ended:
            self._closed(key)
        return events

    def _take_tokens(self, b: int, r: Row, out: StepOutput) -> StreamEvent | Exception:
        """Row b takes this step's tokens (EOS, budget, stop strings, grammar end): its event, or the exception its
        own code raised (stop strings, grammar, detokenizer) as a RowFault."""
        core, dev = self.core, self.core.device
        try:
            before = len(r.tokens)
            taken = r.take(
                out.tokens[b],
                out.logprobs[b],
                out.raw_logprobs[b],
                out.top[b] if out.top else None,
                core.eos_ids,
                core.max_positions,
            )
            if r.done is None and r.grammar is not None and r.grammar.stuck:
                r.finish("length", None)  # no token of the vocabulary continues its grammar
            if taken:
                self.counts[b].index_add_(0, torch.tensor(taken, device=dev), torch.ones(len(taken), device=dev))
            return r.event(core.tokenizer, before)
        except Exception as e:
            r.done = None  # (a finish before the failure does not stand)
            return row_fault("taking its tokens", e)


def _notify(events: list[tuple[Job, StreamEvent]]) -> list[StreamEvent]:
    """Each event to its job's `on_event`; the events."""
    for job, event in events:
        if job.on_event is not None:
            job.on_event(event)
    return [event for _, event in events]


def _aborted(req: Request, weight_version: int | None, error: Exception | None = None) -> StreamEvent:
    """The last event of a request that ends without a row ("abort", or "error" with `error`): no tokens."""
    reason = "abort" if error is None else "error"
    c = Completion(req.index, list(req.prompt_token_ids), [], "", reason, None, [], [], SpecStats(), key=req.key)
    c.weight_version, c.error = weight_version, error
    c.top_logprobs = [] if req.top_logprobs else None
    return StreamEvent(req.index, "", [], completion=c, key=req.key)
