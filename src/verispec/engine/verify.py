"""A step's verification: one target forward over every row's pending token and draft nodes (`score`), p from the
same processing as plain sampling, then exact verification of the draft against it — `Verification` (chains and
trees, against the randomness's targets of p; a caller may give its own, e.g. the certifier's broken rules) or
`PositionalVerification` (random=position). Both return a `StepOutput` and the forward's width (for the gamma
controller's cost curve); the step's results stay tensors until `outputs` moves them to the host in one transfer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from ..drafting.base import Draft
from ..drafting.batch import BatchView
from ..sampling import verify_chain, verify_tree
from ..sampling.positional import ACCEPT, FINAL, keyed_uniforms, verify_positional
from ..sampling.tree import chain_parents
from .rows import Row, TopLogprobs

__all__ = ["PositionalVerification", "StepOutput", "Verification"]


@dataclass(frozen=True)
class StepOutput:
    """What one verification step gives each row b of the batch."""

    drafted: list[int]  # [B] draft depth: the most tokens the step could accept
    nodes: list[int]  # [B] draft tokens the target checked
    accepted: list[int]  # [B] accepted draft tokens
    paths: list[list[int]]  # [B][accepted]: the accepted draft nodes, root's child first
    tokens: list[list[int]]  # [B][accepted + 1]: accepted tokens, then the recovered / bonus token
    logprobs: list[list[float]]  # [B][accepted + 1]: log p(x) under the processed target distribution
    raw_logprobs: list[list[float]]  # [B][accepted + 1]: log softmax(target logits)(x)
    top: list[list[TopLogprobs]] | None  # [B][accepted + 1]: best raw alternatives, when a row asked for them
    # ([B, D + 1, K] ids, [B, D + 1, K] raw log-probabilities) on the device: the target's top K at each emitted
    # slot (the distribution of emitted token j), when an observer asks (`StepObserver.keep_top`); None otherwise
    targets: tuple[Tensor, Tensor] | None = None

    def cut(self, b: int, keep: int) -> None:
        """Row b emits only its first `keep` tokens of this step."""
        for rows in (self.tokens, self.logprobs, self.raw_logprobs, *([self.top] if self.top else [])):
            del rows[b][keep:]


@dataclass(frozen=True)
class Batch:
    """What verification reads of the session's batch."""

    runner: object  # the target's Runner
    rows: list[Row]
    view: BatchView
    all_identity: bool  # the batch's SamplingMetadata: p is softmax(logits) itself for every row
    keep_top: int = 0  # the target's top K at every emitted slot, for observers that learn (`StepOutput.targets`)


def score(batch: Batch, chunk, ids: Tensor, par: Tensor, parents=None) -> tuple[Tensor, Tensor]:
    """One target forward over each row's chunk (pending token + fed nodes `ids` [B, N] below `par`): the logits
    and the processed p at the root and after every node, [B, N + 1, V] each."""
    logits = batch.runner.forward(chunk, parents=parents)[:, : ids.shape[1] + 1]
    ctx = batch.view.node_context(ids, par)  # each slot's own path: what the drafter's q saw there
    fed = torch.tensor([len(c) for c in chunk], device=logits.device)  # [B]: slots < fed[b] are row b's, the rest junk
    valid = torch.arange(logits.shape[1], device=logits.device) < fed.unsqueeze(1)  # [B, N + 1]
    return logits, batch.view.probs(logits, *ctx, valid=valid)


@dataclass(frozen=True)
class Verification:
    """The verification strategy: chains by `chain` (verify_chain's interface), trees by `tree` (verify_tree's),
    against the randomness's targets of p (`view.randomness`)."""

    chain: Callable = verify_chain
    tree: Callable = verify_tree

    def __call__(self, batch: Batch, draft: Draft) -> tuple[StepOutput, int]:
        view = batch.view
        nn, B = draft.num_nodes, len(batch.rows)
        N = max(nn)
        ids, par = draft.token_ids[:, :N], draft.parents[:, :N]  # [B, N]
        nodes = torch.cat([ids, par], 1).tolist() if N else [[]] * B  # the fed nodes, to the host at once
        chunk = [[r.seq[-1]] + nodes[b][: nn[b]] for b, r in enumerate(batch.rows)]
        parents = None if draft.chain else [[-1] + [p + 1 for p in nodes[b][N : N + nn[b]]] for b in range(B)]
        logits, p = score(batch, chunk, ids, par, parents)  # [B, N + 1, V]: root, then the nodes
        p_v = view.randomness.targets(p, view, draft)  # p itself, or its coupled one-hot targets (gumbel, auto)
        if draft.chain:
            q = draft.probs[:, :N] if draft.probs is not None else None  # [B, N, V]
            out = self.chain(p_v, ids, q, list(nn), view.generators, check=False)
            return outputs(batch, draft, logits, p, out.token_ids, out.num_accepted, None), N + 1
        q = draft.probs[:, : N + 1] if draft.probs is not None else None  # [B, N + 1, V]
        sampled = draft.sampled[:, :N] if draft.sampled is not None else None
        out = self.tree(p_v, ids, par, q, list(nn), view.generators, rule=draft.rule, check=False, sampled=sampled)
        return outputs(batch, draft, logits, p, out.token_ids, out.num_accepted, out.path), N + 1


