"""EAGLE-3 drafters (`drafter_type="eagle3"`): the architecture, training-inference equivalence, lossless drafting
inside `target.generate`, the published checkpoint layouts, and the speculators export."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from tiny_models import DEVICE, fitted_drafter, prompts, tiny_target
from transformers_poss import PosSConfig, PosSDrafter, PosSEagle3Config
from transformers_poss.generation.drafting import DraftSession, draft_chain
from transformers_poss.training import unrolled_forward

LAYERS = 8  # EAGLE-3's default low/mid/high states [2, L // 2, L - 3] need a target of at least 7 layers


def eagle3_target(family: str):
    """A tiny random 8-layer target: `"llama"` or `"qwen3"` (fp32, eval, on `DEVICE`)."""
    if family == "llama":
        return tiny_target("llama", num_hidden_layers=LAYERS)
    torch.manual_seed(0)
    config = Qwen3Config(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, num_hidden_layers=LAYERS, vocab_size=96, max_position_embeddings=512,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None)
    config._attn_implementation = "sdpa"
    model = Qwen3ForCausalLM(config).to(DEVICE).eval()
    model.generation_config.eos_token_id = model.generation_config.pad_token_id = None
    return model


_FITTED = {}


def fitted_eagle3(family: str):
    """(target, EAGLE-3 drafter with 2 specialists x 2 positions fitted briefly to the target), built once."""
    if family not in _FITTED:
        target = eagle3_target(family)
        drafter = fitted_drafter(target, drafter_type="eagle3", steps=100, tree_depth=4,
                                 tree_top_k=3, tree_total_tokens=12)
        _FITTED[family] = (target, drafter)
    return _FITTED[family]


# ---- architecture ------------------------------------------------------------------------------------------------
def test_eagle3_config_defaults_and_shapes():
    target = eagle3_target("llama")
    drafter = PosSDrafter.from_target(target, drafter_type="eagle3", num_specialists=2, positions_per_specialist=3)
    config = drafter.config
    assert config.feature_layers == [2, 4, 5] and config.input_feature_layers == [2, 4, 5, -1]
    assert config.draft_vocab_size == 96 and config.fc_bias is False and drafter.layer_input_size == 128
    shapes = {k: tuple(v.shape) for k, v in drafter.state_dict().items()}
    assert shapes["fc.weight"] == (64, 192) and shapes["norm.weight"] == (64,)
    assert shapes["specialists.1.self_attn.q_proj.weight"] == (64, 128)
    assert shapes["specialists.1.self_attn.k_proj.weight"] == (32, 128)
    assert shapes["specialists.1.hidden_norm.weight"] == (64,)
    assert shapes["draft_lm_head.weight"] == (96, 64)
    with pytest.raises(ValueError, match="at least 7 layers"):
        PosSDrafter.from_target(tiny_target("llama"), drafter_type="eagle3")
    with pytest.raises(ValueError, match="final state"):
        PosSDrafter.from_target(target, drafter_type="eagle3", feature_layers=[2, 4, -1])
    with pytest.raises(ValueError, match="EAGLE-3 setting"):
        PosSConfig.from_target_config(target.config, norm_before_residual=True)


def test_eagle3_layer_matches_the_reference_equations():
    """One specialist, written out: attention over [norm(e), norm(h)] with h (or norm(h)) as residual, then the MLP;
    logits through the drafter's own norm and head."""
    target = eagle3_target("llama")
    for norm_before_residual in (False, True):
        torch.manual_seed(1)
        drafter = PosSDrafter.from_target(target, drafter_type="eagle3", norm_before_residual=norm_before_residual)
        layer = drafter.specialists[0]
        for norm in (layer.input_layernorm, layer.hidden_norm, layer.post_attention_layernorm, drafter.norm):
            torch.nn.init.uniform_(norm.weight, 0.5, 1.5)
        ids = torch.randint(0, 96, (1, 7), generator=torch.Generator().manual_seed(2)).to(DEVICE)
        with torch.no_grad():
            out = target(ids, output_hidden_states=drafter.config.input_feature_layers)
            hidden = drafter.fc(torch.cat([out.hidden_states[i] for i in (2, 4, 5)], dim=-1))
            got = drafter.bind(target)(ids, drafter.fuse_features(drafter.target_features(out.hidden_states)),
                                       return_logits=True)
            embeds = target.get_input_embeddings()(ids)
            normed = layer.hidden_norm(hidden)
            attention_input = torch.cat((layer.input_layernorm(embeds), normed), dim=-1)
            positions = torch.arange(7, device=DEVICE)[None]
            causal = torch.full((7, 7), float("-inf"), device=DEVICE).triu(1)[None, None]
            attended, _ = layer.self_attn(attention_input, drafter.rotary_emb(attention_input, positions), causal)
            mid = (normed if norm_before_residual else hidden) + attended
            expected = mid + layer.mlp(layer.post_attention_layernorm(mid))
        torch.testing.assert_close(got.features, expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got.logits, drafter.draft_lm_head(drafter.norm(expected)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_specialists,k", [(1, 1), (2, 2)])
def test_eagle3_unrolled_steps_equal_inference_drafting(num_specialists, k):
    """Unroll step j of the training forward = `draft_chain`'s depth j + 1 on the same sequence (fp32): the drafter's
    own pre-norm output feeds the next position, the context reads fc(low, mid, high)."""
    target = eagle3_target("llama")
    torch.manual_seed(3)
    drafter = PosSDrafter.from_target(target, drafter_type="eagle3", num_specialists=num_specialists,
                                      positions_per_specialist=k).eval().bind(target)
    depth = 4
    ids = torch.randint(0, 96, (1, 16), generator=torch.Generator().manual_seed(4)).to(DEVICE)
    with torch.no_grad():
        out = target(ids, output_hidden_states=drafter.config.input_feature_layers)
        features = drafter.target_features(out.hidden_states)
        predictions = unrolled_forward(drafter, ids, features, depth)
    seen = []
    original_logits = drafter.logits
    drafter.logits = lambda feats: (seen.append(feats.clone()), original_logits(feats))[1]
    max_error, compared = 0.0, 0
    try:
        for S in range(1, ids.shape[1] - depth):
            seen.clear()
            session = DraftSession(drafter)
            session.commit(features[0, :S], ids[0, 1: S + 1])
            draft_chain(session, depth, lambda level, logits: (ids[0, S + level].clone(), logits))
            for j in range(depth):
                max_error = max(max_error, (seen[j] - predictions[j][0, S - 1 + j]).abs().max().item())
                compared += 1
    finally:
        del drafter.logits
    assert compared == (ids.shape[1] - depth - 1) * depth
    scale = max(p.abs().max().item() for p in predictions)
    assert max_error <= 1e-5 * max(scale, 1.0), max_error
    gap = (predictions[2][0, 4:] - predictions[0][0, 4:]).abs().max().item()
    assert gap > 1e3 * max_error + 1e-4  # later steps really differ from teacher forcing


# ---- drafting inside generate ------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_eagle3_drafting_is_lossless(family):
    """fp32 greedy: tree and chain drafting with an EAGLE-3 drafter return plain `generate`'s tokens; the drafter
    accepts some drafts and the per-position statistics are there."""
    target, drafter = fitted_eagle3(family)
    accepted = 0
    for prompt in prompts(96, 3):
        plain = target.generate(prompt, max_new_tokens=24, do_sample=False)
        for mode in ("tree", "chain"):
            out = target.generate(prompt, max_new_tokens=24, do_sample=False, return_dict_in_generate=True,
                                  assistant_model=drafter.with_generation_config(draft_mode=mode))
            assert out.sequences.tolist() == plain.tolist(), mode
            stats = out.speculative_stats
            assert len(stats.position_acceptance) == 4
            accepted += sum(stats.acceptance_lengths)
    assert accepted > 0


# ---- published layouts -------------------------------------------------------------------------------------------
def _llama_fields(drafter: PosSDrafter, layers: int) -> dict:
    """The drafter's layer settings as a plain Llama `config.json` would spell them."""
    layer = drafter.config.draft_layer_config
    return {
        "model_type": "llama", "hidden_size": layer["hidden_size"], "intermediate_size": layer["intermediate_size"],
        "num_attention_heads": layer["num_attention_heads"], "num_key_value_heads": layer["num_key_value_heads"],
        "head_dim": layer["head_dim"], "rms_norm_eps": layer["rms_norm_eps"], "hidden_act": "silu",
        "max_position_embeddings": layer["max_position_embeddings"], "vocab_size": drafter.config.vocab_size,
        "num_hidden_layers": layers, "rope_theta": layer["rope_parameters"]["rope_theta"], "rope_scaling": None,
        "tie_word_embeddings": False, "pad_token_id": 0,
    }


def write_layout(drafter: PosSDrafter, folder, layout: str, target=None) -> dict:
    """Write `drafter` as a checkpoint of a published layout (tensor names, shapes and config fields as the
    references save them; a speculators folder stores `target`'s embedding); returns the tensors written."""
    import json

    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    n = drafter.config.num_specialists
    assert n == 1 or layout in ("speculators", "poss_eagle3"), "SafeAILab / SpecForge layouts hold one layer"
    prefix = {"safeailab": "midlayer.", "specforge": "midlayer.", "speculators": "layers.{i}.",
              "poss_eagle3": "layers.{i}."}[layout]
    tensors = {}
    for name, value in drafter.state_dict().items():
        if name.startswith("specialists."):
            index, rest = name[len("specialists."):].split(".", 1)
            tensors[prefix.format(i=index) + rest] = value
        elif name == "draft_lm_head.weight":
            tensors["lm_head.weight"] = value
        elif name == "draft_to_target":
            tensors["d2t"] = value - torch.arange(value.shape[0])
            tensors["t2d"] = torch.zeros(drafter.config.vocab_size, dtype=torch.bool).index_fill(0, value, True)
        else:
            tensors[name] = value
    tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    config = {**_llama_fields(drafter, n), "draft_vocab_size": drafter.config.draft_vocab_size}
    if layout == "safeailab":
        config["architectures"] = ["LlamaForCausalLM"]
        torch.save(tensors, folder / "pytorch_model.bin")
    elif layout in ("specforge", "poss_eagle3"):
        config["architectures"] = ["LlamaForCausalLMEagle3" if layout == "specforge" else "LlamaForCausalLMPosSEagle3"]
        save_file(tensors, str(folder / "model.safetensors"))
    else:
        tensors["embed_tokens.weight"] = target.get_input_embeddings().weight.detach().cpu().clone()
        config = {
            "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3", "speculators_version": "0.3.0",
            "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                   "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                                   "verifier": {"name_or_path": "org/tiny-target", "architectures": ["X"]}},
            "transformer_layer_config": _llama_fields(drafter, 1), "draft_vocab_size": drafter.config.draft_vocab_size,
            "norm_before_residual": drafter.config.norm_before_residual, "target_hidden_size": None,
            "eagle_aux_hidden_state_layer_ids": drafter.config.feature_layers,
        }
        save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config), encoding="utf-8")
    return tensors


