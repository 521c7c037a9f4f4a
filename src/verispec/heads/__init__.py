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
    "head_proposer",
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


def head_proposer(target, head: LoadedHead, config, target_runner):
    """The drafter for `head` (bound to `target` by `bind_head`): the draft model's proposer over the head's runner."""
    from ..drafting import DraftModelProposer

    if config.quant is not None:
        raise HeadLoadError(f"[quant] quantizes a draft model's weights; {head.described} runs as it is")
    if config.cross_vocab != "auto":
        raise HeadLoadError(f"{head.described} drafts in the target's vocabulary: [cross_vocab] does not apply")
    if config.draft != "model" and not (config.draft == "mtp" and head.kind == "mtp"):
        raise HeadLoadError(f"{head.described} drafts alone (draft=model): draft={config.draft} cannot use it")
    vocab = target_runner.vocab_size
    proposer = DraftModelProposer(
        head.model,
        vocab,
        config.stop_below,
        tree=config.tree_spec,
        runner=lambda m, v: head_runner(m, target_runner, v),
    )
    if (
        isinstance(head.model, MedusaHeads)
        and config.tree_spec is not None
        and config.tree_spec.max_depth > head.model.num_heads
    ):
        raise HeadLoadError(
            f"the tree is {config.tree_spec.max_depth} deep and the checkpoint has {head.model.num_heads} Medusa heads"
        )
    proposer.name = f"{head.kind}-head"
    return proposer
