"""From arguments to a trained drafter: load the target and data, build or warm-start the drafter, train."""

from __future__ import annotations

import torch

from ..modeling_poss import PosSDrafter
from .data import (
    ExampleDataset, build_examples, count_token_frequencies, draft_vocab_coverage, load_records, top_token_ids,
)
from .features import FeatureDataset, load_feature_folders, manifest_feature_layers
from .trainer import PosSTrainer, TrainingArguments, has_checkpoint, split_indices, warm_start


def load_target(name_or_path: str, gguf_file: str | None = None, dtype: str = "bfloat16", device=None):
    """A frozen causal LM in eval mode (`AutoModelForCausalLM`, GGUF allowed)."""
    from transformers import AutoModelForCausalLM

    kwargs = {"dtype": getattr(torch, dtype)}
    if gguf_file:
        kwargs["gguf_file"] = gguf_file
    model = AutoModelForCausalLM.from_pretrained(name_or_path, **kwargs)
    if device is not None:
        model.to(device)
    return model.eval().requires_grad_(False)


def load_tokenizer(name_or_path: str, gguf_file: str | None = None):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name_or_path, **({"gguf_file": gguf_file} if gguf_file else {}))


def prepare_datasets(args: TrainingArguments, tokenizer=None) -> tuple[object, object, dict, object]:
    """(train dataset, validation dataset, data record, token source for vocabulary counts)."""
    if args.features:
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
        train = FeatureDataset(dataset, train_idx, blocks=blocks, hidden_size=hidden)
        val = FeatureDataset(dataset, val_idx, blocks=blocks, hidden_size=hidden)
        parts = [{"source": m.get("metadata", {}).get("data", folder), "features": folder, "tokens": m.get("tokens"),
                  **{k: v for k, v in m.get("metadata", {}).items() if k != "data"}}
                 for folder, m in zip(folders, manifests)]
        args.feature_layers = ",".join(str(i) for i in layers)
        record = {"examples": n, "train_examples": len(train_idx), "val_examples": len(val_idx),
                  "feature_layers": layers}
        if val_folders:
            record["val_features"] = [{"features": folder, "examples": m["examples"], "tokens": m.get("tokens"),
                                       "source": m.get("metadata", {}).get("data", folder)}
                                      for folder, m in zip(val_folders, manifests[len(folders):])]
        if len(parts) == 1:
            record.update(parts[0])
        else:
            record.update(features=folders, tokens=sum(part["tokens"] or 0 for part in parts), parts=parts)
        return train, val, record, train.token_examples
    if tokenizer is None:
        tokenizer = load_tokenizer(args.tokenizer or args.target, None if args.tokenizer else args.target_gguf_file)
    records = load_records(args.data, split=args.data_split, limit=args.limit)
    examples, stats = build_examples(tokenizer, records, args.max_length, progress=args.progress)
    if not examples:
        raise ValueError(f"no usable conversations in {args.data} ({stats})")
    train_idx, val_idx = split_indices(len(examples), args.val_fraction, args.val_max_examples, args.seed)
    train = ExampleDataset([examples[i] for i in train_idx])
    val = ExampleDataset([examples[i] for i in val_idx])
    record = {"source": args.data, "split": args.data_split, "max_length": args.max_length, **stats,
              "train_examples": len(train_idx), "val_examples": len(val_idx)}
    return train, val, record, lambda: iter(train.examples)


def build_drafter(args: TrainingArguments, target, token_examples=None) -> tuple[PosSDrafter, dict]:
    """A new drafter for `target` (seeded), warm-started from `args.init_from`, with its draft vocabulary chosen
    from token counts of the training data when `args.draft_vocab_size` is set. Returns (drafter, record)."""
    torch.manual_seed(args.seed)
    drafter = PosSDrafter.from_target(
        target, num_specialists=args.num_specialists, positions_per_specialist=args.positions_per_specialist,
        draft_vocab_size=args.draft_vocab_size, draft_head_rows=args.draft_head_rows, fc_bias=args.fc_bias,
        feature_layers=args.feature_layer_list(),
        specialist_intermediate_size=args.specialist_intermediate_size, tree_depth=args.tree_depth,
        tree_top_k=args.tree_top_k, tree_total_tokens=args.tree_total_tokens,
        target_name_or_path=args.target,
    )
    record = {}
    copied_vocab = False
    counts = None
    if args.draft_vocab_size is not None and token_examples is not None:
        counts = count_token_frequencies(token_examples(), drafter.config.vocab_size)
    if args.init_from:
        record["init_from"] = warm_start(drafter, args.init_from, token_counts=counts)
        copied_vocab = record["init_from"]["draft_vocab_copied"]
    if counts is not None:
        if not copied_vocab:
            drafter.init_draft_vocab(top_token_ids(counts, args.draft_vocab_size))
        grown_from = record.get("init_from", {}).get("draft_vocab_grown_from")
        source = ("init_from's, grown by the most frequent assistant tokens of the training split" if grown_from
                  else "init_from" if copied_vocab else "most frequent assistant tokens of the training split")
        record["draft_vocab"] = {"size": args.draft_vocab_size, "own_head_rows": drafter.config.own_draft_head_rows,
                                 "from": source,
                                 "coverage": draft_vocab_coverage(counts, drafter.draft_to_target.cpu())}
    return drafter, record


def run_training(args: TrainingArguments, target=None, tokenizer=None) -> tuple[PosSDrafter, dict]:
    """The whole recipe: returns the trained drafter (saved in `args.output_dir`) and its training record."""
    from accelerate import Accelerator

    args.check()
    accelerator = Accelerator(mixed_precision=args.mixed_precision, gradient_accumulation_steps=args.grad_accum)
    if target is None:
        target = load_target(args.target, args.target_gguf_file, args.target_dtype)
    train, val, data_record, token_examples = prepare_datasets(args, tokenizer)
    drafter, extra = build_drafter(args, target, token_examples)
    trainer = PosSTrainer(args, drafter, train, val, data_record=data_record, accelerator=accelerator,
                          extra_record=extra)
    if args.resume == "auto" and not has_checkpoint(args.output_dir):
        pass  # a fresh start; the same command resumes later
    elif args.resume:
        resumed = trainer.resume("latest" if args.resume == "auto" else args.resume)
        if accelerator.is_main_process:
            print(f"resumed from {resumed} at step {trainer.state['global_step']}", flush=True)
    record = trainer.train()
    return trainer.drafter, record
