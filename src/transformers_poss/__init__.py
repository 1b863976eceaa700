"""PosS (Position Specialists) speculative decoding for HuggingFace Transformers.

Importing this package registers each drafter kind's config and model (`PosSConfig`/`PosSDrafter`,
`PosSEagle3Config`/`PosSEagle3Drafter`) with the Auto classes, lets `PosSDrafter.from_pretrained`
read research checkpoints and `push_to_hub` upload a model card, and installs the small `generate()` hook that lets
`target.generate(..., assistant_model=drafter)` draft with a PosS drafter (and `pipeline(..., assistant_model=drafter)`,
whose assistant check it extends).
"""

from transformers import AutoConfig, AutoModel

from . import hub
from .binding import BoundDrafter
from .checkpoints import eagle3, loading, research
from .configuration_poss import PosSConfig
from .configuration_poss_eagle3 import PosSEagle3Config
from .generation import (
    GenerationStats, PosSCandidateGenerator, PosSGenerateOutput, install_generate_hook, install_pipeline_hook,
)
from .generation_config import PosSGenerationConfig
from .modeling_poss import PosSDrafter, PosSDrafterOutput
from .modeling_poss_eagle3 import PosSEagle3Drafter

__version__ = "0.1.0"

AutoConfig.register("poss", PosSConfig, exist_ok=True)
AutoModel.register(PosSConfig, PosSDrafter, exist_ok=True)
AutoModel.register(PosSEagle3Config, PosSEagle3Drafter, exist_ok=True)
for reader in (eagle3.read_if_eagle3_checkpoint, research.read_if_research_checkpoint):
    if reader not in loading.CHECKPOINT_READERS:  # EAGLE-3 first: its folders are research-like folders too
        loading.CHECKPOINT_READERS.append(reader)
PosSDrafter.hub_pusher = hub.push_drafter_to_hub
install_generate_hook()
install_pipeline_hook()

__all__ = [
    "BoundDrafter", "GenerationStats", "PosSCandidateGenerator", "PosSConfig", "PosSDrafter", "PosSDrafterOutput",
    "PosSEagle3Config", "PosSEagle3Drafter", "PosSGenerateOutput", "PosSGenerationConfig", "__version__",
]
