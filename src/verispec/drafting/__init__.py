"""Drafters behind one small interface (`Proposer`, returning a `Draft`): a new drafter is one new file."""

from .base import BatchView, Draft, Proposer, Signal
from .combined import CombinedProposer
from .draft_model import DraftModelProposer
from .history import HistoryProposer, RolloutHistory
from .prompt_lookup import PromptLookupProposer
from .switch import SwitchProposer
from .tree import TreeSpec

__all__ = [
    "BatchView",
    "CombinedProposer",
    "Draft",
    "DraftModelProposer",
    "HistoryProposer",
    "PromptLookupProposer",
    "Proposer",
    "RolloutHistory",
    "Signal",
    "SwitchProposer",
    "TreeSpec",
]
