"""Structured outputs under speculation: a `Constraint` (JSON schema, JSON object, regex, choice, grammar) compiled
for the engine's tokenizer (`Grammars`, xgrammar), one `GrammarState` per request, and the grammar's mask at every
slot of a draft, folded into p and q alike (`allowed_at_nodes`). Jump-forward: `verispec.drafting.grammar`."""

from ..sampling.constraint import CONSTRAINT_KINDS, Constraint, ConstraintError
from .grammar import Grammars, GrammarState, check_syntax
from .masks import allowed_at_nodes, root_allowed

__all__ = [
    "CONSTRAINT_KINDS",
    "Constraint",
    "ConstraintError",
    "GrammarState",
    "Grammars",
    "allowed_at_nodes",
    "check_syntax",
    "root_allowed",
]
