"""The speculative step and the scheduler, with one home: a `GenerationSession` runs jobs of requests on an
`EngineCore` — requests join the batch (whole groups, at most `max_batch` rows) and leave it (they finish, or are
aborted) between steps: continuous batching — and runs `Barrier`s (weight updates) between jobs, so that every job
is drawn under one weight version, which its completions report. While rows run, a prompt longer than
`prefill_chunk` is prefilled outside the batch, one chunk per step, and joins once complete (chunked prefill).

    draft  -> the proposer's `Draft` (a token tree per row; a chain is the tree with parents -1, 0, 1, ...)
    verify -> one target forward over every row's pending token and draft nodes, p from the same processing as
              plain sampling, verify_chain (chains) or verify_tree (trees): a `StepOutput`
    commit -> the target's cache keeps each row's accepted path (`keep_paths`), the proposer its own
    emit   -> each row takes its tokens (EOS, budget, stop strings) and yields a `StreamEvent`

A request's randomness is its own generator, and with a fixed draft length its tokens do not depend on which
other requests share the batch (as far as the kernels are batch-invariant; see `verispec.engine.generator`); under
random=auto (the default) a request that carries a seed is Gumbel-coupled instead (`engine.randomness`): its tokens
depend on neither gamma (auto included), the batch nor the load.
Not thread-safe: drive it from one thread (the server's engine thread does); `Barrier.wait` is the one call meant
for other threads.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import torch
from torch import Tensor

from ..drafting import Draft
from ..drafting.grammar import fit_draft
from ..model.protocol import Staged, Staging
from ..sampling import SamplingMetadata, SamplingParams
from ..drafting.batch import BatchView
from .core import EngineCore, check_prefill_chunk
from .request import Barrier, Job, Request, check_limits
from .rows import Completion, Row, RowFault, StreamEvent
from .stats import SpecStats
from .verify import Batch, StepOutput

__all__ = ["GenerationSession", "StepOutput", "check_limits"]


@dataclass(eq=False)
class _Live:
    """A submitted job while it is unfinished: how many of its requests joined the batch, how many are still open."""

    job: Job
    admitted: int = 0
    open: int = 0


@dataclass(eq=False)
class _Prefill:
    """Admitted rows sharing one long prompt while it is prefilled outside the batch, a chunk per step (the runner's
    `Staged`); they hold their batch slots and join it together once the prompt is complete."""

    rows: list[Row]
    staged: Staged


class GenerationSession:
    """Continuous batching and scheduling over one EngineCore; `step()` admits what the queue allows and runs one
    draft + verify step for every row in the batch (see the module docstring). `max_batch`: the most rows at once
    (None: no bound), rows being prefilled included. `prefill_chunk`: while rows run, a prompt longer than this is
    prefilled outside the batch, at most this many prompt tokens per step in all, and joins once complete (chunked
    prefill: the running rows wait one chunk per step, not a whole prompt); 0: every prompt whole at admission;
    None: the core's (`EngineCore.prefill_chunk`)."""

    def __init__(self, core: EngineCore, max_batch: int | None = None, prefill_chunk: int | None = None):
        core = getattr(core, "core", core)  # a SpeculativeGenerator passes its core
        if max_batch is not None and (isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1):
            raise ValueError(f"max_batch must be None or an integer >= 1, got {max_batch!r}")
        self.core = core
        self.max_batch = max_batch
        self.prefill_chunk = check_prefill_chunk(core.prefill_chunk if prefill_chunk is None else prefill_chunk)
        self.rows: list[Row] = []  # in the batch, in cache row order
        self.prefilling: list[_Prefill] = []  # admitted rows whose prompts are being prefilled, in admission order
        self.queue: deque[_Live | Barrier] = deque()  # jobs not fully admitted and barriers, in submission order
        self.stats = SpecStats()  # pooled over this session
        self.prompt_mask: Tensor | None = None  # [B, V] bool: tokens in each row's prompt
        self.counts: Tensor | None = None  # [B, V] float32: each row's generated-token counts
        self.last_step: list[tuple[int, int]] = []  # (drafted, accepted) per row of the last step, for metrics
        self.sampling: SamplingMetadata | None = None  # self.rows' params as tensors (rebuilt in _join / _keep)
        self._live: dict[object, _Live] = {}  # job key -> its state, while unfinished
        self._owner: dict[object, _Live] = {}  # request key -> its job's state, while the request is unfinished

    # --- submitting ---------------------------------------------------------------------------------------
    @property
    def pending(self) -> list[Request]:
        """Submitted requests that have not joined the batch yet (being prefilled, then queued), in the order they
        will."""
        staged = [self._request(r.key) for p in self.prefilling for r in p.rows]
        queued = [r for item in self.queue if isinstance(item, _Live) for r in item.job.requests[item.admitted :]]
        return staged + queued

    @property
    def num_active(self) -> int:
        """Requests in the batch or waiting to join it."""
        return len(self.rows) + len(self.pending)

    @property
    def idle(self) -> bool:
        """Nothing to run: no row, no prompt being prefilled, no queued job, no barrier."""
        return not self.rows and not self.prefilling and not self.queue

    def submit(self, job: Job) -> object:
        """Queue a job (its requests checked against the core now); it starts once every barrier submitted before it
        has run. Returns its key."""
        if job.key in self._live:
            raise ValueError(f"a job with key {job.key!r} is already in this session")
        for req in job.requests:
            self.core.check(req)
            if req.key in self._owner:
                raise ValueError(f"a request with key {req.key!r} is already in this session")
        job.weight_version = None  # set when it starts in this session (a job submitted again starts anew)
        live = _Live(job, open=len(job.requests))
        self._live[job.key] = live
        for req in job.requests:
            self._owner[req.key] = live
        self.queue.append(live)
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

    def abort(self, key: object) -> list[StreamEvent]:
        """End a job (by its key) or one request (by its key) now: each unfinished request's last event, finish_reason
        "abort", with the tokens it has (none when it had not joined the batch). Unknown keys: []."""
        if key in self._live:
            live = self._live[key]
            keys = [r.key for r in live.job.requests if self._owner.get(r.key) is live]
        elif key in self._owner:
            keys = [key]
        else:
            return []
        events = []
        running = {r.key: b for b, r in enumerate(self.rows)}
        for k in keys:
            b = running.get(k)
            if b is None:
                live = self._owner[k]
                req = next(r for r in live.job.requests if r.key == k)
                events.append(_aborted(req, live.job.weight_version))
            else:
                row = self.rows[b]
                row.finish("abort", None)
                events.append(row.event(self.core.tokenizer, len(row.tokens)))
            self._closed(k)
        self._unstage()
        self._keep([b for b, r in enumerate(self.rows) if r.key in self._owner])
        self.queue = deque(x for x in self.queue if isinstance(x, Barrier) or self._waiting(x))
        return events

    def step(self) -> list[StreamEvent]:
        """Admit what the queue allows (running barriers that are due), then one step for the rows in the batch;
        returns this step's events (a finished request's last event carries its Completion)."""
        self.schedule()
        return self.run()

    def run(self) -> list[StreamEvent]:
        """One draft + verify step for the rows in the batch (none: no events)."""
        if not self.rows:
            return []
        view = self._view(penalties=any(r.params.uses_penalties for r in self.rows))
        draft = self._draft(view)
        out = self._verify(view, draft)
        faults: dict[int, Exception] = {b: RowFault(why) for b, why in view.faults.items()}  # row -> its failure
        self._commit(view, draft, out, faults)
        return self._emit(out, faults)

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

    def _take(self, live: _Live, joining: list[Row]) -> bool:
        """Rows for the job's next groups while they fit; True once every request of the job has joined."""
        job = live.job
        if job.weight_version is None:
            job.weight_version = self.core.weight_version
        staged = sum(len(p.rows) for p in self.prefilling)  # rows being prefilled hold their slots
        while live.admitted < len(job.requests):
            held = len(self.rows) + staged + len(joining)
            free = (self.max_batch or 1 << 30) - held
            size = min(job.group - live.admitted % job.group, len(job.requests) - live.admitted)
            if free <= 0 or (size > free and held):
                return False
            for req in job.requests[live.admitted : live.admitted + min(size, free)]:
                live.admitted += 1
                if req.key not in self._owner:  # aborted before it joined
                    continue
                row = Row.of(req, job.weight_version, 0 if self.core.proposer is None else req.gamma)
                row.grammar = self.core.grammar_state(req)
                joining.append(row)
                if job.on_admit is not None:
                    job.on_admit(req)
        return True

    def _waiting(self, live: _Live) -> bool:
        """Whether the job still has requests to admit (not aborted)."""
        return any(r.key in self._owner for r in live.job.requests[live.admitted :])

    def _request(self, key: object) -> Request:
        """An unfinished request, by its key."""
        return next(r for r in self._owner[key].job.requests if r.key == key)

    def _closed(self, key: object) -> None:
        """A request ended (finished or aborted): its job ends with its last one."""
        live = self._owner.pop(key, None)
        if live is None:
            return
        live.open -= 1
        if live.open == 0:
            self._live.pop(live.job.key, None)

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
        """Free what the session holds outside the batch (prompts being prefilled: on llama.cpp, sequences and cells
        of the shared context); call it when dropping a session that has not run to idle."""
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
        # a draft cache may lag behind by a backlog fed in one chunk (plain probes; rows another drafter served for
        # several steps: up to a whole output), and a ragged chunk is written up to the longest row + the longest chunk
        draft_capacity = capacity + max(core.controller.probe_every, max(r.max_new for r in new)) + 2
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

    # --- draft ----------------------------------------------------------------------------------------
    def _room(self) -> list[int]:
        """Per row, the most draft tokens its budget and the context leave room for (the step adds one more)."""
        end = self.core.max_positions or 1 << 30
        return [min(r.max_new - len(r.tokens), end - len(r.seq)) - 1 for r in self.rows]

    def _caps(self) -> list[int]:
        """Per row, the most draft tokens to draft: its room, and its gamma (or the controller's choice)."""
        caps = self._room()
        core = self.core
        if core.proposer is not None and core.proposer.tree is not None:  # the tree's shape sets the draft
            return [0 if r.gamma == 0 else c for r, c in zip(self.rows, caps)]
        controller, B = core.controller, len(self.rows)
        probe = controller.wants_plain_probe(B)  # measure T(1) at this batch size once
        return [
            max(0, min(r.gamma, c))
            if r.gamma is not None
            else 0
            if probe
            else controller.choose(r.successes, r.failures, c, r.stats.target_passes, batch=B)
            for r, c in zip(self.rows, caps)
        ]

    def _draft(self, view: BatchView) -> Draft:
        core = self.core
        caps = self._caps()
        t0 = time.perf_counter()
        if core.proposer is not None:  # also with every cap 0: its state then follows the step (update)
            if core.randomness.lookahead:  # drafts past those the target is fed (positional seeding: one)
                caps = [c + core.randomness.lookahead for c in caps]
            draft = core.proposer.propose(view, caps)
        else:
            draft = Draft.empty(len(self.rows), core.device)
        seconds = time.perf_counter() - t0
        self.stats.draft_time += seconds
        if draft.chain and max(draft.num_nodes) > 0:
            core.controller.observe_draft(seconds / max(draft.num_nodes), len(self.rows))
        if view.grammars is not None and core.proposer is not None:  # cut before refused tokens, jump forward
            # not where the row drafts nothing this step (speculation off, the controller's plain probe), nor under
            # position seeding (a forced token's one-hot q would make a seed's tokens depend on where steps start)
            room = [c if cap > 0 else 0 for c, cap in zip(self._room(), caps)]
            jump = 0 if core.randomness.name == "position" else core.jump
            draft = fit_draft(draft, view.grammars, room, jump)
        return draft

    # --- verify ---------------------------------------------------------------------------------------
    def _verify(self, view: BatchView, draft: Draft) -> StepOutput:
        """One target forward over the pending tokens and the drafts, then exact verification (the core's)."""
        core, t0 = self.core, time.perf_counter()
        batch = Batch(core.runner, self.rows, view, self.sampling.all_identity)
        step, width = core.verification(batch, draft)
        seconds = time.perf_counter() - t0
        self.stats.verify_time += seconds
        if draft.chain:
            core.controller.observe_verify(width, seconds, len(self.rows))
        return step

    # --- commit and emit ------------------------------------------------------------------------------
    def _commit(self, view: BatchView, draft: Draft, out: StepOutput, faults: dict[int, Exception]) -> None:
        """Keep each row's pending token and accepted path in the target's cache (everything else is dropped),
        append the emitted tokens, count the step, and let the proposer roll its own state forward. A row whose
        grammar raises joins `faults` (it ends in `_emit`; a faulty row's state stays consistent until then)."""
        core = self.core
        old_lengths = [len(r.seq) for r in self.rows]
        core.runner.keep_paths([n - 1 for n in old_lengths], [[0] + [n + 1 for n in path] for path in out.paths])
        for b, r in enumerate(self.rows):
            if r.grammar is not None and b not in faults:
                try:
                    _cut(out, b, r.grammar.advance(out.tokens[b]))  # past a dead end: nothing (the row ends there)
                except Exception as e:  # this request's grammar: it fails alone
                    faults[b] = _row_fault("its grammar", e)
            r.seq.extend(out.tokens[b])  # view.seqs are these lists: the proposer sees the committed tokens
            if b in faults:  # its step verified a placeholder: not counted anywhere
                continue
            r.observe(out.drafted[b], out.accepted[b], out.nodes[b])
            self.stats.observe(out.drafted[b], out.accepted[b], out.nodes[b])
            if draft.chain:
                core.controller.observe_acceptance(out.accepted[b], int(out.accepted[b] < out.drafted[b]))
        if core.proposer is not None:
            core.proposer.update(view, old_lengths, draft, out.paths)
        self.last_step = list(zip(out.drafted, out.accepted))

    def _emit(self, out: StepOutput, faults: dict[int, Exception]) -> list[StreamEvent]:
        """Each row takes its tokens and gives its event; a row in `faults`, or whose stop strings, grammar or
        detokenizer raise now, ends with finish_reason "error" (`Row.fail`) and the others go on unchanged."""
        events: list[StreamEvent] = []
        keep: list[int] = []
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
                self._closed(r.key)
                events.append(event)
            else:
                keep.append(b)
                if event.delta or event.token_ids:
                    events.append(event)
        self._keep(keep)
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
            return _row_fault("taking its tokens", e)


def _row_fault(where: str, e: Exception) -> RowFault:
    """A request's own failure inside a step, as the RowFault that ends it (the cause kept)."""
    fault = RowFault(f"{where} failed: {type(e).__name__}: {e}")
    fault.__cause__ = e
    return fault


def _cut(out: StepOutput, b: int, keep: int) -> None:
    """Row b emits only its first `keep` tokens of this step."""
    for rows in (out.tokens, out.logprobs, out.raw_logprobs, *([out.top] if out.top else [])):
        del rows[b][keep:]


def _aborted(req: Request, weight_version: int | None) -> StreamEvent:
    """The last event of a request aborted before it joined the batch: no tokens."""
    c = Completion(
        index=req.index,
        prompt_token_ids=list(req.prompt_token_ids),
        token_ids=[],
        text="",
        finish_reason="abort",
        stop_reason=None,
        logprobs=[],
        raw_logprobs=[],
        stats=SpecStats(),
        top_logprobs=[] if req.top_logprobs else None,
        key=req.key,
        weight_version=weight_version,
    )
    return StreamEvent(req.index, "", [], completion=c, key=req.key)
