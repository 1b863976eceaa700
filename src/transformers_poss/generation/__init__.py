"""Generation with PosS drafters: the generate() hook, chain candidate generator, draft trees, tree verification
(one prompt or a batch)."""

from .batch_decoding import batch_tree_assisted_decoding
from .candidate_generator import PosSCandidateGenerator
from .drafting import DraftSession, DraftTree, draft_chain, draft_tree
from .hook import install_generate_hook, is_poss_drafter
from .stats import GenerationStats, PosSGenerateOutput
from .tree_decoding import tree_assisted_decoding

__all__ = [
    "DraftSession", "DraftTree", "GenerationStats", "PosSCandidateGenerator", "PosSGenerateOutput", "draft_chain",
    "draft_tree",
    "batch_tree_assisted_decoding", "install_generate_hook", "is_poss_drafter", "tree_assisted_decoding",
]