def random_eagle3(target, num_specialists=1, norm_before_residual=False, seed=5):
    """A random EAGLE-3 drafter with a 40-token draft vocabulary scattered over the target's, non-trivial norms."""
    torch.manual_seed(seed)
    drafter = PosSDrafter.from_target(target, drafter_type="eagle3", draft_vocab_size=40,
                                      num_specialists=num_specialists, positions_per_specialist=2,
                                      norm_before_residual=norm_before_residual)
    drafter.bind(target).init_draft_vocab(torch.randperm(96)[:40].sort().values)
    for name, param in drafter.named_parameters():
        if name.endswith("norm.weight"):
            torch.nn.init.uniform_(param, 0.5, 1.5)
    return drafter.eval()


def first_specialist(drafter: PosSDrafter) -> PosSDrafter:
    """A one-specialist copy of `drafter` (its specialist 0 and shared weights)."""
    config = copy.deepcopy(drafter.config)
    config.num_specialists = config.positions_per_specialist = 1
    single = PosSDrafter(config)
    single.load_state_dict({k: v for k, v in drafter.state_dict().items()
                            if not k.startswith("specialists.") or k.startswith("specialists.0.")})
    return single.eval()


def assert_same_drafter(a: PosSDrafter, b: PosSDrafter, target):
    """Same draft distributions over target ids for every specialist, same fused inputs."""
    a, b = a.bind(target), b.bind(target)
    ids = torch.randint(0, 96, (1, 12), generator=torch.Generator().manual_seed(6)).to(DEVICE)
    with torch.no_grad():
        out = target(ids, output_hidden_states=a.config.input_feature_layers)
        assert b.config.input_feature_layers == a.config.input_feature_layers
        features = a.target_features(out.hidden_states)
        for s in range(a.config.num_specialists):
            got = [d(ids, d.fuse_features(features), specialist=s, return_logits=True) for d in (a, b)]
            torch.testing.assert_close(got[0].features, got[1].features, rtol=0, atol=0)
            torch.testing.assert_close(got[0].logits, got[1].logits, rtol=0, atol=0)
    assert a.draft_to_target.tolist() == b.draft_to_target.tolist()


