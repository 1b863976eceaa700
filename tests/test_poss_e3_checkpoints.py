"""The PosS authors' PosS-on-EAGLE-3 checkpoints (`HINT-lab/PosS3-E3-Llama3.1-8B-Instruct`, trained with their
SpecForge fork, shrango/PosS `specforge/`), built here from the documented tensor names and shapes with tiny random
weights: they load with no extra argument, map draft positions to layers as the authors' training does, draft
losslessly inside `generate`; stacked EAGLE-3 drafters are refused (`transformers_poss.checkpoints.eagle3`)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from test_batches import left_padded
from tiny_models import DEVICE, fitted_drafter, prompts, tiny_target
from transformers_poss import PosSDrafter, PosSEagle3Config
from transformers_poss.generation.drafting import DraftSession, draft_chain

# Tiny sizes: H hidden, A = heads x head dim, K = KV heads x head dim, I MLP width, V target and Vd draft vocabulary.
H, HEADS, KV_HEADS, HEAD_DIM, I, V, VD = 64, 4, 2, 16, 128, 96, 40
TARGET_LAYERS = 8  # EAGLE-3's fused states [2, L // 2, L - 3] need a target of at least 7 layers
LAYER_SHAPES = {  # one EAGLE-3 layer; q/k/v read [embedding, hidden] (2H) in every PosS layer
    "self_attn.q_proj.weight": (HEADS * HEAD_DIM, 2 * H), "self_attn.k_proj.weight": (KV_HEADS * HEAD_DIM, 2 * H),
    "self_attn.v_proj.weight": (KV_HEADS * HEAD_DIM, 2 * H), "self_attn.o_proj.weight": (H, HEADS * HEAD_DIM),
    "mlp.gate_proj.weight": (I, H), "mlp.up_proj.weight": (I, H), "mlp.down_proj.weight": (H, I),
    "input_layernorm.weight": (H,), "hidden_norm.weight": (H,), "post_attention_layernorm.weight": (H,),
}


def authors_training_layers(ttt_length: int) -> int:
    """llama3_poss_eagle.py: `layer_num = (ttt_length - 1) // pos_per_layer + 1`, `pos_per_layer = 3`."""
    return (ttt_length - 1) // 3 + 1


def authors_training_layer(position: int) -> int:
    """core/poss_eagle3.py runs TTT step `idx` (0-based, draft position idx + 1) with `forward_num=idx`;
    llama3_poss_eagle.py: `layer_select(forward_num) = forward_num // pos_per_layer`."""
    return (position - 1) // 3


def authors_vllm_layer(position: int) -> int:
    """vllm/v1/spec_decode/eagle.py: the first pass (position 1) runs layer 0, draft step `token_index` (position
    token_index + 2) runs `select_layer_idx(token_index) = (token_index + 1) // 3`."""
    return 0 if position == 1 else (position - 2 + 1) // 3


def specforge_config(architecture: str = "LlamaForCausalLMPosSEagle3", **extra) -> dict:
    """config.json as the authors' training script saves it: `draft_model.save_pretrained` of a LlamaConfig read
    from a SpecForge draft config (`num_hidden_layers` 1 there) with the model's class name as architecture."""
    return {
        "architectures": [architecture], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 1,
        "draft_vocab_size": VD, "eos_token_id": 2, "head_dim": HEAD_DIM, "hidden_act": "silu", "hidden_size": H,
        "initializer_range": 0.02, "intermediate_size": I, "max_position_embeddings": 512, "mlp_bias": False,
        "model_type": "llama", "num_attention_heads": HEADS, "num_hidden_layers": 1, "num_key_value_heads": KV_HEADS,
        "pad_token_id": 0, "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 10000.0,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.55.0", "use_cache": True,
        "vocab_size": V, **extra,
    }


