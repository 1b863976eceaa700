"""LoRA specialists (issue 56): one shared specialist layer plus a peft LoRA adapter per position group; lossless
drafting on every family, saved once with its adapters, loaded kept or merged, exported merged, trained from a single
specialist."""

from __future__ import annotations

import json

import pytest
import torch

from tiny_models import FAMILIES, distinct_adapters, fitted_drafter, prompts, tiny_target
from transformers_poss import PosSConfig, PosSDrafter
from transformers_poss.training.initialization import warm_start


def test_specialists_share_one_layer_and_each_has_its_adapter():
    drafter = PosSDrafter.from_target(tiny_target("llama"), num_specialists=3, position_groups=[1, 2, 3], lora_rank=4)
    first, last = drafter.specialists[0], drafter.specialists[2]
    assert first.mlp.up_proj.base_layer.weight is last.mlp.up_proj.base_layer.weight
    assert first.post_attention_layernorm.weight is last.post_attention_layernorm.weight
    assert first.self_attn.q_proj.lora_A["default"].weight is not last.self_attn.q_proj.lora_A["default"].weight
    assert (first.self_attn.layer_idx, last.self_attn.layer_idx) == (0, 2)  # each keeps its own KV cache
    full = PosSDrafter.from_target(tiny_target("llama"), num_specialists=3, position_groups=[1, 2, 3])
    layer = sum(p.numel() for p in full.specialists[0].parameters())
    shared = sum(p.numel() for p in drafter.parameters()) - sum(p.numel() for p in full.parameters())
    assert shared < -layer  # three full layers cost more than one shared layer and three adapters
    assert all(p.requires_grad for p in drafter.parameters())


@pytest.mark.parametrize("bad,message", [({"lora_rank": 0}, "lora_rank"), ({"num_specialists": 1, "lora_rank": 4},
                                         "num_specialists >= 2"), ({"lora_rank": 4, "lora_target_modules": ["fc"]},
                                         "lora_target_modules"), ({"lora_alpha": 8}, "need lora_rank")])
def test_bad_lora_settings_are_refused(bad, message):
    with pytest.raises(ValueError, match=message):
        PosSConfig.from_target_config(tiny_target("llama").config, **{"num_specialists": 2, **bad})


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_specialists_draft_losslessly(family):
    target = tiny_target(family)
    drafter = distinct_adapters(fitted_drafter(target, num_specialists=3, position_groups=[1, 2, 3], lora_rank=4,
                                        steps=150, tree_depth=5, tree_top_k=3, tree_total_tokens=12))
    seen = []
    for mode in ("tree", "chain"):
        view = drafter.with_generation_config(draft_mode=mode)
        for prompt in prompts(count=2):
            reference = target.generate(prompt, do_sample=False, max_new_tokens=24)
            out = target.generate(prompt, do_sample=False, max_new_tokens=24, assistant_model=view,
                                  return_dict_in_generate=True)
            assert torch.equal(out.sequences, reference), (family, mode)
            seen += out.speculative_stats.acceptance_lengths
    assert sum(seen) / len(seen) > 1.0, seen


def test_saved_once_loaded_kept_or_merged_and_exported_merged(tmp_path):
    from safetensors import safe_open

    from transformers_poss.checkpoints.export import export_vllm

    target = tiny_target("llama")
    drafter = PosSDrafter.from_target(target, num_specialists=3, position_groups=[1, 2, 3], lora_rank=4)
    drafter = distinct_adapters(drafter)
    drafter.save_pretrained(tmp_path / "lora")
    with safe_open(tmp_path / "lora" / "model.safetensors", "pt") as f:
        names = set(f.keys())
    assert "specialists.0.mlp.up_proj.base_layer.weight" in names
    assert "specialists.1.mlp.up_proj.base_layer.weight" not in names  # the shared layer is stored once
    assert "specialists.2.mlp.up_proj.lora_B.default.weight" in names
    assert json.loads((tmp_path / "lora" / "config.json").read_text())["lora_rank"] == 4
    kept = PosSDrafter.from_pretrained(tmp_path / "lora").bind(target)
    merged = PosSDrafter.from_pretrained(tmp_path / "lora", merge_lora=True).bind(target)
    assert kept.specialists[1].mlp.up_proj.base_layer.weight is kept.specialists[0].mlp.up_proj.base_layer.weight
    assert merged.config.lora_rank is None and type(merged.specialists[1].mlp.up_proj) is torch.nn.Linear
    ids, features = torch.randint(0, 90, (1, 6)), torch.randn(1, 6, 64)
    with torch.no_grad():
        for specialist in range(3):
            expected = drafter.bind(target)(ids, features, specialist=specialist).features
            torch.testing.assert_close(kept(ids, features, specialist=specialist).features, expected)
            torch.testing.assert_close(merged(ids, features, specialist=specialist).features, expected,
                                       atol=1e-5, rtol=1e-5)
    size_lora = (tmp_path / "lora" / "model.safetensors").stat().st_size
    merged.save_pretrained(tmp_path / "merged")
    assert size_lora < (tmp_path / "merged" / "model.safetensors").stat().st_size
    target.save_pretrained(tmp_path / "target")
    export_vllm(kept, tmp_path / "vllm", target=tmp_path / "target")
    with safe_open(tmp_path / "vllm" / "model.safetensors", "pt") as f:
        exported = {name: f.get_tensor(name) for name in f.keys()}
    assert not any(".lora_" in name or "base_layer" in name for name in exported)
    torch.testing.assert_close(exported["specialists.2.mlp.up_proj.weight"], merged.specialists[2].mlp.up_proj.weight)


def test_training_starts_from_a_single_specialist_where_it_stands():
    target = tiny_target("llama")
    single = fitted_drafter(target, num_specialists=1, positions_per_specialist=6, steps=40)
    drafter = PosSDrafter.from_target(target, num_specialists=3, position_groups=[1, 2, 3], lora_rank=4)
    warm_start(drafter, single)
    ids, features = torch.randint(0, 90, (1, 6)), torch.randn(1, 6, 64)
    with torch.no_grad():
        expected = single.bind(target)(ids, features, specialist=0).features
        for specialist in range(3):  # adapters at zero: every specialist is the single one
            torch.testing.assert_close(drafter.bind(target)(ids, features, specialist=specialist).features, expected)
