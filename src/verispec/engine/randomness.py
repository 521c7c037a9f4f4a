"""Where a step's randomness comes from — one setting, chosen when the engine is built, that the drafter and the
verifier both follow (no per-step branching on strings):

    stream    each request's uniforms come from its own torch.Generator in draw order (the default);
    position  every uniform keyed by (request seed, output position, purpose) (`sampling.positional`): a seeded
              request's tokens then do not depend on gamma, the batch or timing; the drafter drafts one position
              past those it feeds the target (`lookahead`);
    gumbel    every output token is the exponential race of the target's p under noise keyed by (seed, position),
              and a draft model races with the same noise (`sampling.coupling`): a transform of p (`targets`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ..sampling import sample_from_weights
from ..sampling.coupling import coupled_draws, coupled_targets
from ..sampling.positional import DRAFT, keyed_uniforms

__all__ = ["RANDOMNESS", "Randomness", "randomness"]


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

    def targets(self, p: Tensor, seeds: Sequence[int], positions: Sequence[Sequence[int]] | None) -> Tensor:
        """The distributions verification checks against at each slot (p [B, T, V]; positions [B][T], the output
        position each slot samples, or None when this randomness needs none)."""
        return p

    needs_positions = False  # whether `targets` reads the slots' positions


class PositionalSeeding(Randomness):
    name = "position"
    lookahead = 1

    def draw(self, q: Tensor, view, offset: int, active: Sequence[bool]) -> Tensor:
        u = keyed_uniforms(view.seeds, [[pos + offset] for pos in view.positions], DRAFT, q.device).squeeze(1)
        return sample_from_weights(q, u)


class GumbelCoupling(Randomness):
    name = "gumbel"
    needs_positions = True

    def draw(self, q: Tensor, view, offset: int, active: Sequence[bool]) -> Tensor:
        return coupled_draws(q, view.seeds, [pos + offset for pos in view.positions], active).clamp(min=0)

    def targets(self, p: Tensor, seeds: Sequence[int], positions: Sequence[Sequence[int]] | None) -> Tensor:
        return coupled_targets(p, seeds, positions)


RANDOMNESS: dict[str, Randomness] = {r.name: r for r in (Randomness(), PositionalSeeding(), GumbelCoupling())}


def randomness(seeding: str = "stream", coupling: str | None = None) -> Randomness:
    """The strategy of the older two settings (seeding "stream"/"position", coupling None/"gumbel")."""
    if coupling is not None and seeding != "stream":
        raise ValueError("coupling='gumbel' keys its noise by position already: drop seeding='position'")
    name = coupling if coupling is not None else seeding
    if name not in RANDOMNESS:
        raise ValueError(f"randomness must be one of {', '.join(RANDOMNESS)}, got {name!r}")
    return RANDOMNESS[name]
