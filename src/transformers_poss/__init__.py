"""PosS (Position Specialists) speculative decoding for HuggingFace Transformers.

Importing this package registers `PosSConfig`/`PosSDrafter` with the Auto classes, lets `PosSDrafter.from_pretrained`
read research checkpoints and `push_to_hub` upload a model card, and installs the small `generate()` hook that lets
`target.generate(..., assistant_model=drafter)` draft with a PosS drafter (and `pipeline(..., assistant_model=drafter)`,
whose assistant check it extends).
"""

from transformers import AutoConfig, AutoModel

from . import hub
from .checkpoints import eagle3, research
from .configuration_poss import PosSConfig
from .generation import (
    GenerationStats, PosSCandidateGenerator, PosSGenerateOutput, install_generate_hook, install_pipeline_hook,
)
from .generation_config import PosSGenerationConfig
from .modeling_poss import PosSDrafter, PosSDrafterOutput

__version__ = "0.1.0"

AutoConfig.register("poss", PosSConfig, exist_ok=True)
AutoModel.register(PosSConfig, PosSDrafter, exist_ok=True)
for reader in (eagle3.read_if_eagle3_checkpoint, research.read_if_research_checkpoint):
    if reader not in PosSDrafter.checkpoint_readers:  # EAGLE-3 first: its folders are research-like folders too
        PosSDrafter.checkpoint_readers.append(reader)
PosSDrafter.hub_pusher = hub.push_drafter_to_hub
install_generate_hook()
install_pipeline_hook()

__all__ = [
    "GenerationStats", "PosSCandidateGenerator", "PosSConfig", "PosSDrafter", "PosSDrafterOutput",
    "PosSGenerateOutput", "PosSGenerationConfig", "__version__",
]
