"""Generation with PosS drafters: the generate() hook, the chain candidate generator, draft trees and the tree loop
(one prompt or a batch): verification, acceptance and cache surgery each in a module of its own; the doors into it
besides `assistant_model=`: pipelines and `speculative_generate` (what `custom_generate` runs)."""

from .candidate_generator import PosSCandidateGenerator
from .decoding import tree_assisted_decoding
from .drafting import DraftSession, DraftTree, draft_chain, draft_tree
from .hook import install_generate_hook, is_poss_drafter
from .pipelines import install_pipeline_hook
from .speculative import speculative_generate
from .stats import GenerationStats, PosSGenerateOutput

__all__ = [
    "DraftSession", "DraftTree", "GenerationStats", "PosSCandidateGenerator", "PosSGenerateOutput", "draft_chain",
    "draft_tree", "install_generate_hook", "install_pipeline_hook", "is_poss_drafter", "speculative_generate",
    "tree_assisted_decoding",
]
