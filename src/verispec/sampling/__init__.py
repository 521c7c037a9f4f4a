"""Pure tensor math of lossless speculative sampling: processing, verification, theory.

Nothing here knows about models or caches: tensors in, tensors out, explicit randomness.
"""

from .block import verify_block, verify_block_with_uniforms
from .chain import ChainVerifyOutput, draw_uniforms, sample_from_weights, verify_chain, verify_chain_with_uniforms
from .constraint import CONSTRAINT_KINDS, Constraint, ConstraintError
from .metadata import SamplingMetadata
from .params import ParamError, SamplingParams, bad_words_from_text, check_seed
from .processors import counts_at_nodes, probs_from_logits, recent_at_nodes, recent_tokens
from .theory import (
    acceptance_rate,
    expected_tokens_per_pass,
    optimal_gamma_constant_cost,
    optimal_gamma_cost_curve,
    speedup_constant_cost,
    speedup_cost_curve,
)
from .tree import TREE_RULES, VERIFY_RULES, TreeVerifyOutput, verify_tree, verify_tree_with_uniforms

CHAIN_RULES = {"token": verify_chain, "block": verify_block}  # how a drafted chain is verified (all exact)

__all__ = [
    "CHAIN_RULES",
    "CONSTRAINT_KINDS",
    "TREE_RULES",
    "VERIFY_RULES",
    "ChainVerifyOutput",
    "Constraint",
    "ConstraintError",
    "ParamError",
    "SamplingMetadata",
    "SamplingParams",
    "TreeVerifyOutput",
    "acceptance_rate",
    "bad_words_from_text",
    "check_seed",
    "counts_at_nodes",
    "draw_uniforms",
    "expected_tokens_per_pass",
    "optimal_gamma_constant_cost",
    "optimal_gamma_cost_curve",
    "probs_from_logits",
    "recent_at_nodes",
    "recent_tokens",
    "sample_from_weights",
    "speedup_constant_cost",
    "speedup_cost_curve",
    "verify_block",
    "verify_block_with_uniforms",
    "verify_chain",
    "verify_chain_with_uniforms",
    "verify_tree",
    "verify_tree_with_uniforms",
]
