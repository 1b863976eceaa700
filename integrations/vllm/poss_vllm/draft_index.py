"""Tell the draft model which draft step it is running.

The EAGLE proposer of vLLM's V1 model runner (`vllm/v1/spec_decode/llm_base_proposer.py`,
`SpecDecodeBaseProposer.propose`, the same in vLLM 0.32 and 0.33) builds the attention metadata right before every
draft-model call with `build_per_group_and_layer_attn_metadata(cad, draft_index=i)`: `i = 0` for the first pass
(draft position 1), `i` for position `i + 1`. Wrapping that method is the one change this plugin makes to vLLM's
drafting; the model reads the index at its next forward, which runs eagerly (the package docstring says why graphs
cannot freeze it, and which settings are refused).
"""

from __future__ import annotations

import functools
import inspect

from . import PosSServingError


def install() -> None:
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

    original = SpecDecodeBaseProposer.build_per_group_and_layer_attn_metadata
    if getattr(original, "poss_wrapped", False):
        return
    if "draft_index" not in inspect.signature(original).parameters:
        raise PosSServingError(
            "vllm/v1/spec_decode/llm_base_proposer.py SpecDecodeBaseProposer.build_per_group_and_layer_attn_metadata "
            "takes no draft_index in this vLLM: poss_vllm cannot tell draft positions apart"
        )

    @functools.wraps(original)
    def build_per_group_and_layer_attn_metadata(self, common_attn_metadata, draft_index: int = 0):
        model = getattr(self, "model", None)
        if hasattr(model, "unwrap"):  # a graph wrapper around the draft model
            model = model.unwrap()
        if getattr(model, "is_poss_drafter", False):
            model.set_draft_index(draft_index)
        return original(self, common_attn_metadata, draft_index=draft_index)

    build_per_group_and_layer_attn_metadata.poss_wrapped = True
    SpecDecodeBaseProposer.build_per_group_and_layer_attn_metadata = build_per_group_and_layer_attn_metadata