LAYOUTS = ["safeailab", "specforge", "speculators", "poss_eagle3"]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_published_layouts_load_exactly(layout, family, tmp_path):
    target = eagle3_target(family)
    specialists = 2 if layout == "poss_eagle3" else 1
    source = random_eagle3(target, specialists, norm_before_residual=layout == "speculators")
    write_layout(source, tmp_path / layout, layout, target)
    options = {} if layout == "speculators" else {"target": target}
    if layout == "poss_eagle3":
        options["positions_per_specialist"] = 2
    loaded = PosSDrafter.from_pretrained(tmp_path / layout, **options).bind(target)
    assert isinstance(loaded.config, PosSEagle3Config) and loaded.config.num_specialists == specialists
    assert loaded.training_record["source_layout"].startswith(
        {"safeailab": "EAGLE-3 (SafeAILab)", "specforge": "EAGLE-3 (SpecForge", "speculators": "speculators",
         "poss_eagle3": "PosS on EAGLE-3"}[layout])
    assert_same_drafter(source, loaded, target)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_loaded_layouts_draft_losslessly(layout, tmp_path):
    target, fitted = fitted_eagle3("llama")
    write_layout(fitted if layout == "poss_eagle3" else first_specialist(fitted), tmp_path / layout, layout, target)
    options = {} if layout == "speculators" else {"num_target_layers": LAYERS}
    if layout == "poss_eagle3":
        options["positions_per_specialist"] = 2
    loaded = PosSDrafter.from_pretrained(tmp_path / layout, tree_depth=4, tree_top_k=3, tree_total_tokens=12,
                                         **options)
    assert loaded.config.num_specialists == (2 if layout == "poss_eagle3" else 1)
    prompt = prompts(96, 1)[0]
    plain = target.generate(prompt, max_new_tokens=20, do_sample=False)
    for mode in ("tree", "chain"):
        out = target.generate(prompt, max_new_tokens=20, do_sample=False, return_dict_in_generate=True,
                              assistant_model=loaded.with_generation_config(draft_mode=mode))
        assert out.sequences.tolist() == plain.tolist()
        assert sum(out.speculative_stats.acceptance_lengths) > 0


