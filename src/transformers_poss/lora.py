"""LoRA specialists: one shared specialist layer plus a low-rank adapter per position group (peft).

With `PosSConfig.lora_rank` set, the drafter's `num_specialists` layers share every weight of one decoder layer (the
same `nn.Parameter` objects: the attention and MLP projections and the norms), and each carries its own peft LoRA
adapter (`LoraConfig(r=lora_rank, lora_alpha=lora_alpha, target_modules=lora_target_modules)`, injected with
`peft.inject_adapter_in_model`) on the projections named by `lora_target_modules`. Specialist `i` computes
`W x + (alpha / r) B_i A_i x` for each adapted projection `W`. Each specialist keeps its own KV cache (its keys and
values depend on its adapter), exactly as full specialists do, so drafting, training and verification are unchanged.

Saved (`save_pretrained`, safetensors) the shared weights appear once, under specialist 0's names; each specialist's
adapter under its own (`specialists.{i}.self_attn.q_proj.lora_A.default.weight`, ...). `merge_lora_specialists`
turns such a drafter into an ordinary one of `num_specialists` full layers (`W + (alpha / r) B_i A_i` each), which is
what `poss export` writes and what `PosSDrafter.from_pretrained(..., merge_lora=True)` returns.

The authors of PosS tried per-position LoRA layers in their HASS fork (DoRA, rank 8, on `q_proj` / `v_proj`, over
full per-position copies of a HASS layer) and published full layers; here the base weights are shared for real.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from .extras import require

ADAPTER = "default"  # each specialist carries one adapter, under peft's default name
PEFT_USER = "LoRA specialists (`lora_rank`)"  # what needs peft


def lora_config(config):
    """The peft `LoraConfig` of a LoRA-specialist drafter's `PosSConfig`."""
    peft = require("peft", "lora", PEFT_USER)
    return peft.LoraConfig(r=config.lora_rank, lora_alpha=config.lora_alpha, lora_dropout=0.0, bias="none",
                           target_modules=list(config.lora_target_modules))


def share_and_adapt(specialists: nn.ModuleList, config) -> None:
    """Tie every weight of `specialists[1:]` to `specialists[0]`'s (the shared layer), then inject one LoRA adapter
    into each specialist; every parameter stays trainable (the shared layer learns from every position)."""
    inject_adapter_in_model = require("peft", "lora", PEFT_USER).inject_adapter_in_model
    shared = specialists[0]
    for layer in specialists[1:]:
        for name, parameter in shared.named_parameters():
            owner, _, leaf = name.rpartition(".")
            setattr(layer.get_submodule(owner) if owner else layer, leaf, parameter)
    peft_config = lora_config(config)
    for layer in specialists:
        inject_adapter_in_model(peft_config, layer, adapter_name=ADAPTER)
        for parameter in layer.parameters():
            parameter.requires_grad_(True)


def tied_keys(specialists: nn.ModuleList, prefix: str = "specialists.") -> dict[str, str]:
    """`{name in specialist i > 0: the same parameter's name in specialist 0}` for the shared weights."""
    shared = [name for name, _ in specialists[0].named_parameters() if ".lora_" not in name]
    return {f"{prefix}{i}.{name}": f"{prefix}0.{name}" for i in range(1, len(specialists)) for name in shared}


def drop_tied_entries(drafter, state_dict, prefix, local_metadata) -> None:
    """State-dict post hook: the shared layer's weights under specialists 1.. leave (specialist 0's stay)."""
    for name in tied_keys(drafter.specialists, prefix + "specialists."):
        state_dict.pop(name, None)


def fill_tied_entries(drafter, state_dict, prefix, *unused) -> None:
    """Load-state-dict pre hook: the shared layer's weights are read for specialists 1.. from specialist 0's names."""
    for name, source in tied_keys(drafter.specialists, prefix + "specialists.").items():
        if name not in state_dict and source in state_dict:
            state_dict[name] = state_dict[source]


def adapted_modules(layer: nn.Module) -> dict[str, nn.Module]:
    """`{module path: peft LoRA layer}` of one specialist."""
    LoraLayer = require("peft.tuners.lora", "lora", PEFT_USER).LoraLayer
    return {name: module for name, module in layer.named_modules() if isinstance(module, LoraLayer)}


def merge_lora_specialists(drafter):
    """An ordinary drafter (`lora_rank` None) of `num_specialists` full layers, each the shared layer with its
    specialist's adapter merged in (`W + (alpha / r) B A`); the same generation config, records and kernel setting."""
    config = copy.deepcopy(drafter.config)
    config.lora_rank = config.lora_alpha = config.lora_target_modules = None
    merged = type(drafter)(config).to(device=drafter.fc.weight.device, dtype=drafter.fc.weight.dtype)
    every = drafter.state_dict()
    fill_tied_entries(drafter, every, "")  # the shared weights under every specialist's names
    state = {name.replace(".base_layer.", "."): tensor for name, tensor in every.items() if ".lora_" not in name}
    for index, layer in enumerate(drafter.specialists):
        for path, module in adapted_modules(layer).items():
            base = module.get_base_layer().weight
            with torch.no_grad():
                state[f"specialists.{index}.{path}.weight"] = base + module.get_delta_weight(ADAPTER).to(base.dtype)
    merged.load_state_dict(state, strict=True)
    merged.generation_config = copy.deepcopy(drafter.generation_config)
    merged.training_record, merged.tuning_record = dict(drafter.training_record), dict(drafter.tuning_record)
    merged.int8_draft_weights = drafter.int8_draft_weights
    return merged.train(drafter.training)


def load_shared_layer(specialists: nn.ModuleList, layer_state: dict[str, torch.Tensor]) -> None:
    """Copy a full decoder layer's weights (`state_dict()` names, e.g. `self_attn.q_proj.weight`) into the shared
    layer of LoRA specialists; the adapters keep their weights."""
    names = {name.replace(".base_layer.", "."): name for name in specialists[0].state_dict()
             if ".lora_" not in name}
    if set(names) != set(layer_state):
        raise ValueError(f"the source layer's weights {sorted(set(layer_state) ^ set(names))} do not match the shared "
                         "layer's")
    specialists[0].load_state_dict({names[key]: value for key, value in layer_state.items()}, strict=False)
