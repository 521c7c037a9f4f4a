"""A step's verification, chosen when the engine is built: one target forward over every row's pending token and
draft nodes, p from the same processing as plain sampling, then exact verification of the draft against it.

    Verification            chains with a chain rule (verify_chain: token-wise; verify_block), trees with
                            verify_tree (each tree rule); the randomness's `targets` transform p (Gumbel coupling:
                            every row under gumbel, the seeded requests' rows under auto)
    PositionalVerification  seeding "position" (chains): every uniform keyed by (seed, position, purpose), the
                            step's last draft verified without being fed (`sampling.positional`)

Both return a `StepOutput` and the forward's width (for the gamma controller's cost curve). The verification
functions are the ones the engine was built with: `certify` injects its deliberate bugs there, behind the same
interfaces (`certify.bugs`), never as parameters of these functions.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from ..drafting.base import Draft
from ..sampling.positional import ACCEPT, FINAL, keyed_uniforms, verify_positional
from ..sampling.tree import chain_parents
from ..drafting.batch import BatchView
from ..sampling.randomness import Randomness
from .rows import Row, TopLogprobs

__all__ = ["PositionalVerification", "StepOutput", "Verification", "make_verification"]


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


@dataclass(frozen=True)
class Batch:
    """What verification reads of the session's batch."""

    runner: object  # the target's Runner
    rows: list[Row]
    view: BatchView
    all_identity: bool  # the batch's SamplingMetadata: p is softmax(logits) itself for every row


def score(batch: Batch, chunk, ids: Tensor, par: Tensor, parents=None) -> tuple[Tensor, Tensor]:
    """One target forward over each row's chunk (pending token + fed nodes `ids` [B, N] below `par`): the logits
    and the processed p at the root and after every node, [B, N + 1, V] each."""
    logits = batch.runner.forward(chunk, parents=parents)[:, : ids.shape[1] + 1]
    ctx = batch.view.node_context(ids, par)  # each slot's own path: what the drafter's q saw there
    fed = torch.tensor([len(c) for c in chunk], device=logits.device)  # [B]: slots < fed[b] are row b's, the rest junk
    valid = torch.arange(logits.shape[1], device=logits.device) < fed.unsqueeze(1)  # [B, N + 1]
    return logits, batch.view.probs(logits, *ctx, valid=valid)


class Verification:
    """Chains by `chain` (verify_chain's interface), trees by `tree` (verify_tree's), against the randomness's
    targets of p."""

    def __init__(self, chain: Callable, tree: Callable, randomness: Randomness):
        self.chain, self.tree, self.randomness = chain, tree, randomness

    def __call__(self, batch: Batch, draft: Draft) -> tuple[StepOutput, int]:
        rows, view, dev = batch.rows, batch.view, batch.view.device
        nn = draft.num_nodes
        N = max(nn)
        ids, par = draft.token_ids[:, :N], draft.parents[:, :N]  # [B, N]
        node_ids, node_par = ids.tolist(), par.tolist()
        chunk = [[r.seq[-1]] + node_ids[b][: nn[b]] for b, r in enumerate(rows)]
        parents = None if draft.chain else [[-1] + [p + 1 for p in node_par[b][: nn[b]]] for b in range(len(rows))]
        logits, p = score(batch, chunk, ids, par, parents)  # [B, N + 1, V]: root, then the nodes
        num = torch.tensor(nn, device=dev)
        p_v = self.randomness.targets(p, view, draft)  # p itself, or its coupled one-hot targets (gumbel, auto)
        if draft.chain:
            q = draft.probs[:, :N] if draft.probs is not None else None  # [B, N, V]
            out = self.chain(p_v, ids, q, num, view.generators, check=False)
            accepted = out.num_accepted.tolist()
            paths = [list(range(a)) for a in accepted]
        else:
            q = draft.probs[:, : N + 1] if draft.probs is not None else None  # [B, N + 1, V]
            sampled = draft.sampled[:, :N] if draft.sampled is not None else None
            out = self.tree(p_v, ids, par, q, num, view.generators, rule=draft.rule, check=False, sampled=sampled)
            accepted = out.num_accepted.tolist()
            paths = [row[:a] for row, a in zip(out.path.tolist(), accepted)]
        return outputs(batch, draft, logits, p, out.token_ids, paths, accepted), N + 1


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
        node_ids = ids.tolist()
        chunk = [[r.seq[-1]] + node_ids[b][: fed[b]] for b, r in enumerate(batch.rows)]
        fed_ids = torch.where(torch.arange(F, device=dev) < torch.tensor(fed, device=dev).unsqueeze(1), ids[:, :F], -1)
        logits, p = score(batch, chunk, fed_ids, chain_parents(B, F, dev))  # [B, F + 1, V]
        q = torch.zeros_like(p) if draft.probs is None else draft.probs[:, : F + 1].to(p.dtype)
        if q.shape[1] < F + 1:
            q = torch.cat([q, torch.zeros_like(p[:, q.shape[1] :])], 1)
        slots = [[n + j for j in range(F + 1)] for n in view.positions]
        out = verify_positional(
            p,
            ids,
            q,
            torch.tensor(fed, device=dev),
            keyed_uniforms(view.seeds, slots, ACCEPT, dev),
            keyed_uniforms(view.seeds, slots, FINAL, dev),
            has_last=torch.tensor([n > 0 for n in draft.num_nodes], device=dev),
        )
        accepted = out.num_accepted.tolist()
        fed_draft = Draft.chain_of(fed_ids, None if draft.probs is None else q, fed)
        paths = [list(range(a)) for a in accepted]
        return outputs(batch, fed_draft, logits, p, out.token_ids, paths, accepted), F + 1


