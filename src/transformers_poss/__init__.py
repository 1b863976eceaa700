"""PosS (Position Specialists) speculative decoding for HuggingFace Transformers.

Importing this package registers `PosSConfig`/`PosSDrafter` with the Auto classes and installs the small
`generate()` hook that lets `target.generate(..., assistant_model=drafter)` draft with a PosS drafter.
"""

from transformers import AutoConfig, AutoModel

from .configuration_poss import PosSConfig
from .generation import GenerationStats, PosSCandidateGenerator, install_generate_hook
from .modeling_poss import PosSDrafter, PosSDrafterOutput

__version__ = "0.1.0"

AutoConfig.register("poss", PosSConfig, exist_ok=True)
AutoModel.register(PosSConfig, PosSDrafter, exist_ok=True)
install_generate_hook()

__all__ = ["PosSConfig", "PosSDrafter", "PosSDrafterOutput", "PosSCandidateGenerator", "GenerationStats", "__version__"]
