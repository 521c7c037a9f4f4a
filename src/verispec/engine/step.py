"""The speculative step, top to bottom (the session, `engine.session`, decides which rows run):

    draft   the proposer's Draft: a token tree per row below its pending token (a chain: parents -1, 0, 1, ...)
    fit     a constrained row's chain cut before the first token its grammar refuses, then jump-forward tokens
    score   one target forward over every row's pending token and draft nodes; p from the same processing as q
    verify  verify_chain / verify_block (chains) or verify_tree (trees), against the randomness's targets of p
    commit  the target's cache keeps each row's accepted path, the rows their tokens, the proposer its own state

Results stay tensors until one host transfer (`engine.verify.outputs`); observers see the step after each stage.
"""

from __future__ import annotations

import time
from typing import NamedTuple

from ..drafting import Draft
from ..drafting.batch import BatchView
from ..drafting.grammar import fit_draft
from .core import EngineCore
from .rows import Row, RowFault
from .stats import SpecStats
from .verify import Batch, StepOutput

__all__ = ["Plan", "draft_plan", "speculative_step"]


def speculative_step(
    core: EngineCore, rows: list[Row], view: BatchView, all_identity: bool, stats: SpecStats
) -> tuple[StepOutput, dict[int, Exception]]:
    """One draft -> fit -> score -> verify -> commit step for `rows` (the batch `view` shows, in cache row order).
    all_identity: p is softmax(logits) for every row (no processing). Returns the step's output and the rows that
    failed in it (row -> its RowFault; they end in the session, the others go on unchanged)."""
    B, t0 = len(rows), time.perf_counter()
    plan = draft_plan(core, rows, view)
    view.sources = plan.sources
    t_plan = time.perf_counter()
    if core.proposer is None:
        draft = Draft.empty(B, core.device)
    else:  # also with every cap 0: the proposer's state then follows the step (update)
        draft = core.proposer.propose(view, [c + core.randomness.lookahead for c in plan.caps])
    draft = _observed(core, "after_draft", view, draft)
    if view.grammars is not None and core.proposer is not None:
        # not where a request turned speculation off (gamma 0), nor under position seeding (a forced token's one-hot
        # q would make a seed's tokens depend on where steps start); the controller's plain steps jump too
        room = [0 if r.gamma == 0 else n for r, n in zip(rows, room_left(core, rows))]
        fitted = fit_draft(draft, view.grammars, room, 0 if core.randomness.name == "position" else core.jump)
        draft = _observed(core, "after_fit", view, draft, fitted)
    t1 = time.perf_counter()
    stats.draft_time += t1 - t0
    _observe_draft(core, draft, plan, t1 - t_plan)

    out, width = core.verification(Batch(core.runner, rows, view, all_identity, core.keep_top), draft)  # score, verify
    seconds = time.perf_counter() - t1
    stats.verify_time += seconds
    if draft.chain:
        core.controller.observe_verify(width, seconds, B)
    for o in core.observers:
        o.after_verify(view, draft, out)

    faults: dict[int, Exception] = {b: RowFault(why) for b, why in view.faults.items()}
    commit(core, rows, view, draft, out, faults, stats, plan)
    for o in core.observers:
        o.after_commit(view, out)
    return out, faults


def _observe_draft(core: EngineCore, draft: Draft, plan: Plan, seconds: float) -> None:
    """The drafting seconds per source that drafted (a proposer with several times each, `source_seconds`; else the
    step's drafting time, when one source drafted), over the most tokens a row asked of it."""
    if not draft.chain:
        return
    deepest: dict[int, int] = {}
    for s, n, cap in zip(plan.sources, draft.num_nodes, plan.caps):
        if min(n, cap):
            deepest[s] = max(deepest.get(s, 0), min(n, cap))
    timed = getattr(core.proposer, "source_seconds", None)
    for s, tokens in deepest.items():
        if timed is not None or len(deepest) == 1:
            core.controller.observe_draft(timed[s] if timed is not None else seconds, tokens, len(plan.caps), s)


