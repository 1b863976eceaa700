"""The layers a PosS drafter is built from, and the attention pieces they share with verification.

- `family_classes`: the target family's own transformers decoder layer and rotary embedding (no copied modeling files).
- `Eagle3DecoderLayer`: an EAGLE-3 specialist (attention over `[norm(embedding), norm(hidden)]`).
- `lean_attention`: the inference forward of a Llama/Mistral/Qwen2/Qwen3 attention module in fewer framework calls.
- masks (`additive_mask`, `causal_allowed`) and the target's output logits (`output_logits`, Gemma soft-capping);
  `check_target_weights`: whether a target's embedding and `lm_head` can be read and its forwards verify exactly.
"""

from __future__ import annotations

import importlib
import inspect

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers.cache_utils import DynamicCache
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRMSNorm, apply_rotary_pos_emb

from .configuration_poss import FAMILY_CLASSES


def family_classes(model_type: str) -> tuple[type[nn.Module], type[nn.Module]]:
    """The transformers decoder-layer and rotary-embedding classes of a target family."""
    if model_type not in FAMILY_CLASSES:
        raise ValueError(f"PosS drafters support target families {tuple(FAMILY_CLASSES)}, not {model_type!r}")
    module_name, layer_name, rotary_name = FAMILY_CLASSES[model_type]
    module = importlib.import_module(f"transformers.models.{module_name}.modeling_{module_name}")
    return getattr(module, layer_name), getattr(module, rotary_name)


def softcap_logits(logits: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """Gemma-style final-logit soft-capping `tanh(logits / c) * c` (unchanged when `softcap` is None or 0)."""
    return torch.tanh(logits / softcap) * softcap if softcap else logits


def output_logits(model: PreTrainedModel, hidden: torch.Tensor) -> torch.Tensor:
    """A causal LM's logits from its final hidden states `[..., H] -> [..., V]`: its output embeddings, then its
    final-logit soft-capping when the family has one (Gemma)."""
    lm_head = model.get_output_embeddings()
    logits = lm_head(hidden.to(device=lm_head.weight.device, dtype=lm_head.weight.dtype))
    return softcap_logits(logits, getattr(model.config.get_text_config(), "final_logit_softcapping", None))


def check_target_weights(model: PreTrainedModel) -> None:
    """Raise `ValueError` unless a drafter can read `model`'s input embedding and `lm_head` (floating-point weight
    tensors, weight-only quantized ones included) and verify drafts exactly: no module quantizes its activations per
    forward (torch's `quantize_dynamic`), whose output would then depend on how many tokens one forward holds."""
    def name(module) -> str:
        return f"{type(module).__module__}.{type(module).__name__}"

    problems = []
    for role, module in (("input embedding", model.get_input_embeddings()), ("lm_head", model.get_output_embeddings())):
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.Tensor) or not weight.is_floating_point():
            problems.append(f"its {role} ({name(module)}) holds no floating-point weight tensor to read")
    quantized = sorted({name(m) for m in model.modules() if type(m).__module__.startswith("torch.ao.nn.quantized")})
    if quantized:
        problems.append(f"its {', '.join(quantized)} modules (torch.ao quantization, e.g. quantize_dynamic) quantize "
                        "activations in each forward, so verifying several draft tokens in one forward differs from "
                        "decoding them one by one")
    if problems:
        raise ValueError(
            "PosS drafting cannot run losslessly on this target: " + "; ".join(problems) + ". Supported: targets "
            "with floating-point weights (float32, bfloat16, float16) or weight-only quantization, e.g. "
            "AutoModelForCausalLM.from_pretrained(..., quantization_config=TorchAoConfig(Int8WeightOnlyConfig()))."
        )


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bool mask `[q, k]` (True = attend) -> additive float mask `[1, 1, q, k]` (right for eager and sdpa)."""
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


def causal_allowed(query_len: int, past_len: int, device) -> torch.Tensor:
    """Bool mask `[query_len, past_len + query_len]`: each query sees the past and itself and earlier queries."""
    keys = torch.arange(past_len + query_len, device=device)
    queries = torch.arange(query_len, device=device) + past_len
    return keys[None, :] <= queries[:, None]



# Families whose attention modules compute exactly `lean_attention` (projections with optional bias, Qwen3's per-head
# q/k norms, rotary embedding over the whole head, scaled dot-product attention with an additive mask).
LEAN_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
LEAN_IMPLEMENTATIONS = ("eager", "sdpa")  # the attention implementations `lean_attention` stands in for


def runs_lean(attention: nn.Module) -> bool:
    """Whether inference may take `lean_attention` for this attention module (no gradient, an eager or SDPA one)."""
    return not torch.is_grad_enabled() and attention.config._attn_implementation in LEAN_IMPLEMENTATIONS


def lean_attention(attention: nn.Module, hidden: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                   mask: torch.Tensor, cache) -> torch.Tensor:
    """What a `LEAN_FAMILIES` attention module computes, with fewer framework calls (draft depths are small, so
    the calls cost more than the arithmetic): `hidden [B, q, H_in]`, cos/sin `[B, q, D]`, additive `mask
    [B, 1, q, k]`, `cache` updated at layer `attention.layer_idx` (or None) -> `[B, q, H]`."""
    B, q = hidden.shape[:2]
    heads = (B, q, -1, attention.head_dim)
    query = attention.q_proj(hidden).view(heads)
    key = attention.k_proj(hidden).view(heads)
    value = attention.v_proj(hidden).view(heads).transpose(1, 2)
    if hasattr(attention, "q_norm"):  # Qwen3
        query, key = attention.q_norm(query), attention.k_norm(key)
    query, key = apply_rotary_pos_emb(query.transpose(1, 2), key.transpose(1, 2), *position_embeddings)
    if cache is not None:
        key, value = cache.update(key, value, attention.layer_idx)
    groups = query.shape[1] // key.shape[1]
    native_groups = query.device.type == "cpu"  # elsewhere masked grouped-query attention takes the math kernel
    if groups > 1 and not native_groups:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    attended = nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask[..., : key.shape[-2]],
                                                          scale=attention.scaling,
                                                          enable_gqa=groups > 1 and native_groups)
    return attention.o_proj(attended.transpose(1, 2).reshape(B, q, -1))


class Eagle3DecoderLayer(nn.Module):
    """An EAGLE-3 specialist: layer inputs `[B, S, 2H]` = `concat(embedding, hidden)` -> features `[B, S, H]`.

    Attention reads `concat(input_layernorm(embedding), hidden_norm(hidden))` (its q/k/v projections take 2H) and
    adds its output to the residual `hidden` (`hidden_norm(hidden)` with `norm_before_residual`); then the Llama MLP
    block (`post_attention_layernorm`, `mlp`, residual). Submodule names are the references' (`midlayer.*` in
    SafeAILab/SpecForge checkpoints, `layers.0.*` in speculators ones).
    """

    def __init__(self, config: PretrainedConfig, layer_idx: int, norm_before_residual: bool = False):
        super().__init__()
        hidden = config.hidden_size
        self.hidden_size = hidden
        self.norm_before_residual = norm_before_residual
        self.self_attn = LlamaAttention(config, layer_idx)
        for name in ("q_proj", "k_proj", "v_proj"):
            narrow = getattr(self.self_attn, name)
            setattr(self.self_attn, name, nn.Linear(2 * hidden, narrow.out_features, bias=narrow.bias is not None))
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.hidden_norm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)

    def attention_inputs(self, layer_inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`[..., 2H]` layer inputs -> (attention input `[..., 2H]`, residual `[..., H]`)."""
        embeds, hidden = layer_inputs.split(self.hidden_size, dim=-1)
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        return torch.cat((self.input_layernorm(embeds), normed), dim=-1), residual

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, position_ids=None, cache=None,
                use_cache=False, position_embeddings=None, **kwargs) -> torch.Tensor:
        """`hidden_states`: the layer inputs `[B, S, 2H]`; the other arguments as for a transformers decoder layer."""
        attention_input, residual = self.attention_inputs(hidden_states)
        if attention_mask is not None and runs_lean(self.self_attn):
            attended = lean_attention(self.self_attn, attention_input, position_embeddings, attention_mask, cache)
        else:
            attended, _ = self.self_attn(hidden_states=attention_input, position_embeddings=position_embeddings,
                                         attention_mask=attention_mask, cache=cache, **kwargs)
        hidden = residual + attended
        return hidden + self.mlp(self.post_attention_layernorm(hidden))