class PositionalVerification:
    """seeding="position" (chains): the target is fed every draft but each row's last, which is verified against
    the p after the fed ones like any draft (sampling.positional), every uniform keyed by position."""

    def __call__(self, batch: Batch, draft: Draft) -> tuple[StepOutput, int]:
        view, dev = batch.view, batch.view.device
        fed = [max(n - 1, 0) for n in draft.num_nodes]
        F, B = max(fed), len(fed)
        ids = torch.full((B, F + 1), -1, dtype=torch.int64, device=dev)  # [B, F + 1]: drafts at every slot
        width = min(draft.token_ids.shape[1], F + 1)
        ids[:, :width] = draft.token_ids[:, :width]
        node_ids = ids.tolist()  # the fed drafts, to the host at once
        chunk = [[r.seq[-1]] + node_ids[b][: fed[b]] for b, r in enumerate(batch.rows)]
        fed_ids = torch.where(torch.arange(F, device=dev) < torch.tensor(fed, device=dev).unsqueeze(1), ids[:, :F], -1)
        logits, p = score(batch, chunk, fed_ids, chain_parents(B, F, dev))  # [B, F + 1, V]
        q = torch.zeros_like(p) if draft.probs is None else draft.probs[:, : F + 1].to(p.dtype)
        if q.shape[1] < F + 1:
            q = torch.cat([q, torch.zeros_like(p[:, q.shape[1] :])], 1)
        slots = [[n + j for j in range(F + 1)] for n in view.positions]
        uniforms = [keyed_uniforms(view.seeds, slots, purpose, dev) for purpose in (ACCEPT, FINAL)]
        has_last = torch.tensor([n > 0 for n in draft.num_nodes], device=dev)
        out = verify_positional(p, ids, q, torch.tensor(fed, device=dev), *uniforms, has_last=has_last)
        fed_draft = Draft.chain_of(fed_ids, None if draft.probs is None else q, fed)
        return outputs(batch, fed_draft, logits, p, out.token_ids, out.num_accepted, None), F + 1


def outputs(
    batch: Batch, draft: Draft, logits: Tensor, p: Tensor, token_ids: Tensor, num_accepted: Tensor, path: Tensor | None
) -> StepOutput:
    """Emitted tokens with their processed and raw target logprobs at their slots, moved to the host in one
    transfer (top alternatives, when a row asks for them, in one more). logits, p [B, N + 1, V]; token_ids
    [B, D + 1] (-1 padded); num_accepted [B]; path [B, D] (trees: the accepted nodes, -1 padded; chains: None)."""
    B, D1 = token_ids.shape
    dev = logits.device
    tok = token_ids.clamp(min=0).unsqueeze(-1)  # [B, D + 1, 1] (padding -> 0, never read)
    if path is None:  # a chain: the emitted token j sits at slot j
        p_e, logits_e = p[:, :D1], logits[:, :D1]
    else:  # slot 0 (the root), then the accepted path's nodes (padding -> the root, never read)
        slots = torch.cat([torch.zeros((B, 1), dtype=torch.int64, device=dev), path[:, : D1 - 1] + 1], 1)
        sl = slots.unsqueeze(-1).expand(-1, -1, logits.shape[-1])
        p_e, logits_e = p.gather(1, sl), logits.gather(1, sl)  # [B, D + 1, V]
    lp = p_e.gather(-1, tok).squeeze(-1).log()  # [B, D + 1]
    n_top = max(r.top_logprobs for r in batch.rows)
    log_z = raw = None
    if n_top or not batch.all_identity or batch.keep_top:
        log_z = logits_e.logsumexp(-1, keepdim=True)  # [B, D + 1, 1]
        raw = (logits_e.gather(-1, tok) - log_z).squeeze(-1)
    # one transfer: the rows the guard failed, accepted, tokens, logprobs, raw logprobs (where they differ) and the
    # tree's path, as float64 (token ids and node indices < 2^53 are exact)
    bad = batch.view.bad if batch.view.bad is not None else torch.zeros(B, dtype=torch.bool, device=dev)
    parts = [bad.view(B, 1), num_accepted.view(B, 1), token_ids, lp, *([raw] if raw is not None else [])]
    if path is not None:
        parts.append(path)
    host = [h[1:] for h in batch.view.settle(torch.cat([x.to(torch.float64) for x in parts], 1).tolist())]
    accepted = [int(h[0]) for h in host]

    def emitted(i: int) -> list[list[float]]:  # part i's columns for each row's emitted tokens
        return [h[1 + i * D1 : 2 + i * D1 + a] for h, a in zip(host, accepted)]

    tokens = [[int(t) for t in row] for row in emitted(0)]
    lps = emitted(1)
    raws = emitted(2) if raw is not None else lps
    paths = [list(range(a)) for a in accepted]
    if path is not None:  # after the other parts
        start = 1 + (len(parts) - 3) * D1
        paths = [[int(n) for n in h[start : start + a]] for h, a in zip(host, accepted)]
    top = _top(logits_e, log_z, n_top) if n_top else None
    targets = None
    if batch.keep_top:
        values, top_ids = logits_e.topk(min(batch.keep_top, logits_e.shape[-1]), dim=-1)  # [B, D + 1, K]
        targets = (top_ids, values - log_z)
    return StepOutput(
        drafted=list(draft.depth),
        nodes=list(draft.num_nodes),
        accepted=accepted,
        paths=paths,
        tokens=tokens,
        logprobs=lps,
        raw_logprobs=raws,
        top=None if top is None else [row[: a + 1] for row, a in zip(top, accepted)],
        targets=targets,
    )


def _top(logits_e: Tensor, log_z: Tensor, n_top: int) -> list[list[TopLogprobs]]:
    """[B][D + 1]: the n_top best raw alternatives at each emitted slot (logits_e [B, D + 1, V])."""
    values, top_ids = logits_e.topk(n_top, dim=-1)  # [B, D + 1, n_top]
    return [
        [list(zip(i, v)) for i, v in zip(ids_b, vals_b)]
        for ids_b, vals_b in zip(top_ids.tolist(), (values - log_z).tolist())
    ]
