"""A target split across devices (accelerate's big-model placement), forced on the CPU by a small memory budget or
a map with disk offload: the same features and the same training as the whole target, bad placements refused
before any weight is read."""

from __future__ import annotations

import json

import pytest
import torch

from tiny_models import tiny_target
from tiny_tokenizer import char_tokenizer
from transformers_poss import PosSDrafter
from transformers_poss.assets import load_causal_lm
from transformers_poss.placement import parse_placement, plan_device_map
from transformers_poss.training import (
    FeatureDataset, TrainingArguments, extract_features, load_feature_dataset, run_training,
)

# For the 4-layer tiny target (0.6 MiB in fp32): its embedding and first layer on the CPU, the rest (lm_head too) on
# disk (accelerate keeps room on the CPU to bring the largest offloaded layer back).
BUDGET = "cpu=400KB,disk=1GB"
MAP = {"model.embed_tokens": "disk", "model.layers.0": "cpu", "model.layers.1": "disk", "model.layers.2": "cpu",
       "model.layers.3": "disk", "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "disk"}


def save_target(folder, tie: bool = False):
    tiny_target("llama", num_hidden_layers=4, tie_word_embeddings=tie).save_pretrained(folder)
    char_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def target_folder(tmp_path_factory):
    return save_target(tmp_path_factory.mktemp("target"))


def reset_accelerate():
    """accelerate keeps process-wide state; each training run here starts from a clean one."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


@pytest.fixture
def fresh_accelerate():
    reset_accelerate()
    yield
    reset_accelerate()


def random_examples(count: int = 5, seed: int = 0) -> list[dict]:
    generator = torch.Generator().manual_seed(seed)
    examples = []
    for i in range(count):
        n = 9 + 4 * i
        examples.append({"input_ids": torch.randint(0, 96, (n,), generator=generator).tolist(),
                         "loss_mask": [0] * 3 + [1] * (n - 3)})
    return examples


def load_split(folder, device_map, max_memory=None):
    return load_causal_lm(folder, torch.float32, device_map=device_map, max_memory=max_memory)[0]


@pytest.mark.parametrize("tie,device_map,max_memory", [
    (False, "auto", BUDGET), (True, "auto", "cpu=350KB,disk=1GB"), (False, json.dumps(MAP), None),
    (False, '{"": "disk"}', None)], ids=["auto-budget", "tied-auto-budget", "map", "all-disk"])
def test_split_target_gives_the_features_of_the_whole_one(target_folder, tmp_path, tie, device_map, max_memory):
    """Also for a target whose lm_head is its embedding (the budget counts that weight once)."""
    if tie:
        target_folder = save_target(tmp_path / "tied", tie=True)
    device_map, max_memory = parse_placement(device_map, max_memory)
    whole = load_causal_lm(target_folder, torch.float32)[0]
    split = load_split(target_folder, device_map, max_memory)
    placed = set(split.hf_device_map.values())
    assert "disk" in placed and (device_map == {"": "disk"} or "cpu" in placed), split.hf_device_map
    offloaded = {name for name, weight in split.named_parameters() if weight.device.type == "meta"}
    assert ("lm_head.weight" in offloaded) != tie  # offloaded weights are read from the checkpoint at each call
    assert "model.layers.3.mlp.up_proj.weight" in offloaded
    examples = random_examples()
    for name, model in (("whole", whole), ("split", split)):
        extract_features(model, examples, str(tmp_path / name), batch_size=2, metadata={"data": "x"},
                         progress=False)
    reference, features = (FeatureDataset(load_feature_dataset(str(tmp_path / name))) for name in ("whole", "split"))
    for i in range(len(examples)):
        torch.testing.assert_close(features[i]["features"].float(), reference[i]["features"].float(),
                                   rtol=1e-2, atol=1e-2)  # bf16 storage of the same fp32 forward
        assert torch.equal(features[i]["target_argmax"], reference[i]["target_argmax"])
    with torch.no_grad():  # and the forward itself, in fp32, padded batch included
        ids = torch.tensor([examples[1]["input_ids"], examples[1]["input_ids"][::-1]])
        torch.testing.assert_close(split(ids, output_hidden_states=True).hidden_states[-1],
                                   whole(ids, output_hidden_states=True).hidden_states[-1], rtol=1e-5, atol=1e-5)


def test_bad_placements_are_refused_before_any_weight_is_read(target_folder, monkeypatch):
    from transformers import AutoModelForCausalLM

    def no_load(*args, **kwargs):
        raise AssertionError("weights were read before the placement was checked")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", no_load)
    missing_gpu = f"cuda:{torch.cuda.device_count()}"
    refused = [
        (("auto", "cpu=100KB"), "does not fit in --target-max-memory cpu=0.10 MiB"),  # and no disk offload allowed
        (("auto", "cpu=400KB"), "allow disk offload"),
        ((json.dumps({"": missing_gpu}), None), f"device '{missing_gpu}' does not exist on this machine"),
        (("auto", f"{torch.cuda.device_count()}=1GB"), "does not exist on this machine"),
        (('{"model.layers.0": "cpu",', None), "malformed JSON"),
        (("auto", "cpu:1GB"), "DEVICE=SIZE pairs"),
        (("auto", "cpu=lots"), "'lots' is not a size"),
        (('{"": "meta"}', None), "offload to 'disk'"),
        (("layers.json", None), "none of these"),
        ((None, "cpu=1GB"), "give --target-device-map"),
        ((json.dumps({**MAP, "model.layer.9": "cpu"}), None), "'model.layer.9', not modules of the target"),
        ((json.dumps({k: v for k, v in MAP.items() if k != "lm_head"}), None), "places no device for lm_head.weight"),
        ((json.dumps({"": "cpu"}), "cpu=100KB"), "puts 0.6"),  # a map over its budget
    ]
    for (device_map, max_memory), message in refused:
        with pytest.raises(ValueError, match=message.replace("(", r"\(")):
            load_split(target_folder, *parse_placement(device_map, max_memory))
    with pytest.raises(ValueError, match="drop the device"):
        load_causal_lm(target_folder, torch.float32, device="cpu", device_map="auto")
    # A map from a file is read like an inline one.
    path = target_folder / "placement.json"
    path.write_text(json.dumps(MAP))
    assert plan_device_map(target_folder, torch.float32, *parse_placement(str(path), None)) == MAP


def train(folder, output, data, **placement):
    """`run_training` on `folder`'s target: (the drafter, the target it trained against)."""
    from transformers_poss.training import pipeline

    loaded = []
    original = pipeline.load_target_and_tokenizer

    def load(*args, **kwargs):
        loaded.append(original(*args, **kwargs))
        return loaded[-1]

    pipeline.load_target_and_tokenizer = load
    args = TrainingArguments(output_dir=str(output), target=str(folder), target_dtype="float32", data=str(data),
                             num_specialists=2, positions_per_specialist=1, depth=2, batch_size=2, lr=3e-3,
                             warmup_steps=0, mixed_precision="no", save_steps=0, log_steps=1, progress=False,
                             max_steps=3, val_fraction=0.25, save_dtype="float32", draft_vocab_size=48, **placement)
    try:
        return run_training(args), loaded[0][0]
    finally:
        pipeline.load_target_and_tokenizer = original


@pytest.mark.parametrize("tie,device_map,max_memory", [(False, "auto", BUDGET), (True, '{"": "disk"}', None)],
                         ids=["auto-budget", "tied-all-disk"])
def test_online_training_with_a_split_target_trains_as_with_the_whole_one(tmp_path, fresh_accelerate, tie,
                                                                             device_map, max_memory):
    """The offloaded embedding and lm_head are made resident on the drafter's device (one tensor when tied); the
    drafter trains to the same weights."""
    folder = save_target(tmp_path / "target", tie=tie)
    words = ["the cat", "a dog ran", "so it goes", "hello there", "yes", "no way"]
    records = [{"conversations": [{"from": "human", "value": f"{words[i % 6]} {i}"},
                                  {"from": "gpt", "value": f"{words[(i + 2) % 6]} and {words[(i + 3) % 6]}"}]}
               for i in range(8)]
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in records))
    whole, whole_target = train(folder, tmp_path / "whole", data)
    reset_accelerate()
    split, target = train(folder, tmp_path / "split", data, target_device_map=device_map,
                          target_max_memory=max_memory)
    assert "disk" in target.hf_device_map.values()
    embed, lm_head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    assert embed.device.type == lm_head.device.type == "cpu"
    assert (embed is lm_head) == tie
    torch.testing.assert_close(lm_head, whole_target.get_output_embeddings().weight, rtol=0, atol=0)
    assert split.training_record["steps"] == whole.training_record["steps"] == 3
    saved = PosSDrafter.from_pretrained(tmp_path / "split").state_dict()
    for name, weight in PosSDrafter.from_pretrained(tmp_path / "whole").state_dict().items():
        torch.testing.assert_close(saved[name], weight, rtol=1e-4, atol=1e-5, msg=name)
    assert split.training_record["validation_position_accuracy"] == pytest.approx(
        whole.training_record["validation_position_accuracy"])


