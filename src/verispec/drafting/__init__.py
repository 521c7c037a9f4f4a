"""Drafters behind one small interface (`Proposer`): a new drafter is one new file."""

from .base import BatchView, Proposal, Proposer
from .draft_model import DraftModelProposer
from .prompt_lookup import PromptLookupProposer
from .tree import TreeDraftProposer, TreeProposal, TreeSpec

__all__ = ["BatchView", "DraftModelProposer", "PromptLookupProposer", "Proposal", "Proposer", "TreeDraftProposer", "TreeProposal",
           "TreeSpec"]
