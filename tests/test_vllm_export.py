"""`poss export --format vllm` (what the poss_vllm plugin in integrations/vllm serves) and the speculators export's
verifier architectures: tiny random models, no vLLM needed (tests_vllm/ runs the real engine)."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tiny_models import DEVICE, tiny_target
from transformers_poss import PosSDrafter, cli
from transformers_poss.checkpoints.export import export_speculators, export_vllm

PLUGIN = Path(__file__).resolve().parents[1] / "integrations" / "vllm"


def poss_drafter(target, num_specialists=3, k=2, **config):
    torch.manual_seed(1)
    drafter = PosSDrafter.from_target(target, num_specialists=num_specialists, positions_per_specialist=k,
                                      draft_vocab_size=48, draft_head_rows=16, tree_depth=5, **config)
    with torch.no_grad():  # every weight away from its initial value, the specialists different
        for parameter in drafter.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.05)
        drafter.draft_to_target.copy_(torch.randperm(target.config.vocab_size)[:48])
    drafter.config.target_name_or_path = "org/tiny-target"
    return drafter


def plugin_logits(tensors: dict, hidden: torch.Tensor, lm_head: torch.Tensor, vocab: int) -> torch.Tensor:
    """The poss_vllm model's `compute_logits`, from the exported tensors: own rows, mapped rows, scattered into the
    target vocabulary (other tokens -inf)."""
    ids = tensors["draft_to_target"]
    own = hidden @ tensors["draft_lm_head.weight"].T
    rows = own.shape[-1]
    mapped = hidden @ tensors["draft_head_map.weight"].T
    draft = torch.cat((own, mapped[..., :-1] @ lm_head[ids[rows:]].T + mapped[..., -1:]), dim=-1)
    logits = draft.new_full((*draft.shape[:-1], vocab), float("-inf"))
    logits[..., ids] = draft
    return logits


def test_vllm_export_of_a_poss_drafter(tmp_path):
    target = tiny_target("llama")
    drafter = poss_drafter(target)
    out = export_vllm(drafter, tmp_path / "vllm", verifier="org/tiny-target")
    config = json.loads((out / "config.json").read_text())
    poss = config["poss"]
    assert config["speculators_model_type"] == "eagle" and config["architectures"] == ["PosSEagleForCausalLM"]
    assert config["speculators_config"]["verifier"] == {"name_or_path": "org/tiny-target",
                                                         "architectures": ["LlamaForCausalLM"]}
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 5
    assert config["transformer_layer_config"]["num_hidden_layers"] == 3
    assert config["transformer_layer_config"]["model_type"] == "llama"
    assert (poss["num_specialists"], poss["positions_per_specialist"], poss["fc_bias"]) == (3, 2, True)
    assert (poss["draft_vocab_size"], poss["draft_head_rows"], poss["drafter_type"]) == (48, 16, "eagle")
    assert poss["target"]["hidden_size"] == 64 and poss["target"]["vocab_size"] == 96
    weights = out / poss["weights"]["file"]
    assert poss["weights"]["bytes"] == weights.stat().st_size
    assert poss["weights"]["sha256"] == hashlib.sha256(weights.read_bytes()).hexdigest()

    tensors = load_file(weights)
    state = drafter.state_dict()
    assert sorted(k for k in tensors if k.startswith("specialists.2.")) and "fc.bias" in tensors
    assert not any("rotary" in k or "embed" in k for k in tensors)
    for name, value in tensors.items():
        torch.testing.assert_close(value, state[name].cpu(), rtol=0, atol=0)
    # The plugin's draft logits from these tensors are the library's, token for token, at every specialist.
    ids = torch.randint(0, 96, (1, 7), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    with torch.no_grad():
        features = target(ids, output_hidden_states=True).hidden_states[-1]
        lm_head = target.get_output_embeddings().weight.detach().cpu()
        bound = drafter.bind(target)
        for specialist in range(3):
            hidden = bound(ids, features, specialist=specialist).features
            library = bound.logits(hidden)
            ours = plugin_logits(tensors, hidden.cpu(), lm_head, 96)
            torch.testing.assert_close(ours[..., drafter.draft_to_target.cpu()], library.cpu(), rtol=1e-5, atol=1e-5)
            assert torch.equal(drafter.to_target_ids(library.argmax(-1)).cpu(), ours.argmax(-1))


def test_vllm_export_of_specialist_zero_alone_and_of_an_eagle3_drafter(tmp_path):
    target = tiny_target("llama", num_hidden_layers=8)
    drafter = poss_drafter(target)
    with pytest.warns(UserWarning, match="specialist 0 of 3"):
        out = export_vllm(drafter, tmp_path / "first", first_specialist=True, verifier="x")
    config = json.loads((out / "config.json").read_text())
    assert config["poss"]["num_specialists"] == 1 and config["poss"]["first_specialist_only"] is True
    assert config["transformer_layer_config"]["num_hidden_layers"] == 1
    tensors = load_file(out / "model.safetensors")
    assert not any(k.startswith(("specialists.1.", "specialists.2.")) for k in tensors)
    torch.testing.assert_close(tensors["specialists.0.mlp.up_proj.weight"],
                               drafter.specialists[0].mlp.up_proj.weight.detach().cpu(), rtol=0, atol=0)

    torch.manual_seed(0)
    eagle3 = PosSDrafter.from_target(target, num_specialists=2, positions_per_specialist=1, drafter_type="eagle3",
                                     draft_vocab_size=32)
    out = export_vllm(eagle3, tmp_path / "eagle3", verifier="x")
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3" and config["architectures"] == ["PosSEagle3LlamaForCausalLM"]
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5] and config["norm_before_residual"] is False
    assert config["poss"]["target"]["num_hidden_layers"] == 8
    tensors = load_file(out / "model.safetensors")
    assert {"fc.weight", "norm.weight", "draft_lm_head.weight", "draft_to_target"} <= set(tensors)
    assert "fc.bias" not in tensors and tensors["specialists.1.self_attn.q_proj.weight"].shape[1] == 128


def test_vllm_export_of_the_authors_poss_on_eagle3_checkpoint(tmp_path, capsys):
    """A PosS-E3 folder in the authors' SpecForge layout (test_poss_e3_checkpoints) exports with `poss export
    --format vllm SRC DST --target T` as it is: 3 specialists of 3 positions (the plugin's map is the authors'
    training map), the fused layers of T's depth, the checkpoint's tensors under the drafter's names."""
    from test_poss_e3_checkpoints import authors_training_layer, random_poss_e3_tensors, write_poss_e3

    tensors = random_poss_e3_tensors(3)
    source = write_poss_e3(tmp_path / "e3", tensors)
    target = tmp_path / "target"
    tiny_target("llama", num_hidden_layers=8).save_pretrained(target)
    assert cli.main(["export", "--format", "vllm", str(source), str(tmp_path / "alone")]) == 2
    assert "does not name the target layers it fuses" in capsys.readouterr().err
    assert cli.main(["export", "--format", "vllm", str(source), str(tmp_path / "out"), "--target", str(target)]) == 0
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    poss = config["poss"]
    assert config["architectures"] == ["PosSEagle3LlamaForCausalLM"] and poss["drafter_type"] == "eagle3"
    assert (poss["num_specialists"], poss["positions_per_specialist"], poss["draft_vocab_size"]) == (3, 3, 40)
    assert poss["shared_context_kv"] is True  # recorded; the plugin does not serve it yet (it warns)
    assert config["transformer_layer_config"]["num_hidden_layers"] == 3
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5] and poss["target"]["num_hidden_layers"] == 8
    assert poss.get("position_groups") in (None, [3, 3, 3])  # the groups the plugin maps positions with
    n, k = poss["num_specialists"], poss["positions_per_specialist"]
    for position in range(1, 10):  # the plugin's map of positions to specialists, on the exported settings
        assert min((position - 1) // k, n - 1) == authors_training_layer(position)
    exported = load_file(tmp_path / "out" / "model.safetensors")
    for name, value in tensors.items():
        if name.startswith("layers."):
            assert torch.equal(exported["specialists." + name[len("layers."):]], value), name
    assert torch.equal(exported["fc.weight"], tensors["fc.weight"]) and "fc.bias" not in exported
    assert torch.equal(exported["draft_lm_head.weight"], tensors["lm_head.weight"])
    assert exported["draft_to_target"].tolist() == (torch.arange(40) + tensors["d2t"]).tolist()


def test_vllm_export_refusals(tmp_path):
    target = tiny_target("llama")
    with pytest.raises(ValueError, match="feature_layers unset or"):
        export_vllm(PosSDrafter.from_target(target, feature_layers=[1, -1]), tmp_path / "fused", verifier="x")
    with pytest.raises(ValueError, match="EAGLE-1/2-style drafters of"):
        export_vllm(PosSDrafter.from_target(tiny_target("qwen2")), tmp_path / "qwen2", verifier="x")
    drafter = poss_drafter(target)
    drafter.config.target_name_or_path = None
    with pytest.raises(ValueError, match="names its verifier"):
        export_vllm(drafter, tmp_path / "unnamed")
    other = tmp_path / "other_target"
    tiny_target("llama", hidden_size=32, num_attention_heads=2).save_pretrained(other)
    with pytest.raises(ValueError, match="hidden_size=64"):
        export_vllm(drafter, tmp_path / "wrong", target=other)
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "file").write_text("x")
    with pytest.raises(ValueError, match="not empty"):
        export_vllm(drafter, tmp_path / "busy", verifier="x")


def test_cli_export_vllm_with_a_target_folder_and_speculators_verifier_architectures(tmp_path, capsys):
    target = tiny_target("llama", num_hidden_layers=8)
    folder = tmp_path / "target"
    target.save_pretrained(folder)
    poss_drafter(target).save_pretrained(tmp_path / "poss")
    assert cli.main(["export", "--format", "vllm", str(tmp_path / "poss"), str(tmp_path / "out"),
                     "--target", str(folder)]) == 0
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["speculators_config"]["verifier"]["name_or_path"] == str(folder.resolve())
    assert config["poss"]["target"]["num_hidden_layers"] == 8
    assert "wrote" in capsys.readouterr().out

    torch.manual_seed(0)
    eagle3 = PosSDrafter.from_target(target, drafter_type="eagle3")
    eagle3.config.target_name_or_path = "org/tiny-target"
    eagle3.save_pretrained(tmp_path / "eagle3")
    unbound = PosSDrafter.from_pretrained(tmp_path / "eagle3")  # no target: architectures from the family
    export_speculators(unbound, tmp_path / "spec")
    config = json.loads((tmp_path / "spec" / "config.json").read_text())
    assert config["speculators_config"]["verifier"]["architectures"] == ["LlamaForCausalLM"]
    assert cli.main(["export", "--format", "speculators", str(tmp_path / "eagle3"), str(tmp_path / "spec2"),
                     "--target", str(folder)]) == 0
    config = json.loads((tmp_path / "spec2" / "config.json").read_text())
    assert config["speculators_config"]["verifier"] == {"name_or_path": str(folder.resolve()),
                                                        "architectures": ["LlamaForCausalLM"]}


def test_plugin_checks_weights_and_target_without_vllm(tmp_path, monkeypatch):
    """poss_vllm's file and target checks (plain Python: they import nothing from vLLM)."""
    monkeypatch.syspath_prepend(str(PLUGIN))
    for name in [m for m in sys.modules if m == "poss_vllm" or m.startswith("poss_vllm.")]:
        monkeypatch.delitem(sys.modules, name)
    from poss_vllm import PosSServingError
    from poss_vllm.config import check_target, check_weights

    target = tiny_target("llama")
    out = export_vllm(poss_drafter(target), tmp_path / "vllm", verifier="x")
    poss = json.loads((out / "config.json").read_text())["poss"]
    assert check_weights(out, poss) == out / "model.safetensors"
    check_target(poss, target.config)
    with pytest.raises(PosSServingError, match="built for another target.*hidden_size=64 \\(the served target has 32"):
        check_target(poss, tiny_target("llama", hidden_size=32, num_attention_heads=2).config)
    data = (out / "model.safetensors").read_bytes()
    (out / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(PosSServingError, match="truncated"):
        check_weights(out, poss)
    (out / "model.safetensors").unlink()
    with pytest.raises(PosSServingError, match="is missing"):
        check_weights(out, poss)
