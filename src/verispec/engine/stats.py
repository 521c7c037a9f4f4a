"""Speculation statistics: observe(drafted, accepted, nodes) per row and step; rates derived here. Chains and trees
are counted alike: `drafted` is the draft's depth (the most tokens the step could accept), `nodes` the draft tokens
the target checked. So for a tree `acceptance_rate` is the fraction of its depth accepted, and
`per_position_acceptance[j]` P(depth j + 1 reached | depth j reached): for a chain, the classic per-position rate.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from itertools import zip_longest

__all__ = ["SpecStats"]


@dataclass
class SpecStats:
    """Speculation figures for one request, or pooled over many (`merge`).

    Attributes:
        drafted: Draft depth summed over steps (a chain: its draft tokens).
        accepted: Accepted draft tokens.
        emitted: Tokens emitted (accepted + recovered or bonus), before stop / length truncation.
        nodes: Draft tokens the target checked (a chain: `drafted`; a tree: all its nodes).
        target_passes: Verification forward passes that included this row.
        drafted_at: Per draft position j: the steps that drafted a position j.
        reached_at: Per draft position j: of those, the steps whose drafts 0..j-1 were all accepted.
        accepted_at: Per draft position j: of those, the steps whose draft j was accepted too.
        steps_by_drafted: Drafts in a step -> the number of such steps.
        draft_time: Seconds spent drafting (pooled stats only, as every time below but `wall_time`).
        verify_time: Seconds spent verifying: the target's passes and the verification rule.
        prefill_time: Seconds admitting requests: their prompts into the target's and the draft's caches.
        other_time: Seconds spent on everything else (detokenizing, stop strings, the caller's own work between
            streamed events): `wall_time - prefill_time - draft_time - verify_time`.
        wall_time: Wall-clock seconds: a call's (pooled stats); a request's own stats: its latency from joining
            the batch (after its prefill) to its last token.
        first_token_time: Seconds from the call's start to its first token (of any request): the time to first
            token of a one-request call (a part of `wall_time`, not a term of its sum).
        output_tokens: Tokens returned to the user.

    Merged stats (`merge`) add every count and time: pooled over calls, the times are totals.
    """

    drafted: int = 0  # draft depth summed over steps (a chain: its draft tokens)
    accepted: int = 0  # accepted draft tokens
    emitted: int = 0  # tokens emitted (accepted + recovered / bonus), before stop / length truncation
    nodes: int = 0  # draft tokens the target checked (a chain: = drafted; a tree: all its nodes)
    target_passes: int = 0  # verification forward passes that included this row
    drafted_at: list[int] = field(default_factory=list)  # [j]: steps that drafted a position j
    reached_at: list[int] = field(default_factory=list)  # [j]: of which drafts 0..j-1 were all accepted
    accepted_at: list[int] = field(default_factory=list)  # [j]: of which draft j was accepted too
    steps_by_drafted: dict[int, int] = field(default_factory=dict)  # drafts in a step -> number of such steps
    draft_time: float = 0.0
    verify_time: float = 0.0
    prefill_time: float = 0.0
    other_time: float = 0.0
    wall_time: float = 0.0
    first_token_time: float = 0.0
    output_tokens: int = 0  # tokens returned to the user

    def observe(self, drafted: int, accepted: int, nodes: int | None = None) -> None:
        """One verification step of one row: a draft `drafted` deep (with `nodes` tokens; default: a chain's
        `drafted`), of which `accepted` were kept."""
        self.drafted += drafted
        self.nodes += drafted if nodes is None else nodes
        self.accepted += accepted
        self.emitted += accepted + 1
        self.target_passes += 1
        self.steps_by_drafted[drafted] = self.steps_by_drafted.get(drafted, 0) + 1
        for at in (self.drafted_at, self.reached_at, self.accepted_at):
            at.extend([0] * (drafted - len(at)))
        for j in range(drafted):
            self.drafted_at[j] += 1
            self.reached_at[j] += j <= accepted
            self.accepted_at[j] += j < accepted

    def merge(self, other: SpecStats) -> None:
        """Add another run's counts and times into these (e.g. to pool several calls).

        Args:
            other: The stats to add.
        """
        for f in fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if isinstance(mine, dict):  # steps_by_drafted
                for g, n in theirs.items():
                    mine[g] = mine.get(g, 0) + n
            elif isinstance(mine, list):  # the per-position counts
                setattr(self, f.name, [a + b for a, b in zip_longest(mine, theirs, fillvalue=0)])
            else:
                setattr(self, f.name, mine + theirs)

    @property
    def acceptance_rate(self) -> float:
        """alpha-hat: accepted / drafted, pooled over positions (NaN when nothing was drafted)."""
        return self.accepted / self.drafted if self.drafted else float("nan")

    @property
    def tau(self) -> float:
        """tau: tokens emitted per target pass (plain decoding: 1; NaN before the first pass)."""
        return self.emitted / self.target_passes if self.target_passes else float("nan")

    @property
    def per_position_acceptance(self) -> list[float]:
        """P(draft j accepted | drafts 0..j-1 accepted) = accepted_at[j] / reached_at[j]."""
        return [a / r if r else float("nan") for a, r in zip(self.accepted_at, self.reached_at)]

    @property
    def tokens_per_second(self) -> float:
        """output_tokens / wall_time (NaN before any time is measured)."""
        return self.output_tokens / self.wall_time if self.wall_time > 0 else float("nan")

    def summary(self) -> dict:
        """The figures as one dict (`verispec generate --json`'s stats): counts, rates (NaN where undefined:
        `strict_json` writes null) and times in seconds (`*_s`; wall = prefill + draft + verify + other)."""
        return {
            "output_tokens": self.output_tokens,
            "emitted": self.emitted,
            "drafted": self.drafted,
            "nodes": self.nodes,
            "accepted": self.accepted,
            "target_passes": self.target_passes,
            "steps_by_drafted": dict(sorted(self.steps_by_drafted.items())),
            "acceptance_rate": self.acceptance_rate,
            "tau": self.tau,
            "per_position_acceptance": self.per_position_acceptance,
            "tokens_per_second": self.tokens_per_second,
            "wall_time_s": self.wall_time,
            "time_to_first_token_s": self.first_token_time or float("nan"),  # (no token: none)
            "prefill_time_s": self.prefill_time,
            "draft_time_s": self.draft_time,
            "verify_time_s": self.verify_time,
            "other_time_s": self.other_time,
        }