def test_features_and_train_commands_split_the_target(target_folder, tmp_path, fresh_accelerate):
    """`poss features` with a split target stores the features of the whole one; `poss train` on them with the
    target all on disk reads only its embedding and lm_head (made resident)."""
    from transformers_poss.cli import main

    records = [{"conversations": [{"from": "human", "value": f"hi {i}"}, {"from": "gpt", "value": f"ok {i} then"}]}
               for i in range(3)]
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in records))
    common = ["features", "--target", str(target_folder), "--target-dtype", "float32", "--data", str(data)]
    assert main([*common, "--output", str(tmp_path / "whole")]) == 0
    assert main([*common, "--output", str(tmp_path / "split"), "--target-device-map", "auto",
                 "--target-max-memory", BUDGET]) == 0
    reference, features = (FeatureDataset(load_feature_dataset(str(tmp_path / name))) for name in ("whole", "split"))
    for i in range(3):
        torch.testing.assert_close(features[i]["features"].float(), reference[i]["features"].float(),
                                   rtol=1e-2, atol=1e-2)
    assert main(["train", "--target", str(target_folder), "--target-dtype", "float32", "--features",
                 str(tmp_path / "split"), "--output-dir", str(tmp_path / "run"), "--target-device-map", '{"": "disk"}',
                 "--mixed-precision", "no", "--no-progress", "--max-steps", "2", "--batch-size", "1",
                 "--val-fraction", "0.34", "--save-steps", "0"]) == 0
    assert PosSDrafter.from_pretrained(tmp_path / "run").training_record["steps"] == 2
    refused = [(["--target-device-map", '{"": "cuda:7"}'], "does not exist on this machine"),
               (["--target-device-map", "auto", "--target-max-memory", "cpu=100KB"], "does not fit"),
               (["--target-device-map", "auto", "--device", "cpu"], "give one of them")]
    for options, message in refused:
        if torch.cuda.device_count() > 7 and "cuda:7" in options[1]:
            continue
        with pytest.raises(SystemExit, match=message):
            main([*common, "--output", str(tmp_path / "refused"), *options])
        assert not (tmp_path / "refused").exists()
