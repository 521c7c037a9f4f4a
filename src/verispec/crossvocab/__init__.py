"""Cross-vocabulary speculation: a draft model whose tokenizer is not the target's (Timor et al., ICML 2025).

- Token-level intersection (`cross_vocab=tli`, chosen automatically): the draft's q moved into the target's
  vocabulary by byte string (`VocabMap`), the draft run through the target's ids (`BridgedRunner`) by the ordinary
  draft-model drafter: chains and trees, every verification rule, exact because q is what the drafts were drawn from.
- String-level exact match (`cross_vocab=slem`): the draft's greedy text re-tokenized by the target, proposed as a
  chosen chain (`SlemProposer`).
"""

from __future__ import annotations

from ..model.loading import LoadedModel, output_rows
from .runner import BridgedRunner
from .slem import SlemProposer
from .vocab import CrossVocabError, VocabMap, token_keys

__all__ = [
    "BridgedRunner",
    "CrossVocabError",
    "SlemProposer",
    "VocabMap",
    "same_tokenizer",
    "token_keys",
    "vocab_sizes",
]


def same_tokenizer(target: LoadedModel, draft: LoadedModel) -> bool:
    """Whether the two models share one tokenizer (the same token -> id table)."""
    return target.tokenizer is draft.tokenizer or target.tokenizer.get_vocab() == draft.tokenizer.get_vocab()


def vocab_sizes(target: LoadedModel, draft: LoadedModel) -> tuple[int, int]:
    """(V_t, V_d): each model's ids that both its tokenizer and its output layer have."""
    return (
        min(len(target.tokenizer), output_rows(target.model)),
        min(len(draft.tokenizer), output_rows(draft.model)),
    )