def random_poss_e3_tensors(num_layers: int = 3, stem: str = "layers", seed: int = 0) -> dict[str, torch.Tensor]:
    """Random fp32 tensors under the documented names and shapes: `{stem}.{i}.*` per layer, `fc [H, 3H]` without
    bias, `norm`, `lm_head [Vd, H]`, `d2t [Vd]` int64 offsets and `t2d [V]` bool; no embedding (not saved)."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(num_layers):
        for name, shape in LAYER_SHAPES.items():
            if name.endswith("norm.weight"):
                tensors[f"{stem}.{i}.{name}"] = 0.5 + torch.rand(shape, generator=generator)
            else:
                tensors[f"{stem}.{i}.{name}"] = torch.randn(shape, generator=generator) * 0.1
    tensors["fc.weight"] = torch.randn(H, 3 * H, generator=generator) * 0.1
    tensors["norm.weight"] = 0.5 + torch.rand(H, generator=generator)
    tensors["lm_head.weight"] = torch.randn(VD, H, generator=generator) * 0.1
    used = torch.randperm(V, generator=generator)[:VD].sort().values
    tensors["d2t"] = used - torch.arange(VD)
    tensors["t2d"] = torch.zeros(V, dtype=torch.bool).index_fill(0, used, True)
    return tensors


def write_poss_e3(folder, tensors: dict[str, torch.Tensor], config: dict | None = None):
    """A checkpoint folder: config.json and model.safetensors."""
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config or specforge_config()), encoding="utf-8")
    return folder


def native_as_poss_e3(drafter: PosSDrafter) -> dict[str, torch.Tensor]:
    """A native EAGLE-3 drafter's tensors under the authors' names (the inverse of the conversion)."""
    tensors = {}
    for name, value in drafter.state_dict().items():
        if name.startswith("specialists."):
            tensors["layers." + name[len("specialists."):]] = value
        elif name == "draft_lm_head.weight":
            tensors["lm_head.weight"] = value
        elif name == "draft_to_target":
            tensors["d2t"] = value - torch.arange(value.shape[0], device=value.device)
            tensors["t2d"] = torch.zeros(drafter.config.vocab_size, dtype=torch.bool).index_fill(0, value.cpu(), True)
        else:
            tensors[name] = value
    return {k: v.detach().cpu() for k, v in tensors.items()}


@pytest.mark.parametrize("stem", ["layers", "midlayers"])  # `midlayers` in the fork's first revision (ae024e72)
def test_a_poss_e3_folder_loads_alone(tmp_path, stem):
    tensors = random_poss_e3_tensors(stem=stem)
    drafter = PosSDrafter.from_pretrained(write_poss_e3(tmp_path / stem, tensors))
    config = drafter.config
    assert isinstance(config, PosSEagle3Config) and (config.num_specialists, config.positions_per_specialist) == (3, 3)
    assert config.draft_vocab_size == VD and config.fc_bias is False and config.norm_before_residual is False
    assert config.feature_layers is None  # SpecForge names none: the target's depth decides them when bound
    assert config.shared_context_kv  # one key/value list, as their TTT keeps it (test_reference_poss_e3)
    assert drafter.training_record["source_layout"] == "PosS on EAGLE-3"
    assert drafter.dtype == torch.float32
    state = drafter.state_dict()
    for i in range(3):
        for name in LAYER_SHAPES:
            assert torch.equal(state[f"specialists.{i}.{name}"], tensors[f"{stem}.{i}.{name}"]), (i, name)
    for native, source in (("fc.weight", "fc.weight"), ("norm.weight", "norm.weight"),
                           ("draft_lm_head.weight", "lm_head.weight")):
        assert torch.equal(state[native], tensors[source])
    assert drafter.draft_to_target.tolist() == (torch.arange(VD) + tensors["d2t"]).tolist()
    assert drafter.draft_to_target.tolist() == tensors["t2d"].nonzero().flatten().tolist()


@pytest.mark.parametrize("ttt_length", [4, 7, 8, 9])
def test_positions_map_to_layers_as_the_authors_train(tmp_path, ttt_length):
    """A checkpoint of `(ttt_length - 1) // 3 + 1` layers: every trained position (1 .. ttt_length) runs the layer
    training ran it with (their vLLM port agrees), later positions the last layer; drafting follows the map."""
    layers = authors_training_layers(ttt_length)
    folder = write_poss_e3(tmp_path / "e3", random_poss_e3_tensors(layers))
    drafter = PosSDrafter.from_pretrained(folder)
    config = drafter.config
    assert config.num_specialists == layers
    for position in range(1, ttt_length + 1):
        assert config.specialist_for_position(position) == authors_training_layer(position), position
        assert authors_vllm_layer(position) == authors_training_layer(position), position
    for position in range(ttt_length + 1, ttt_length + 8):  # never trained: the last layer
        assert config.specialist_for_position(position) == min(authors_training_layer(position), layers - 1)

    target = tiny_target("llama", num_hidden_layers=TARGET_LAYERS)
    drafter = drafter.eval().bind(target)
    ran = []
    original = drafter.run_specialist
    drafter.run_specialist = lambda specialist, *args, **kwargs: (ran.append(specialist),
                                                                  original(specialist, *args, **kwargs))[1]
    ids = torch.randint(0, V, (1, 12), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    with torch.no_grad():
        out = target(ids, output_hidden_states=config.input_feature_layers)
        session = DraftSession(drafter)
        session.commit(drafter.target_features(out.hidden_states)[0, :-1], ids[0, 1:])
        depth = ttt_length + 3
        draft_chain(session, depth, lambda level, logits: (logits.argmax(), logits))
    assert ran == [min(authors_training_layer(p), layers - 1) for p in range(1, depth + 1)]


def test_a_poss_e3_folder_drafts_losslessly(tmp_path):
    """fp32 greedy: a PosS-E3 folder (3 layers, fitted briefly to a tiny target, full draft vocabulary, written in
    the authors' layout) loaded with no argument drafts inside `generate` to plain `generate`'s tokens, tree and
    chain, 7 positions, one prompt or a batch."""
    target = tiny_target("llama", num_hidden_layers=TARGET_LAYERS)
    fitted = fitted_drafter(target, num_specialists=3, positions_per_specialist=3, steps=30, drafter_type="eagle3")
    folder = write_poss_e3(tmp_path / "e3", native_as_poss_e3(fitted), specforge_config(draft_vocab_size=V))
    drafter = PosSDrafter.from_pretrained(folder, tree_depth=7, tree_top_k=3, tree_total_tokens=16)
    assert (drafter.config.num_specialists, drafter.config.positions_per_specialist) == (3, 3)
    accepted = 0
    for prompt in prompts(V, 2):
        plain = target.generate(prompt, max_new_tokens=24, do_sample=False)
        for mode in ("tree", "chain"):
            out = target.generate(prompt, max_new_tokens=24, do_sample=False, return_dict_in_generate=True,
                                  assistant_model=drafter.with_generation_config(draft_mode=mode))
            assert out.sequences.tolist() == plain.tolist(), mode
            assert len(out.speculative_stats.position_acceptance) == 7
            accepted += sum(out.speculative_stats.acceptance_lengths)
    assert drafter.config.feature_layers == [2, 4, 5]  # from the target it was bound to
    assert accepted > 0
    # A left-padded batch of rows of different lengths: one shared key/value list per row, rows written alike.
    batch = left_padded(prompts(V, 3))
    plain = target.generate(**batch, max_new_tokens=24, do_sample=False)
    assert torch.equal(target.generate(**batch, max_new_tokens=24, do_sample=False, assistant_model=drafter), plain)


def _stacked(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Layers after the first reading H (the previous layer's output), as a stacked EAGLE-3 drafter's do."""
    for name in [k for k in tensors if k.startswith("layers.") and not k.startswith("layers.0.")]:
        if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")):
            tensors[name] = tensors[name][:, :H].clone()
    return tensors


@pytest.mark.parametrize("architecture", ["LlamaForCausalLMEagle3", "LlamaForCausalLMPosSEagle3"])
def test_stacked_eagle3_drafters_are_refused(tmp_path, architecture):
    folder = write_poss_e3(tmp_path / "stacked", _stacked(random_poss_e3_tensors(2)), specforge_config(architecture))
    for options in ({}, {"positions_per_specialist": 3}):
        with pytest.raises(ValueError, match=r"stacked EAGLE-3 drafter: its layers \[1\] read .*H wide, not 2H"):
            PosSDrafter.from_pretrained(folder, **options)


def test_where_positions_per_specialist_comes_from(tmp_path):
    """The config's `positions_per_specialist` when saved, else 3 for the authors' class; several 2H layers under
    another class need it passed."""
    tensors = random_poss_e3_tensors(3)
    saved = write_poss_e3(tmp_path / "saved", tensors, specforge_config(positions_per_specialist=2))
    assert PosSDrafter.from_pretrained(saved).config.positions_per_specialist == 2
    assert PosSDrafter.from_pretrained(saved, positions_per_specialist=4).config.positions_per_specialist == 4
    other = write_poss_e3(tmp_path / "other", tensors, specforge_config("LlamaForCausalLMEagle3"))
    with pytest.raises(ValueError, match="names neither LlamaForCausalLMPosSEagle3.*pass positions_per_specialist"):
        PosSDrafter.from_pretrained(other)
    loaded = PosSDrafter.from_pretrained(other, positions_per_specialist=2)
    assert (loaded.config.num_specialists, loaded.config.positions_per_specialist) == (3, 2)
    assert loaded.training_record["source_layout"] == "PosS on EAGLE-3"
    with pytest.raises(ValueError, match="holds 3 EAGLE-3 layer"):
        PosSDrafter.from_pretrained(other, num_specialists=2, positions_per_specialist=2)
