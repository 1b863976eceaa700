"""A drafter with the target it drafts for: `BoundDrafter`, what one `generate` call (its draft session), one training
run or one measurement holds. The drafter itself keeps no target: the target's token embedding and `lm_head` are read
through the binding, never saved with the drafter."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from . import kernels
from .layers import check_target_weights, output_logits


def check_compatible(drafter, target_model: PreTrainedModel) -> None:
    """Raise `ValueError` if `drafter` was not built for a target shaped like `target_model`, or cannot draft for it
    losslessly (`layers.check_target_weights`: e.g. a target quantized with `quantize_dynamic`)."""
    check_target_weights(target_model)
    target_config = target_model.config.get_text_config()
    config = drafter.config
    expected = config.target_config
    facts = {
        "model_type (family)": (expected.get("model_type"), target_config.model_type),
        "hidden_size": (expected.get("hidden_size"), target_config.hidden_size),
        "vocab_size": (expected.get("vocab_size"), target_model.get_output_embeddings().weight.shape[0]),
    }
    config.resolve_feature_layers(target_config.num_hidden_layers)  # a checkpoint that left them to the target
    if config.num_fused_states > 1:  # hidden-state indices name the same layers only at one depth
        facts["num_hidden_layers"] = (expected.get("num_hidden_layers"), target_config.num_hidden_layers)
    for name, (drafter_value, target_value) in facts.items():
        if drafter_value is not None and drafter_value != target_value:
            raise ValueError(
                f"This PosS drafter was built for a target with {name}={drafter_value!r}, but the target model "
                f"has {name}={target_value!r}: use a drafter trained for this target"
                f" ({config.target_name_or_path or 'unknown target'} is what this drafter names)."
            )


class BoundDrafter:
    """`drafter` (a `PosSDrafter`) drafting for `target`: the drafter's pieces that read the target's token embedding
    and `lm_head` (`embed`, `project`, `logits`, `forward`), everything else the drafter's own (attribute access
    passes through: `config`, `run_specialist`, `fuse_features`, `to_target_ids`, ...).

    Args:
        drafter: the drafter; with `move` it goes beside the target's `lm_head` (device and dtype).
        target: the target model (`check_compatible` first; an EAGLE-3 drafter whose checkpoint left its fused layers
            to the target's depth gets them here).
        generation_config: the settings this call drafts with (default: the drafter's own).
    """

    def __init__(self, drafter, target: PreTrainedModel, move: bool = True, generation_config=None):
        check_compatible(drafter, target)
        self.drafter = drafter
        self.target = target
        self.embedding = target.get_input_embeddings()
        self.lm_head = target.get_output_embeddings()
        self.generation_config = generation_config if generation_config is not None else drafter.generation_config
        if move:
            drafter.to(device=self.lm_head.weight.device, dtype=self.lm_head.weight.dtype)

    def __getattr__(self, name: str):  # only for names not set on the binding itself
        if name == "drafter":  # not set yet (copying, unpickling)
            raise AttributeError(name)
        return getattr(self.drafter, name)

    def embed(self, input_ids: torch.LongTensor) -> torch.Tensor:
        """Target token embeddings `[B, S] -> [B, S, H]`, on the drafter's device and dtype."""
        weight = self.drafter.fc.weight
        return self.embedding(input_ids.to(self.embedding.weight.device)).to(device=weight.device, dtype=weight.dtype)

    def project(self, input_ids: torch.LongTensor, features: torch.Tensor) -> torch.Tensor:
        """Layer inputs of tokens `[B, S]` and features `[B, S, H]`: `[B, S, layer_input_size]` (`drafter.project`)."""
        return self.drafter.project(self.embed(input_ids), features)

    def forward(self, input_ids: torch.LongTensor, features: torch.Tensor, specialist: int = 0,
                return_logits: bool = False, **kwargs):
        """`drafter(inputs_embeds=embed(input_ids), ...)`; with `return_logits`, `logits` of its features too."""
        out = self.drafter(self.embed(input_ids), features, specialist=specialist, **kwargs)
        if return_logits:
            out.logits = self.logits(out.features)
        return out

    __call__ = forward

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """Draft logits `[..., H] -> [..., Vd]` over the draft vocabulary (the drafter's head; its mapped rows from the
        target's `lm_head`, on 8 bits where the drafter drafts so), or `[..., V]` from the target's `lm_head`."""
        drafter = self.drafter
        if drafter.draft_lm_head is None:
            return output_logits(self.target, features).to(features.device)
        if drafter.draft_head_map is None:
            return drafter.logits(features)
        int8 = drafter.int8_draft_weights and kernels.runs_int8(features, features.shape[-1])
        return drafter.logits(features, self.mapped_head_rows(int8=int8))

    def mapped_head_rows(self, int8: bool = False):
        """The target's `lm_head` rows `[Vd - R, H]` of the draft tokens after the drafter's own `R` rows, on the
        drafter's device and dtype; with `int8`, their `pack_int8` copy (values `[Vd - R, H]`, scales `[Vd - R]`).
        Gathered once per `lm_head` weight and draft vocabulary, then reused call after call (the drafter keeps them)."""
        drafter, weight = self.drafter, self.lm_head.weight
        ids = drafter.draft_to_target[drafter.config.own_draft_head_rows:]
        key = (weight.data_ptr(), weight._version, ids.data_ptr(), drafter.draft_to_target._version,
               drafter.fc.weight.device, drafter.fc.weight.dtype)
        cached = drafter.head_rows_cache.get("rows")  # (weight, key, rows, 8-bit copy or None)
        if cached is None or cached[0] is not weight or cached[1] != key:
            rows = weight.detach().dequantize()[ids.to(weight.device)]  # dequantize: a weight-only quantized lm_head
            rows = rows.to(device=drafter.fc.weight.device, dtype=drafter.fc.weight.dtype)
            cached = drafter.head_rows_cache["rows"] = (weight, key, rows, None)
        if not int8:
            return cached[2]
        if cached[3] is None:
            cached = drafter.head_rows_cache["rows"] = (*cached[:3], kernels.pack_int8(cached[2]))
        return cached[3]

    def init_draft_vocab(self, draft_to_target: torch.Tensor) -> None:
        """`drafter.init_draft_vocab` from this target's `lm_head`."""
        self.drafter.init_draft_vocab(draft_to_target, self.lm_head.weight)
