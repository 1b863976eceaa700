"""Held-out per-position accuracy of saved drafters on one feature folder, as `poss train` validates.

    python validate.py VAL_FEATURES NAME=DRAFTER_FOLDER [NAME=DRAFTER_FOLDER ...] [--output FILE.json]

Teacher-forced like training's validation (no noise): top-1 agreement with the target's greedy token at draft
positions 1..6, the drafter's own predicted features fed back at positions 2-6; and how often that token is among
the drafter's 10 best. Each drafter reads the target layers it was trained on from the folder.
"""
import argparse
import json
import tempfile

import torch

from transformers_poss import PosSDrafter
from transformers_poss.training import PosSTrainer, TrainingArguments
from transformers_poss.training.features import FeatureDataset, load_feature_folders, manifest_feature_layers
from transformers_poss.training.pipeline import load_target_and_tokenizer


def validate(val_folder: str, drafter_folder: str, target) -> dict:
    dataset, (manifest,) = load_feature_folders([val_folder])
    drafter = PosSDrafter.from_pretrained(drafter_folder, dtype=torch.float32)
    stored, wanted = manifest_feature_layers(manifest), list(drafter.config.input_feature_layers)
    blocks = None if wanted == stored else [stored.index(i) for i in wanted]
    val = FeatureDataset(dataset, list(range(manifest["examples"])), blocks=blocks,
                         hidden_size=manifest["hidden_size"])
    drafter.bind_target(target)
    with tempfile.TemporaryDirectory() as scratch:
        args = TrainingArguments(output_dir=scratch, target="bound", features=val_folder, depth=6,
                                 num_specialists=drafter.config.num_specialists,
                                 positions_per_specialist=drafter.config.positions_per_specialist,
                                 mixed_precision="bf16", progress=False, batch_size=4)
        trainer = PosSTrainer(args, drafter, val, val, data_record={})
        return {**trainer.evaluate(), "step": (drafter.training_record or {}).get("steps")}  # steps of the run it was saved from


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("val_features")
    parser.add_argument("drafters", nargs="+", help="NAME=FOLDER")
    parser.add_argument("--target", default="default")
    parser.add_argument("--output")
    args = parser.parse_args()
    target, _ = load_target_and_tokenizer(args.target, None, "bfloat16", "cpu")
    results = {}
    for item in args.drafters:
        name, folder = item.split("=", 1)
        result = validate(args.val_features, folder, target)
        results[name] = result
        print(f"{name}: top-1 {' '.join(f'{a:.3f}' for a in result['position_accuracy'])} | top-10 "
              f"{' '.join(f'{a:.3f}' for a in result['position_top_k_accuracy'])} "
              f"({result['positions'][0]} positions)", flush=True)
    if args.output:
        with open(args.output, "w") as handle:
            json.dump(results, handle, indent=1)


if __name__ == "__main__":
    main()