def make_verification(chain: Callable, tree: Callable, randomness: Randomness):
    """The step verification for these verification functions and this randomness."""
    return PositionalVerification() if randomness.name == "position" else Verification(chain, tree, randomness)


def outputs(
    batch: Batch,
    draft: Draft,
    logits: Tensor,
    p: Tensor,
    token_ids: Tensor,
    paths: list[list[int]],
    accepted: list[int],
) -> StepOutput:
    """Emitted tokens with their processed and raw target logprobs (and top alternatives) at their slots.
    logits, p [B, N + 1, V]; token_ids [B, D + 1] (-1 padded)."""
    B, D1 = token_ids.shape
    tok = token_ids.clamp(min=0).unsqueeze(-1)  # [B, D + 1, 1] (padding -> 0, never read)
    if draft.chain:  # the emitted token j sits at slot j
        p_e, logits_e = p[:, :D1], logits[:, :D1]
    else:  # slot 0 (the root), then the accepted path's nodes
        slots = torch.zeros((B, D1), dtype=torch.int64)
        for b, path in enumerate(paths):
            slots[b, 1 : len(path) + 1] = torch.tensor([n + 1 for n in path], dtype=torch.int64)
        sl = slots.to(logits.device).unsqueeze(-1).expand(-1, -1, logits.shape[-1])
        p_e, logits_e = p.gather(1, sl), logits.gather(1, sl)  # [B, D + 1, V]
    lp = p_e.gather(-1, tok).squeeze(-1).log().tolist()  # [B][D + 1]
    n_top = max(r.top_logprobs for r in batch.rows)
    log_z = None
    if n_top or not batch.all_identity:
        log_z = logits_e.logsumexp(-1, keepdim=True)  # [B, D + 1, 1]
        raw = (logits_e.gather(-1, tok) - log_z).squeeze(-1).tolist()
    else:  # p is softmax(logits) itself (temperature 1, no processing): no second pass over [B, D + 1, V]
        raw = lp
    top = _top(logits_e, log_z, n_top) if n_top else None
    cut = lambda rows: [row[: a + 1] for row, a in zip(rows, accepted)]  # noqa: E731
    return StepOutput(
        drafted=list(draft.depth),
        nodes=list(draft.num_nodes),
        accepted=accepted,
        paths=paths,
        tokens=cut(token_ids.tolist()),
        logprobs=cut(lp),
        raw_logprobs=cut(raw),
        top=None if top is None else cut(top),
    )


def _top(logits_e: Tensor, log_z: Tensor, n_top: int) -> list[list[TopLogprobs]]:
    """[B][D + 1]: the n_top best raw alternatives at each emitted slot (logits_e [B, D + 1, V])."""
    values, top_ids = logits_e.topk(n_top, dim=-1)  # [B, D + 1, n_top]
    return [
        [list(zip(i, v)) for i, v in zip(ids_b, vals_b)]
        for ids_b, vals_b in zip(top_ids.tolist(), (values - log_z).tolist())
    ]
