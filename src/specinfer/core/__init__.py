"""Pure algorithms of tree-based speculative inference: no I/O, no torch."""

from specinfer.core.drafts import DraftGroup, DraftTree, ExpansionConfig, TreeBuilder
from specinfer.core.dynamic_trees import BestFirstTreeBuilder, Proposal, TreeBudget
from specinfer.core.errors import InvalidArgument
from specinfer.core.merge import combine_drafts, merge_drafts, merge_trees
from specinfer.core.sampling import (
    SamplingParams,
    SparseDist,
    draw_without_replacement,
    process_logits,
    sample,
    sparsify,
    top_k_tokens,
)
from specinfer.core.tree import TokenTree, ancestor_matrix, node_depths, validate_parents
from specinfer.core.verify import VerifyResult, verify_greedy, verify_stochastic

__all__ = [
    "BestFirstTreeBuilder",
    "DraftGroup",
    "DraftTree",
    "ExpansionConfig",
    "InvalidArgument",
    "Proposal",
    "SamplingParams",
    "SparseDist",
    "TokenTree",
    "TreeBudget",
    "TreeBuilder",
    "VerifyResult",
    "ancestor_matrix",
    "combine_drafts",
    "draw_without_replacement",
    "merge_drafts",
    "merge_trees",
    "node_depths",
    "process_logits",
    "sample",
    "sparsify",
    "top_k_tokens",
    "validate_parents",
    "verify_greedy",
    "verify_stochastic",
]
