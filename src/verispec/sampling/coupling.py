"""Gumbel coupling: drafter-invariant speculative sampling (Daliri, Musco, Suresh, "Coupling without communication
and drafter-invariant speculative decoding", 2024), with the noise keyed by (request seed, output position).

Plain decoding under the coupling draws output token i as the exponential race (Gumbel-max)
    x_i = argmax_x p_i(x) / E_i(x),     E_i(x) ~ Exp(1) i.i.d. over x, a function of (seed, i) only,
an exact sample of p_i (P(argmax = x) = p_i(x)). A drafter that sees the same noise samples argmax_x q_i(x) / E_i(x):
it agrees with the target with probability between (1 - TV) / (1 + TV) (the paper's bound) and 1 - TV (optimal).
Verification keeps a draft token iff it equals the target's race winner there, and at the first disagreement emits
that winner: every emitted token is x_i, plain decoding's output under the same seed, whatever drafted and whatever
gamma, batch or timing. The engine hands its usual verifiers the one-hot target onehot(x_i) (`coupled_targets`):
with a one-hot p every rule (token, block, every tree rule) is exact match emitting the argmax.

Exactness needs only that E_i does not depend on anything the drafter or the step decides: it is a counter-based
hash of (seed, i, token), the same on every device. The race runs in float64 with E = -log(1 - U), U a 53-bit
uniform, so no token with p > 0 is starved (an fp32 race loses the tail: vLLM #43150). Cost: one [V] hash and log
per row and position (about 2 ms at V = 151 936 on CPU). Tree children: the top of q / E (`coupled_children`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = [
    "COUPLINGS",
    "coupled_children",
    "coupled_draws",
    "coupled_targets",
    "keyed_exponentials",
    "onehot_winners",
    "race_winner",
]

COUPLINGS = ("gumbel",)  # SamplingParams-independent ways to couple drafter and target (None: independent draws)

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def noise_seed(seed: int, position: int) -> int:
    """The generator seed of output position `position` of a request seeded `seed` (a 63-bit hash)."""
    return _splitmix64(_splitmix64(seed & _MASK64) ^ (position & _MASK64)) >> 1


def _signed(c: int) -> int:  # a 64-bit constant as torch's int64
    return c - (1 << 64) if c >= 1 << 63 else c


_GOLDEN, _C1, _C2 = (_signed(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))


def _shr(z: Tensor, s: int) -> Tensor:  # logical right shift of int64 (torch's >> is arithmetic)
    return (z >> s) & ((1 << (64 - s)) - 1)


def splitmix64_counter(key: int, n: int, device: torch.device | str = "cpu") -> Tensor:  # [n] int64
    """Outputs 1..n of the splitmix64 sequence started at `key`, computed in parallel (a counter-based generator:
    element i is mix(key + (i + 1) * golden), int64 arithmetic wrapping mod 2^64 on every device)."""
    z = torch.arange(1, n + 1, dtype=torch.int64, device=device) * _GOLDEN + _signed(key & _MASK64)
    z = (z ^ _shr(z, 30)) * _C1
    z = (z ^ _shr(z, 27)) * _C2
    return z ^ _shr(z, 31)


def keyed_exponentials(
    seed: int, position: int, vocab: int, device: torch.device | str = "cpu"
) -> Tensor:  # [vocab] float64, Exp(1) i.i.d., a function of (seed, position, vocab) only, the same on every device
    """One Exp(1) per token from 53 bits of a counter-based hash of (seed, position, token): no generator state,
    so 2^63 keys (a torch CPU generator would take only 32 bits of a seed) and the same values on CPU and CUDA."""
    u = _shr(splitmix64_counter(noise_seed(seed, position), vocab, device), 11).double() * 2.0**-53  # [0, 1)
    return torch.log1p(-u).neg_()  # -log(1 - U) in [0, inf)


def race_winner(probs: Tensor, exps: Tensor) -> Tensor:  # [...] int64
    """argmax_x probs(x) / exps(x) over the last dimension, among tokens with probs > 0 (an exact sample of probs
    when exps ~ Exp(1) i.i.d.). probs [..., V] float, exps [..., V] float64."""
    score = torch.where(probs > 0, probs.double() / exps, -1.0)  # exps = 0 gives inf: that token wins
    return score.argmax(-1)


def onehot_winners(probs: Tensor, exps: Tensor) -> Tensor:  # [..., V] in probs' dtype
    """onehot(race_winner(probs, exps)): the target that makes an exact verifier emit the race winner."""
    return torch.zeros_like(probs).scatter_(-1, race_winner(probs, exps).unsqueeze(-1), 1.0)


def coupled_targets(
    probs: Tensor,  # [B, T, V] float: the processed target distributions of a step's T slots
    seeds: Sequence[int],  # [B] request seeds
    positions: Sequence[Sequence[int]],  # [B][T] output position each slot samples
) -> Tensor:  # [B, T, V] in probs' dtype: onehot(race winner) per slot
    """The one-hot targets that make any exact verifier emit the coupled sample (module docstring). Slots at the
    same output position share their noise (tree siblings: one race per position, over each slot's own p)."""
    B, T, V = probs.shape
    exps = torch.empty((B, T, V), dtype=torch.float64, device=probs.device)
    for b in range(B):
        cache: dict[int, Tensor] = {}
        for t, pos in enumerate(positions[b][:T]):
            if pos not in cache:
                cache[pos] = keyed_exponentials(seeds[b], pos, V, probs.device)
            exps[b, t] = cache[pos]
    return onehot_winners(probs, exps)


def coupled_draws(
    probs: Tensor,  # [B, V] float: the draft's q at one position per row
    seeds: Sequence[int],  # [B]
    positions: Sequence[int],  # [B] output position each row draws for
    active: Sequence[bool],  # [B]: rows that draw here (the others get -1)
) -> Tensor:  # [B] int64
    """A drafter's coupled sample: the race winner of q under the target's noise at that position."""
    B, V = probs.shape
    tok = torch.full((B,), -1, dtype=torch.int64, device=probs.device)
    for b in range(B):
        if active[b]:
            tok[b] = race_winner(probs[b], keyed_exponentials(seeds[b], positions[b], V, probs.device))
    return tok


def coupled_children(
    probs: Tensor,  # [M, V] float: the draft's q at M tree nodes that get children
    seeds: Sequence[int],  # [M] their requests' seeds
    positions: Sequence[int],  # [M] the output position their children sample
    width: int,
) -> tuple[Tensor, Tensor]:  # children [M, width] int64, validity [M, width] bool
    """A tree drafter's children under the coupling: the `width` best of q / E under the target's noise E at the
    children's position — the first is q's race winner (the coupled draw), the rest the runners-up (Gumbel-top-k: a
    draw without replacement from q). The target keeps the child equal to its own race winner at that position,
    so this is what makes a tree's children agree with it (children drawn independently of E agree with probability
    sum_x p(x) q(x) only). Children of probability 0 under q are not valid (never worth a node)."""
    M, V = probs.shape
    exps = torch.empty((M, V), dtype=torch.float64, device=probs.device)
    cache: dict[tuple[int, int], Tensor] = {}
    for m, key in enumerate(zip(seeds, positions)):
        if key not in cache:
            cache[key] = keyed_exponentials(key[0], key[1], V, probs.device)
        exps[m] = cache[key]
    score = torch.where(probs > 0, probs.double() / exps, -1.0)  # exps = 0 gives inf: that token first
    val, kids = score.topk(min(width, V), dim=-1)
    ok = val > 0
    if width > V:  # more children than tokens: the extra ones do not exist
        pad = torch.zeros((M, width - V), dtype=kids.dtype, device=kids.device)
        kids, ok = torch.cat([kids, pad], 1), torch.cat([ok, pad.bool()], 1)
    return kids, ok


def gumbel_verifier(
    target_probs, draft_token_ids, draft_probs=None, num_draft_tokens=None, generators=None, *, check=True
):
    """verify_chain's interface under the coupling, with Exp(1) noise from torch's global generator instead of
    keyed noise (the same law; for certificates, `certify kernel --coupling gumbel`): every emitted token is the
    race winner of its position, drafts are kept while they equal it."""
    from .chain import verify_chain

    exps = torch.rand(target_probs.shape, dtype=torch.float64, device=target_probs.device).neg_().log1p_().neg_()
    return verify_chain(
        onehot_winners(target_probs, exps), draft_token_ids, draft_probs, num_draft_tokens, generators, check=check
    )