def commit(
    core, rows, view, draft, out: StepOutput, faults: dict[int, Exception], stats: SpecStats, plan: Plan | None = None
) -> None:
    """Keep each row's pending token and accepted path in the target's cache (everything else is dropped), append
    the emitted tokens, count the step, and let the proposer roll its own state forward. A row whose grammar
    raises joins `faults` (its state stays consistent until the session ends it)."""
    old_lengths = [len(r.seq) for r in rows]
    core.runner.keep_paths([n - 1 for n in old_lengths], [[0] + [n + 1 for n in path] for path in out.paths])
    for b, r in enumerate(rows):
        if r.grammar is not None and b not in faults:
            try:
                out.cut(b, r.grammar.advance(out.tokens[b]))  # past a dead end: nothing (the row ends there)
            except Exception as e:  # this request's grammar: it fails alone
                faults[b] = row_fault("its grammar", e)
        r.seq.extend(out.tokens[b])  # view.seqs are these lists: the proposer sees the committed tokens
        if b in faults:  # its step verified a placeholder: not counted anywhere
            continue
        r.observe(out.drafted[b], out.accepted[b], out.nodes[b])
        stats.observe(out.drafted[b], out.accepted[b], out.nodes[b])
        if draft.chain and plan is not None:
            own = min(out.drafted[b], plan.caps[b])  # the drafter's tokens (grammar-forced ones follow them)
            accepted = min(out.accepted[b], own)
            core.controller.observe_acceptance(r.evidence, plan.sources[b], plan.buckets[b], own, accepted)
    if core.proposer is not None:
        core.proposer.update(view, old_lengths, draft, out.paths)


def room_left(core: EngineCore, rows: list[Row]) -> list[int]:
    """Per row, the most draft tokens its budget and the context leave room for (the step adds one more)."""
    end = core.max_positions or 1 << 30
    return [min(r.max_new - len(r.tokens), end - len(r.seq)) - 1 for r in rows]


class Plan(NamedTuple):
    """Per row, what a step drafts: the most tokens (`caps`), from which draft source, in which signal bucket."""

    caps: list[int]
    sources: list[int]
    buckets: list  # the source's signal bucket (None: no signal)


def draft_plan(core: EngineCore, rows: list[Row], view: BatchView) -> Plan:
    """Per row: its room, and its gamma (a request's own, or the controller's choice from the drafter's signals)."""
    caps, B = room_left(core, rows), len(rows)
    none = [None] * B
    if core.proposer is None:
        return Plan([0] * B, [0] * B, none)
    if core.proposer.tree is not None:  # the tree's shape sets the draft
        return Plan([0 if r.gamma == 0 else c for r, c in zip(rows, caps)], [0] * B, none)
    controller, several = core.controller, len(core.proposer.source_costs) > 1
    auto = [b for b, r in enumerate(rows) if r.gamma is None]
    asks = several or (controller.fixed is None and auto)
    signals = core.proposer.signals(view) if asks else [None] * B
    chosen = [  # a request's own gamma: the first source that can draft
        (next((s for s, x in enumerate(sig or ()) if x is not None), 0), max(0, min(r.gamma or 0, c)))
        for r, c, sig in zip(rows, caps, signals)
    ]
    floor = max((chosen[b][1] for b in range(B) if b not in auto), default=0)
    picks = controller.plan([(rows[b].evidence, signals[b], caps[b]) for b in auto], B, floor)
    for b, pick in zip(auto, picks):
        chosen[b] = pick
    sources = [s for s, _ in chosen]
    buckets = [None if sig is None or sig[s] is None else sig[s].bucket for sig, s in zip(signals, sources)]
    return Plan([g for _, g in chosen], sources, buckets)


def row_fault(where: str, e: Exception) -> RowFault:
    """A request's own failure inside a step, as the RowFault that ends it (the cause kept)."""
    fault = RowFault(f"{where} failed: {type(e).__name__}: {e}")
    fault.__cause__ = e
    return fault


def _observed(core: EngineCore, hook: str, view: BatchView, *drafts: Draft) -> Draft:
    """The draft after every observer's `hook` (one that returns a Draft replaces it)."""
    draft = drafts[-1]
    for o in core.observers:
        draft = getattr(o, hook)(view, *drafts[:-1], draft) or draft
    return draft