def _specforge(tmp_path, target, edit):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "bad"
    write_layout(random_eagle3(target), folder, "specforge")
    tensors = load_file(str(folder / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


@pytest.mark.parametrize("edit,message", [
    (lambda t: t.update({"midlayer.self_attn.q_proj.weight": torch.zeros(64, 64)}),
     r"wrong shapes: midlayer.self_attn.q_proj.weight has \(64, 64\), expected \(64, 128\)"),
    (lambda t: t.pop("norm.weight"), "missing tensors: norm.weight"),
    (lambda t: t.update({"midlayer.extra.weight": torch.zeros(2)}), "unexpected tensors: midlayer.extra.weight"),
    (lambda t: t.update({"d2t": torch.zeros(40, dtype=torch.long)}), "t2d does not mark"),
])
def test_corrupted_checkpoints_are_refused(tmp_path, edit, message):
    target = eagle3_target("llama")
    folder = _specforge(tmp_path, target, edit)
    with pytest.raises(ValueError, match=message):
        PosSDrafter.from_pretrained(folder, target=target)


def test_a_checkpoint_without_its_fused_layers_takes_them_from_the_target_it_binds_to(tmp_path):
    """A SafeAILab/SpecForge folder names no fused layers: it loads alone and `generate` resolves them from the
    target's depth (EAGLE-3's `[2, L // 2, L - 3]`), drafting as a drafter loaded with the depth; a target too shallow
    to decide them is refused, naming why, before any work."""
    target, fitted = fitted_eagle3("llama")
    write_layout(first_specialist(fitted), tmp_path / "sf", "specforge")
    alone = PosSDrafter.from_pretrained(tmp_path / "sf")
    assert alone.config.feature_layers is None
    with pytest.raises(ValueError, match="bind"):
        alone.config.input_feature_layers
    shallow = tiny_target("llama", num_hidden_layers=4)
    with pytest.raises(ValueError, match="fuses.*at least 7 layers"):
        shallow.generate(prompts(96, 1)[0], max_new_tokens=4, do_sample=False, assistant_model=alone)
    prompt = prompts(96, 1)[0]
    out = target.generate(prompt, max_new_tokens=20, do_sample=False, assistant_model=alone,
                          return_dict_in_generate=True)
    assert alone.config.feature_layers == [2, LAYERS // 2, LAYERS - 3]
    assert out.sequences.tolist() == target.generate(prompt, max_new_tokens=20, do_sample=False).tolist()
    with_depth = PosSDrafter.from_pretrained(tmp_path / "sf", num_target_layers=LAYERS)
    again = target.generate(prompt, max_new_tokens=20, do_sample=False, assistant_model=with_depth,
                            return_dict_in_generate=True)
    assert again.speculative_stats.acceptance_lengths == out.speculative_stats.acceptance_lengths
    alone.save_pretrained(tmp_path / "native")  # resolved: saved with its layers
    assert PosSDrafter.from_pretrained(tmp_path / "native").config.feature_layers == alone.config.feature_layers


def test_wrong_target_and_stacked_drafters_are_refused(tmp_path):
    target = eagle3_target("llama")
    source = random_eagle3(target)
    write_layout(source, tmp_path / "sf", "specforge")
    other = tiny_target("llama", num_hidden_layers=LAYERS, vocab_size=128)
    loaded = PosSDrafter.from_pretrained(tmp_path / "sf", num_target_layers=LAYERS)
    with pytest.raises(ValueError, match="vocab_size"):  # bound before any drafting
        other.generate(prompts(96, 1)[0], max_new_tokens=4, do_sample=False, assistant_model=loaded)
    write_layout(source, tmp_path / "spec", "speculators", target)
    with pytest.raises(ValueError, match="embedding that differs"):
        PosSDrafter.from_pretrained(tmp_path / "spec", target=tiny_target("llama", num_hidden_layers=LAYERS, seed=9))
    # A stacked speculators drafter: a second layer reading H (not 2H).
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(tmp_path / "spec" / "model.safetensors"))
    for name in [k for k in tensors if k.startswith("layers.0.")]:
        value = tensors[name]
        if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")):
            value = value[:, :64].clone()
        tensors["layers.1." + name[len("layers.0."):]] = value.clone()
    save_file(tensors, str(tmp_path / "spec" / "model.safetensors"))
    for options in ({"positions_per_specialist": 1}, {}):
        with pytest.raises(ValueError, match="stacked EAGLE-3 drafter"):
            PosSDrafter.from_pretrained(tmp_path / "spec", **options)


def test_convert_cli_writes_a_native_folder(tmp_path):
    from transformers_poss import cli

    target = eagle3_target("llama")
    source = random_eagle3(target)
    write_layout(source, tmp_path / "sf", "safeailab")
    target.save_pretrained(tmp_path / "target")
    assert cli.main(["convert", str(tmp_path / "sf"), str(tmp_path / "native"), "--target",
                     str(tmp_path / "target")]) == 0
    native = PosSDrafter.from_pretrained(tmp_path / "native").bind(target)
    assert native.config.feature_layers == [2, 4, 5]
    assert_same_drafter(source, native, target)


# ---- export ------------------------------------------------------------------------------------------------------
def test_export_then_import_gives_identical_drafts(tmp_path, capsys):
    import json

    from transformers_poss import cli
    from transformers_poss.checkpoints.export import export_speculators

    target = eagle3_target("llama")
    source = random_eagle3(target, norm_before_residual=True)
    source.config.target_name_or_path = "org/tiny-target"
    export_speculators(source, tmp_path / "vllm")
    config = json.loads((tmp_path / "vllm" / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3" and config["norm_before_residual"] is True
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 6
    assert config["speculators_config"]["verifier"]["name_or_path"] == "org/tiny-target"
    assert config["transformer_layer_config"]["num_hidden_layers"] == 1
    loaded = PosSDrafter.from_pretrained(tmp_path / "vllm").bind(target)
    assert_same_drafter(source, loaded, target)

    poss = random_eagle3(target, num_specialists=2)
    poss.config.target_name_or_path = "org/tiny-target"
    poss.save_pretrained(tmp_path / "poss")
    assert cli.main(["export", "--format", "speculators", str(tmp_path / "poss"), str(tmp_path / "refused")]) == 2
    assert "no place for one layer per group of positions" in capsys.readouterr().err
    with pytest.warns(UserWarning, match="specialist 0 of 2"):
        export_speculators(poss, tmp_path / "first", first_specialist=True)
    first = PosSDrafter.from_pretrained(tmp_path / "first").bind(target)
    ids = torch.randint(0, 96, (1, 9), generator=torch.Generator().manual_seed(7)).to(DEVICE)
    with torch.no_grad():
        out = target(ids, output_hidden_states=poss.config.input_feature_layers)
        features = poss.target_features(out.hidden_states)
        a = poss.bind(target)(ids, poss.fuse_features(features), specialist=0, return_logits=True).logits
        b = first(ids, first.fuse_features(features), return_logits=True).logits
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    with pytest.raises(ValueError, match="Only EAGLE-3 drafters"):
        export_speculators(PosSDrafter.from_target(target), tmp_path / "eagle2", verifier="x")


# ---- training ----------------------------------------------------------------------------------------------------
def test_training_flag_builds_and_trains_an_eagle3_drafter(tmp_path):
    """`--drafter-type eagle3`: build_drafter makes an EAGLE-3 drafter (fc without bias, default fused states), the
    unrolled objective is EAGLE-3's decayed token loss only, it trains, and warm start copies specialist 0 into
    PosS-on-EAGLE-3 specialists."""
    from transformers_poss.training import TrainingArguments, UnrolledObjective, build_drafter, warm_start
    from transformers_poss.training.objective import EAGLE3_STEP_DECAY

    target = eagle3_target("llama")
    args = TrainingArguments(output_dir=str(tmp_path), target="unused", data="unused", drafter_type="eagle3",
                             num_specialists=2, positions_per_specialist=2)
    args.check()
    drafter, _ = build_drafter(args, target)
    assert isinstance(drafter.config, PosSEagle3Config) and drafter.config.fc_bias is False and drafter.config.feature_layers == [2, 4, 5]
    with pytest.raises(ValueError, match="only the final"):
        build_drafter(args, target, feature_layers=[-1])
    ids = torch.randint(0, 96, (2, 20), generator=torch.Generator().manual_seed(8)).to(DEVICE)
    loss_mask = torch.ones_like(ids)
    with torch.no_grad():
        out = target(ids, output_hidden_states=drafter.config.input_feature_layers)
        features = drafter.target_features(out.hidden_states)
    objective = UnrolledObjective(drafter, target, depth=4)
    first = objective(ids, features, loss_mask)
    assert torch.all(first.feature_loss == 0) and torch.all(first.count > 0)
    weights = torch.tensor([EAGLE3_STEP_DECAY ** j for j in range(4)], device=first.soft_ce.device)
    torch.testing.assert_close(first.loss.detach(), (weights * first.soft_ce).sum())
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    for _ in range(15):
        optimizer.zero_grad()
        objective(ids, features, loss_mask).loss.backward()
        optimizer.step()
    after = objective(ids, features, loss_mask)  # the soft CE of a random target is near its entropy: count hits
    assert after.loss.item() < first.loss.item() and after.correct.sum() > first.correct.sum() + 20

    single, _ = build_drafter(TrainingArguments(output_dir=str(tmp_path), target="unused", data="unused",
                                                drafter_type="eagle3"), target)
    record = warm_start(drafter, single)
    assert record["source_specialists"] == 1
    for layer in drafter.specialists:
        torch.testing.assert_close(layer.self_attn.q_proj.weight, single.specialists[0].self_attn.q_proj.weight)
    with pytest.raises(ValueError, match="eagle3 drafter from a eagle one"):
        warm_start(drafter, PosSDrafter.from_target(target, fc_bias=False))
