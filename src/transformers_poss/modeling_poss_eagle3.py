"""`PosSEagle3Drafter`: an EAGLE-3-style PosS drafter (see `PosSEagle3Config`).

`fc` fuses the target's low/mid/high hidden states into the feature space; each specialist is an `Eagle3DecoderLayer`
over `concat(embedding, hidden)` (layer inputs of width 2H); a final `norm` precedes the drafter's own draft head.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from .configuration_poss_eagle3 import PosSEagle3Config
from .layers import Eagle3DecoderLayer
from .modeling_poss import PosSDrafter


class PosSEagle3Drafter(PosSDrafter):
    """EAGLE-3-style PosS drafter: the specialist for the draft position over `concat(embed(x_{t+1}), h_t)`.

    Attributes (besides `PosSDrafter`'s):
        fc: `Linear(nH -> H)` over the target's fused hidden states (`fuse_features`); there is no `fuse`.
        specialists: `num_specialists` `Eagle3DecoderLayer`s.
        norm: the final RMSNorm before the draft head (`draft_lm_head`, always present).
    """

    config_class = PosSEagle3Config
    predicts_target_features = False  # its outputs are its own states, trained through the tokens alone

    def build_layers(self, config: PosSEagle3Config, layer_config) -> None:
        hidden = config.hidden_size
        self.fc = nn.Linear(config.num_fused_states * hidden, hidden, bias=config.fc_bias)
        self.fuse = None
        self.specialists = nn.ModuleList(Eagle3DecoderLayer(layer_config, i, config.norm_before_residual)
                                         for i in range(config.num_specialists))
        self.norm = LlamaRMSNorm(hidden, eps=layer_config.rms_norm_eps)
        self._lean_layers = False  # an EAGLE-3 layer takes the lean attention inside its own forward

    def attention_inputs(self, specialist: int, layer_inputs: torch.Tensor) -> torch.Tensor:
        return self.specialists[specialist].attention_inputs(layer_inputs)[0]

    def fuse_features(self, target_features: torch.Tensor) -> torch.Tensor:
        """Target features `[..., (n + 1)H]` (the fused states, then the final one) -> `fc` of the fused states
        `[..., H]` (the final state, the last `H` columns, is not read)."""
        target_features = target_features.to(device=self.fc.weight.device, dtype=self.fc.weight.dtype)
        return self.fc(target_features[..., :-self.config.hidden_size])

    def project(self, inputs_embeds: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """Layer inputs `concat(inputs_embeds, features)` `[B, S, 2H]` (the specialist normalises each half)."""
        features = features.to(device=self.fc.weight.device, dtype=self.fc.weight.dtype)
        return torch.cat((inputs_embeds, features), dim=-1)

    def logits(self, features: torch.Tensor, mapped_rows=None) -> torch.Tensor:
        """The draft head's logits `[..., H] -> [..., Vd]` of the normalised features."""
        return self.draft_lm_head(self.norm(features))
