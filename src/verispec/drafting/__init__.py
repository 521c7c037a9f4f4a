"""Drafters behind one small interface (`Proposer`, returning a `Draft`): a new drafter is one new file."""

from .base import BatchView, Draft, Proposer
from .draft_model import DraftModelProposer
from .prompt_lookup import PromptLookupProposer
from .tree import TreeSpec

__all__ = ["BatchView", "Draft", "DraftModelProposer", "PromptLookupProposer", "Proposer", "TreeSpec"]
