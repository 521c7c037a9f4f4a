"""Where a step's randomness comes from — one setting, chosen when the engine is built, that the drafter and the
verifier both follow (no per-step branching on strings):

    auto      per request (the default): a request that carries its own seed (SamplingParams.seed) is Gumbel-coupled,
              keyed by that seed and its output positions, so the same request with the same seed gives the same
              tokens whatever gamma (auto included), the batch or the load; a request without one (its seed drawn)
              draws from its stream, exactly as `stream` would — a batch with no seeded row costs what stream costs;
    stream    each request's uniforms come from its own torch.Generator in draw order (with a fixed gamma a seeded
              request repeats alone or in any batch; under gamma auto the draft lengths, and so which uniform each
              position uses, follow timings);
    position  every uniform keyed by (request seed, output position, purpose) (`sampling.positional`): a seeded
              request's tokens then do not depend on gamma, the batch or timing; the drafter drafts one position
              past those it feeds the target (`lookahead`);
    gumbel    every output token is the exponential race of the target's p under noise keyed by (seed, position),
              and a draft model races with the same noise (`sampling.coupling`): a transform of p (`targets`).

Under auto (and gumbel) a seeded request's every token is the race winner of the target's p at its position, so
its output is plain decoding's under the coupling, token for token, for every drafter, tree and verification rule.
The price, for those requests alone: where q is one-hot (prompt lookup, history) the chance a draft is kept is
p(draft), as under the classic rule; a draft model's sampled chains agree with the target's race less often than
the classic rule accepts (between (1 - TV) / (1 + TV) and 1 - TV per position instead of 1 - TV).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .chain import sample_from_weights
from .coupling import coupled_draws, coupled_targets
from .positional import DRAFT, keyed_uniforms

__all__ = ["RANDOMNESS", "Randomness", "randomness", "slot_positions"]


class Randomness:
    """stream: per-request generators, in draw order."""

    name = "stream"
    lookahead = 0  # positions drafted past the last one the target is fed

    def draw(self, q: Tensor, view, offset: int, active: Sequence[bool]) -> Tensor:  # q [B, V] -> [B] int64
        """A drafter's tokens at output positions view.positions[b] + offset, drawn from q (rows not `active` draw
        nothing and consume no randomness; their entry is junk)."""
        u = torch.zeros(len(active), dtype=torch.float64)
        for b, a in enumerate(active):
            if a:
                u[b] = torch.rand((), dtype=torch.float64, generator=view.generators[b])
        return sample_from_weights(q, u.to(q.device))

    def targets(self, p: Tensor, view, draft) -> Tensor:
        """The distributions verification checks against at each slot of a step: p [B, N + 1, V] at the root and
        after each of the draft's first N nodes (its `Draft`; the view gives seeds and positions)."""
        return p

    def coupled_rows(self, view) -> list[int]:
        """The rows whose every token is the coupling's race winner: a drafter draws theirs under the same noise
        (a draft model's chains through `draw`, a tree's children through `sampling.coupling.coupled_children`)."""
        return []


class PositionalSeeding(Randomness):
    name = "position"
    lookahead = 1

    def draw(self, q: Tensor, view, offset: int, active: Sequence[bool]) -> Tensor:
        u = keyed_uniforms(view.seeds, [[pos + offset] for pos in view.positions], DRAFT, q.device).squeeze(1)
        return sample_from_weights(q, u)


class GumbelCoupling(Randomness):
    name = "gumbel"

    def draw(self, q: Tensor, view, offset: int, active: Sequence[bool]) -> Tensor:
        return coupled_draws(q, view.seeds, [pos + offset for pos in view.positions], active).clamp(min=0)

    def targets(self, p: Tensor, view, draft) -> Tensor:
        return coupled_targets(p, view.seeds, slot_positions(view, draft, p.shape[1]))

    def coupled_rows(self, view) -> list[int]:
        return list(range(len(view.seqs)))


class PerRequest(Randomness):
    """auto: the rows `view.keyed` marks (requests with their own seed) Gumbel-coupled, every other row the stream's
    (drawing exactly what stream draws). Without a keyed row, stream's work alone."""

    name = "auto"

    def draw(self, q: Tensor, view, offset: int, active: Sequence[bool]) -> Tensor:
        keyed = set(self.coupled_rows(view))
        if not keyed:
            return super().draw(q, view, offset, active)
        coupled = [a and b in keyed for b, a in enumerate(active)]
        streamed = super().draw(q, view, offset, [a and not c for a, c in zip(active, coupled)])
        won = coupled_draws(q, view.seeds, [pos + offset for pos in view.positions], coupled)  # -1: not coupled
        return torch.where(won >= 0, won, streamed)

    def targets(self, p: Tensor, view, draft) -> Tensor:
        keyed = self.coupled_rows(view)
        if not keyed:
            return p
        if len(keyed) == p.shape[0]:
            return coupled_targets(p, view.seeds, slot_positions(view, draft, p.shape[1]))
        idx = torch.tensor(keyed, device=p.device)
        slots = slot_positions(view, draft, p.shape[1], keyed)
        return p.index_copy(0, idx, coupled_targets(p.index_select(0, idx), [view.seeds[b] for b in keyed], slots))

    def coupled_rows(self, view) -> list[int]:  # view.keyed (None: none)
        return [] if view.keyed is None else [b for b, k in enumerate(view.keyed) if k]


def slot_positions(view, draft, T: int, rows: Sequence[int] | None = None) -> list[list[int]]:
    """[len(rows)][T]: the output position each of the first T verification slots samples, for each row (default:
    all; slot 0: the next token; slot n + 1: the token after node n, one deeper than n). Padding slots get a
    position too (never emitted)."""
    out = []
    for b in range(len(view.positions)) if rows is None else rows:
        start = view.positions[b]
        if draft.chain:
            out.append([start + t for t in range(T)])
            continue
        depth: list[int] = []
        for par in draft.parents[b, : T - 1].tolist():
            depth.append(depth[par] + 1 if par >= 0 else 0)
        out.append([start] + [start + d + 1 for d in depth])
    return out


RANDOMNESS: dict[str, Randomness] = {
    r.name: r for r in (PerRequest(), Randomness(), PositionalSeeding(), GumbelCoupling())
}


def randomness(seeding: str = "stream", coupling: str | None = None) -> Randomness:
    """The strategy of the older two settings (seeding "stream"/"position", coupling None/"gumbel")."""
    if coupling is not None and seeding != "stream":
        raise ValueError("coupling='gumbel' keys its noise by position already: drop seeding='position'")
    name = coupling if coupling is not None else seeding
    if name not in RANDOMNESS:
        raise ValueError(f"randomness must be one of {', '.join(RANDOMNESS)}, got {name!r}")
    return RANDOMNESS[name]
