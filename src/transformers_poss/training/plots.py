"""Training curves from `train_log.jsonl` (`poss plot-training`): loss, per-position accuracy, validation."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from .trainer import TRAIN_LOG_NAME


def read_training_log(path: str | Path) -> tuple[list[dict], list[dict]]:
    """(train events, validation events) of a `poss train` output folder or its `train_log.jsonl`, each sorted by
    step. A resumed run logs the steps after its checkpoint again; the last record of a step wins."""
    path = Path(path).expanduser()
    if path.is_dir():
        path = path / TRAIN_LOG_NAME
    if not path.is_file():
        raise FileNotFoundError(
            f"{path}: no such file (expected the {TRAIN_LOG_NAME} of a `poss train` output folder)")
    events: dict[str, dict[int, dict]] = {"train": {}, "validation": {}}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            kind, step = record["event"], int(record["step"])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as error:
            raise ValueError(f"{path}:{number}: not a training log record ({error})") from None
        if kind in events:
            events[kind][step] = record
    if not events["train"] and not events["validation"]:
        raise ValueError(f"{path}: no training steps logged yet")
    train, validation = ([by_step[step] for step in sorted(by_step)] for by_step in events.values())
    return train, validation


def plot_training(runs: Mapping[str, str | Path], output: str | Path) -> Path:
    """One PNG with four panels for the runs `{label: folder}`: training loss by step, training accuracy at the
    first and last draft position by step, validation top-1 accuracy by draft position, and how often the target's
    token is among the drafter's top k there (the last validation bold, earlier ones faint; logs written before
    that metric existed leave the last panel empty). Every log is read before anything is drawn."""
    from ..plotting import pyplot

    logs = {label: read_training_log(folder) for label, folder in runs.items()}
    plt = pyplot()
    fig, (loss_ax, train_ax, val_ax, top_k_ax) = plt.subplots(1, 4, figsize=(20, 4.2))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (label, (train, validation)) in enumerate(logs.items()):
        color = colors[i % len(colors)]
        steps = [r["step"] for r in train]
        loss_ax.plot(steps, [r["loss"] for r in train], color=color, label=label)
        if train:
            depth = len(train[-1]["position_accuracy"])
            for position, style in ((0, "-"), (depth - 1, "--")):
                train_ax.plot(steps, [r["position_accuracy"][position] for r in train], style, color=color,
                              label=f"{label}, position {position + 1}")
        for j, record in enumerate(validation):
            last = j == len(validation) - 1
            style = dict(marker="o", color=color, alpha=1.0 if last else 0.3, linewidth=2 if last else 1,
                         label=f"{label}, step {record['step']}" if last else None)
            accuracy = record["position_accuracy"]
            val_ax.plot(range(1, len(accuracy) + 1), accuracy, **style)
            if "position_top_k_accuracy" in record:
                top_k = record["position_top_k_accuracy"]
                style["label"] = f"{label}, top {record['top_k']}, step {record['step']}" if last else None
                top_k_ax.plot(range(1, len(top_k) + 1), top_k, **style)
    loss_ax.set(title="Training loss", xlabel="optimizer step", ylabel="loss")
    train_ax.set(title="Training accuracy (logging windows)", xlabel="optimizer step", ylabel="top-1 accuracy")
    val_ax.set(title="Validation accuracy by draft position", xlabel="draft position", ylabel="top-1 accuracy")
    top_k_ax.set(title="Validation: target token in the draft top k", xlabel="draft position", ylabel="share")
    for ax in (loss_ax, train_ax, val_ax, top_k_ax):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    if not any(validation for _, validation in logs.values()):
        val_ax.text(0.5, 0.5, "no validation logged", ha="center", va="center", transform=val_ax.transAxes)
    if not top_k_ax.lines:
        top_k_ax.text(0.5, 0.5, "no top-k validation logged", ha="center", va="center", transform=top_k_ax.transAxes)
    fig.tight_layout()
    output = Path(output).expanduser()
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=110)
    plt.close(fig)
    return output
