"""From arguments to a trained drafter: load the target, prepare the data, initialise the drafter, train, write the
model card (`run_training`, what `poss train` and `examples/train_poss.py` run)."""

from __future__ import annotations

from dataclasses import dataclass

from ..assets import load_target, resolve_dtype
from ..hub import write_card
from ..modeling_poss import PosSDrafter
from ..placement import parse_placement, resident_embeddings
from .arguments import TrainingArguments
from .data import ExampleDataset, build_examples, load_records, split_indices
from .features import FeatureDataset, load_feature_folders, manifest_feature_layers
from .initialization import build_drafter
from .trainer import PosSTrainer, build_accelerator


def run_training(args: TrainingArguments) -> PosSDrafter:
    """Train a drafter as `args` say (resuming when `args.resume` asks) and save it in `args.output_dir`, with a
    model card once training has finished. Returns the trained drafter; its record is `drafter.training_record`."""
    args.check()
    device_map, max_memory = parse_placement(args.target_device_map, args.target_max_memory)
    accelerator = build_accelerator(args)  # refuses a launch whose processes do not form one group
    if device_map == "auto" and accelerator.num_processes > 1:
        raise ValueError(
            f"--target-device-map auto spreads the target over every device, once per process "
            f"({accelerator.num_processes} here): train on a split target in one process, or extract features first "
            "(`poss features --target-device-map auto`) and train on them with --target-device-map "
            """'{"": "disk"}' (each process then holds only the target's embedding and lm_head)""")
    target, tokenizer = load_target_and_tokenizer(args.target, args.tokenizer, args.target_dtype,
                                                  str(accelerator.device), device_map, max_memory)
    if device_map is not None:  # the drafter reads their weights
        resident_embeddings(target, accelerator.device)
    data = prepare_datasets(args, tokenizer)
    drafter, init_record = build_drafter(args, target, data.feature_layers, data.train.token_examples())
    trainer = PosSTrainer(args, drafter.bind(target, move=False), data.train, data.validation, data_record=data.record,
                          accelerator=accelerator, init_record=init_record)
    if args.resume:
        resumed = trainer.resume(args.resume)
        if resumed and accelerator.is_main_process:
            print(f"resumed from {resumed} at step {trainer.state['global_step']}", flush=True)
    trainer.train()
    if trainer.state["finished"] and accelerator.is_main_process:
        write_card(trainer.drafter, args.output_dir, overwrite=True)
    return trainer.drafter


def load_target_and_tokenizer(target: str, tokenizer: str | None, dtype: str, device: str | None = None,
                              device_map: str | dict | None = None, max_memory: dict | None = None):
    """(frozen target, tokenizer): the target as `transformers_poss.assets.load_target` loads it (a folder, a
    `.gguf` file or `"default"`, in `dtype`, a `DTYPES` name) and the tokenizer `tokenizer` (default: the target's).
    With `device_map` (`placement.parse_placement`'s) the target is split across devices and `device` only decides
    what `dtype="auto"` means."""
    from transformers import AutoTokenizer

    model, own_tokenizer = load_target(target, resolve_dtype(dtype, device),
                                       device if device_map is None else None, device_map, max_memory)
    return model, (AutoTokenizer.from_pretrained(tokenizer) if tokenizer else own_tokenizer)


@dataclass
class TrainingData:
    """The datasets of a run: train and validation items (`ExampleDataset` or `FeatureDataset`), the target hidden
    states their features are (None: the final one), and where they came from (`training_record["data"]`)."""

    train: ExampleDataset | FeatureDataset
    validation: ExampleDataset | FeatureDataset
    feature_layers: list[int] | None
    record: dict


def prepare_datasets(args: TrainingArguments, tokenizer=None) -> TrainingData:
    """Offline features of `args.features` (validation: the folders of `args.val_features`, or a seeded split), or
    the conversations of `args.data` tokenized with `tokenizer` for online features (validation: a seeded split)."""
    if args.features:
        return _feature_datasets(args)
    records = load_records(args.data, split=args.data_split, limit=args.limit)
    examples, stats = build_examples(tokenizer, records, args.max_length, progress=args.progress)
    if not examples:
        raise ValueError(f"no usable conversations in {args.data} ({stats})")
    train_idx, val_idx = split_indices(len(examples), args.val_fraction, args.val_max_examples, args.seed)
    record = {"source": args.data, "split": args.data_split, "max_length": args.max_length, **stats,
              "train_examples": len(train_idx), "val_examples": len(val_idx)}
    return TrainingData(train=ExampleDataset([examples[i] for i in train_idx]),
                        validation=ExampleDataset([examples[i] for i in val_idx]),
                        feature_layers=args.feature_layer_list(), record=record)


def _feature_datasets(args: TrainingArguments) -> TrainingData:
    folders, val_folders = args.feature_folders(), args.val_feature_folders()
    # one load checks that training and validation folders hold features of the same target
    dataset, manifests = load_feature_folders(folders + val_folders)
    n_train_rows = sum(m["examples"] for m in manifests[:len(folders)])
    n = n_train_rows if args.limit is None else min(args.limit, n_train_rows)
    if val_folders:
        train_idx, val_idx = list(range(n)), list(range(n_train_rows, len(dataset)))
    else:
        train_idx, val_idx = split_indices(n, args.val_fraction, args.val_max_examples, args.seed)
    stored, wanted = manifest_feature_layers(manifests[0]), args.feature_layer_list()
    layers = stored if wanted is None else wanted
    if any(i not in stored for i in layers):
        raise ValueError(f"--feature-layers {wanted} are not all in the feature folders, which hold the target "
                         f"layers {stored}: extract features with `poss features --feature-layers ...` to match")
    blocks = None if layers == stored else [stored.index(i) for i in layers]
    hidden = manifests[0]["hidden_size"]
    parts = [{"source": m.get("metadata", {}).get("data", folder), "features": folder, "tokens": m.get("tokens"),
              **{k: v for k, v in m.get("metadata", {}).items() if k != "data"}}
             for folder, m in zip(folders, manifests)]
    record = {"examples": n, "train_examples": len(train_idx), "val_examples": len(val_idx), "feature_layers": layers}
    if val_folders:
        record["val_features"] = [{"features": folder, "examples": m["examples"], "tokens": m.get("tokens"),
                                   "source": m.get("metadata", {}).get("data", folder)}
                                  for folder, m in zip(val_folders, manifests[len(folders):])]
    if len(parts) == 1:
        record.update(parts[0])
    else:
        record.update(features=folders, tokens=sum(part["tokens"] or 0 for part in parts), parts=parts)
    return TrainingData(train=FeatureDataset(dataset, train_idx, blocks=blocks, hidden_size=hidden),
                        validation=FeatureDataset(dataset, val_idx, blocks=blocks, hidden_size=hidden),
                        feature_layers=layers, record=record)
