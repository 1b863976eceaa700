"""`poss train`, `poss features`, `poss distill` and `poss plot-training`."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import types
import typing
from pathlib import Path

from ..assets import DTYPES
from .arguments import TrainingArguments


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_training_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """One flag per `TrainingArguments` field (`--output-dir`, `--num-specialists`, ...)."""
    hints = typing.get_type_hints(TrainingArguments)
    for spec in dataclasses.fields(TrainingArguments):
        kind = hints[spec.name]
        options = {"help": spec.metadata.get("help", "")}
        if isinstance(kind, types.UnionType):  # X | None
            kind = next(k for k in typing.get_args(kind) if k is not type(None))
        if spec.default is dataclasses.MISSING:
            options["required"] = True
        else:
            options["default"] = spec.default
            if not spec.metadata.get("recipe"):  # a recipe field's help names each recipe's default
                options["help"] += f" (default: {spec.default})"
        if kind is bool:
            options["action"] = argparse.BooleanOptionalAction
        else:
            options["type"] = kind
        parser.add_argument(_flag(spec.name), dest=spec.name, **options)
    return parser


def arguments_from_namespace(namespace: argparse.Namespace) -> TrainingArguments:
    names = {spec.name for spec in dataclasses.fields(TrainingArguments)}
    return TrainingArguments(**{k: v for k, v in vars(namespace).items() if k in names})


def build_train_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(
        description="Train a PosS drafter (works under `accelerate launch`).")
    return add_training_arguments(parser)


def run_train(namespace: argparse.Namespace) -> int:
    from .pipeline import run_training

    from accelerate import PartialState

    args = arguments_from_namespace(namespace)
    record = run_training(args).training_record
    if PartialState().is_main_process:
        print(json.dumps({"output_dir": args.output_dir, "steps": record["steps"], "tokens": record["tokens"],
                          "validation_position_accuracy": record["validation_position_accuracy"]}, indent=2))
    return 0


def _records(namespace: argparse.Namespace, command: str) -> list:
    """The conversation records named by `--data` / `--data-split` / `--limit`; a source that cannot be read exits
    with its error (before any model is loaded)."""
    from .data import load_records

    try:
        return load_records(namespace.data, split=namespace.data_split, limit=namespace.limit)
    except (OSError, ValueError) as error:
        raise SystemExit(f"poss {command}: error: {error}") from None


def _target_tokenizer_records(namespace: argparse.Namespace, command: str):
    """The frozen target, its tokenizer and the conversations named by `poss features` / `poss distill` options
    (the conversations are read first: a bad `--data` fails before the target loads)."""
    from .pipeline import load_target_and_tokenizer

    records = _records(namespace, command)
    target, tokenizer = load_target_and_tokenizer(namespace.target, namespace.tokenizer, namespace.target_dtype,
                                                  namespace.device)
    return target, tokenizer, records


def run_features(namespace: argparse.Namespace) -> int:
    from .data import build_examples
    from .features import extract_features, parse_feature_layers

    try:
        layers = parse_feature_layers(namespace.feature_layers)
    except ValueError as error:
        raise SystemExit(f"poss features: error: {error}") from None
    target, tokenizer, records = _target_tokenizer_records(namespace, "features")
    examples, stats = build_examples(tokenizer, records, namespace.max_length, progress=True)
    metadata = {"data": namespace.data, "split": namespace.data_split, "limit": namespace.limit,
                "max_length": namespace.max_length, "target_dtype": namespace.target_dtype, **stats}
    manifest = extract_features(target, examples, namespace.output, batch_size=namespace.batch_size,
                                shard_size=namespace.shard_size, metadata=metadata, feature_layers=layers)
    print(json.dumps({k: manifest[k] for k in ("examples", "tokens", "bytes", "bytes_per_token", "shards")},
                     indent=2))
    return 0


def run_distill(namespace: argparse.Namespace) -> int:
    from .distill import NoUsableRecordsError, check_records, no_usable_records_message, self_distill

    records = _records(namespace, "distill")
    usable, skipped = check_records(records)
    if not usable:  # refuse unusable data before loading any model
        raise SystemExit(f"poss distill: error: {namespace.data}: {no_usable_records_message(len(records), skipped)}")
    drafter = None
    if namespace.drafter:
        from ..assets import DEFAULT_DRAFTERS, default_drafter_path
        from ..modeling_poss import PosSDrafter

        shipped = {"default": "poss2", **{name: name for name in DEFAULT_DRAFTERS}}
        folder = default_drafter_path(shipped[namespace.drafter]) if namespace.drafter in shipped else namespace.drafter
        drafter = PosSDrafter.from_pretrained(folder).with_generation_config(draft_mode="tree")  # before the target
    from .pipeline import load_target_and_tokenizer

    target, tokenizer = load_target_and_tokenizer(namespace.target, namespace.tokenizer, namespace.target_dtype,
                                                  namespace.device)
    try:
        stats = self_distill(target, tokenizer, records, namespace.output, batch_size=namespace.batch_size,
                             max_new_tokens=namespace.max_new_tokens, max_prompt_length=namespace.max_prompt_length,
                             do_sample=namespace.temperature > 0, temperature=namespace.temperature or 1.0,
                             max_turns=namespace.max_turns, drafter=drafter)
    except NoUsableRecordsError as error:  # every usable record's prompt is longer than --max-prompt-length
        raise SystemExit(f"poss distill: error: {namespace.data}: {error}") from None
    print(json.dumps(stats, indent=2))
    return 0


def parse_run_specs(specs: list[str]) -> dict[str, str]:
    """`LABEL=FOLDER` / `FOLDER` -> {label: folder} (a folder's label is its name)."""
    runs = {}
    for spec in specs:
        label, sep, folder = spec.partition("=")
        if not sep or Path(spec).expanduser().exists():
            label, folder = Path(spec).name, spec
        if not label or not folder:
            raise ValueError(f"{spec!r}: expected LABEL=FOLDER or FOLDER")
        if label in runs:
            raise ValueError(f"run labels must be unique; {label!r} is given twice (use LABEL=FOLDER)")
        runs[label] = folder
    return runs


def run_plot_training(namespace: argparse.Namespace) -> int:
    from ..plotting import require_matplotlib
    from .plots import plot_training
    from .trainer import TRAIN_LOG_NAME

    try:
        require_matplotlib("poss plot-training")
        runs = parse_run_specs(namespace.runs)
        output = namespace.output or Path(next(iter(runs.values()))) / "training_curves.png"
        if Path(output).suffix.lower() != ".png":
            raise ValueError(f"--output {output}: expected a .png file")
        path = plot_training(runs, output)
    except (ImportError, ValueError, FileNotFoundError) as error:
        print(f"poss plot-training: error: {error}", file=sys.stderr)
        return 2
    print(f"wrote {path} ({len(runs)} run(s), from their {TRAIN_LOG_NAME})")
    return 0


def _target_and_data(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", required=True,
                        help="the target: a model folder, a .gguf file, or 'default' (SmolLM2-135M-Instruct)")
    parser.add_argument("--tokenizer", default=None, help="tokenizer (default: the target's)")
    parser.add_argument("--target-dtype", default="bfloat16", choices=list(DTYPES),
                        help="target dtype (default: bfloat16)")
    parser.add_argument("--device", default=None, help="device of the target (default: cpu)")
    parser.add_argument("--data", required=True, help="conversations: .json/.jsonl, save_to_disk folder, datasets id")
    parser.add_argument("--data-split", default="train")
    parser.add_argument("--limit", type=int, default=None, help="at most this many conversations")
    parser.add_argument("--output", required=True)
    parser.add_argument("--batch-size", type=int, default=8)


def add_subcommand(subparsers) -> None:
    train = subparsers.add_parser(
        "train", help="train a PosS drafter (online or offline target features; resumable)",
        description="Train a PosS drafter with the unrolled training-time-test objective. Multi-GPU: "
                    "`accelerate launch -m transformers_poss.cli train ...` or examples/train_poss.py.")
    build_train_parser(train)
    train.set_defaults(func=run_train)

    features = subparsers.add_parser(
        "features", help="extract target features to disk once (memory-mapped datasets, resumable)")
    _target_and_data(features)
    features.add_argument("--max-length", type=int, default=2048)
    features.add_argument("--shard-size", type=int, default=256, help="examples per shard (resume granularity)")
    features.add_argument("--feature-layers", default="-1",
                          help="target hidden states to store, comma separated output_hidden_states indices ending "
                               "in -1 (e.g. 3,16,-1 for a fused drafter; default: -1, the final one)")
    features.set_defaults(func=run_features)

    distill = subparsers.add_parser(
        "distill", help="answer conversations with the target itself (self-distillation, resumable jsonl)",
        description="Self-distillation: the target answers each conversation of --data. Its assistant turns are "
                    "regenerated and the user turns after the last one answered in order, so a prompts file "
                    '([{"conversations": [{"from": "human", "value": "..."}]}, ...]; or OpenAI-style "messages") '
                    "gets answered. Records with nothing to answer are counted by reason; when none is usable the "
                    "command fails before loading the target.")
    _target_and_data(distill)
    distill.add_argument("--max-new-tokens", type=int, default=512)
    distill.add_argument("--max-prompt-length", type=int, default=2048)
    distill.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    distill.add_argument("--max-turns", type=int, default=None,
                         help="keep only the first N exchanges (answers) of each conversation and drop the rest "
                              "(turns past the training --max-length are wasted work; default: all)")
    distill.add_argument("--drafter", default=None,
                         help="a PosS drafter folder ('default', 'poss2', 'single': the shipped ones) that "
                              "generates every batch speculatively (tree mode; the same answers)")
    distill.set_defaults(func=run_distill)

    plot = subparsers.add_parser(
        "plot-training", help="plot training curves (loss, per-position accuracy, validation) as a PNG",
        description="Plot the train_log.jsonl of one or more `poss train` runs: training loss and accuracy by step, "
                    "validation accuracy by draft position.")
    plot.add_argument("runs", nargs="+", metavar="[LABEL=]FOLDER", help="`poss train` output folders")
    plot.add_argument("--output", default=None, help="PNG file (default: FOLDER/training_curves.png of the first run)")
    plot.set_defaults(func=run_plot_training)