class RotaryPositions:
    """RoPE (cos, sin) `[B, S, D]` of a family's rotary embedding module for positions `[B, S]`: computed per call,
    or, where cos/sin depend on the position alone and a bound on the positions is known (a draft session's), rows of
    a table of positions `0 .. P - 1` the module made (remade twice as long when too short)."""

    def __init__(self, rotary: nn.Module):
        self.rotary = rotary
        self.takes_layer_type = "layer_type" in inspect.signature(rotary.forward).parameters
        self.table_allowed = (not self.takes_layer_type
                              and getattr(rotary, "rope_type", "default") not in ("dynamic", "longrope"))
        self.table = None  # (dtype and device, cos [P, D], sin [P, D])

    def __call__(self, like: torch.Tensor, position_ids: torch.LongTensor, positions_below: int | None = None):
        """(cos, sin) of `position_ids` in `like`'s dtype; from the table when `positions_below` bounds them."""
        if positions_below is not None and self.table_allowed:
            return self.rows(like, position_ids, positions_below)
        if self.takes_layer_type:
            return self.rotary(like, position_ids, "full_attention")
        return self.rotary(like, position_ids)

    def rows(self, like: torch.Tensor, position_ids: torch.LongTensor, positions_below: int):
        """(cos, sin) of `position_ids` (all below `positions_below`) read from the table."""
        key = (like.dtype, like.device)
        if self.table is None or self.table[0] != key or self.table[1].shape[0] < positions_below:
            positions = torch.arange(max(2 * positions_below, 256), device=like.device)[None]
            cos, sin = self.rotary(like, positions)
            self.table = (key, cos[0], sin[0])
        return self.table[1][position_ids], self.table[2][position_ids]


def select_hidden_states(hidden_states: tuple[torch.Tensor | None, ...], layers: list[int]) -> torch.Tensor:
    """The `layers` of a target forward's `hidden_states` (run with `output_hidden_states=layers`, the final one
    last), `[B, S, H]` each, concatenated to `[B, S, len(layers) * H]`."""
    return hidden_states[-1] if len(layers) == 1 else torch.cat([hidden_states[i] for i in layers], dim=-1)


def cache_length(cache: DynamicCache | None, layer: int) -> int:
    """Number of positions cached in `layer` of `cache` (0 when absent)."""
    if cache is None or layer >= len(cache.layers):
        return 0
    return cache.layers[layer].get_seq_length()
