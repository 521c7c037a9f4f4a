"""Hidden-state drafters: EAGLE-3, EAGLE-1/2, Medusa and MTP heads that read the target's own hidden states
(`formats`: the published layouts; `modules`: the forwards; `runner`: the runner protocol over them, so the draft
model's proposer drafts chains and EAGLE-2 trees with a head)."""

from __future__ import annotations

from .formats import HEAD_KINDS, HeadLoadError, LoadedHead, bind_head, head_kind, load_head, mtp_head
from .modules import MedusaHeads, PairHead
from .runner import MedusaRunner, PairRunner, scatter_logits

__all__ = [
    "HEAD_KINDS",
    "HeadLoadError",
    "LoadedHead",
    "MedusaHeads",
    "MedusaRunner",
    "PairHead",
    "PairRunner",
    "bind_head",
    "head_kind",
    "head_runner",
    "load_head",
    "mtp_head",
    "scatter_logits",
]


def head_runner(head, target_runner, vocab_size: int):
    """The runner of a bound head's module (PairHead or MedusaHeads) over the target's runner."""
    if isinstance(head, MedusaHeads):
        return MedusaRunner(head, target_runner, vocab_size)
    return PairRunner(head, target_runner, vocab_size)
