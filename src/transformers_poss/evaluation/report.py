"""Benchmark summaries: per (dataset, method) figures, the markdown table, the JSON file and the PNG plots."""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
from pathlib import Path

import torch

from ..extras import require
from .methods import BASELINE
from .runner import BenchmarkRun, TurnRecord

ALL = "all"  # dataset label of the rows pooled over every dataset


def _load_acceptance_metric():
    from . import ACCEPTANCE_METRIC_PATH

    return require("evaluate", "bench", "the acceptance metric").load(str(ACCEPTANCE_METRIC_PATH))


def _median(values):
    values = [v for v in values if v is not None and not math.isnan(v)]
    return statistics.median(values) if values else math.nan


def summarize(run: BenchmarkRun, metric=None) -> list[dict]:
    """One row per (dataset, method), plus rows pooled over all datasets (`dataset == "all"`) when there are several.

    Row fields: dataset, method, kind, mode, turns, new_tokens, seconds, tokens_per_s (total new tokens / total
    seconds), tokens_per_s_median (over turns), speedup (tokens_per_s / the baseline's), speedup_median (median over
    turns of the per-turn ratio to the baseline), mean_acceptance_length (tau; None for the baseline), tau_source
    ("rounds": PosS per-round records; "target_forwards": tokens per target forward), position_acceptance
    (alpha_1..alpha_depth for PosS, else []), time_split (seconds, PosS), lookup_tokens (PosS: accepted draft
    tokens only the prompt-lookup branch proposed), draft_vocab_coverage (PosS with a draft vocabulary: the fraction
    of answer tokens inside it, which no draft can get beyond), peak_memory_mb, identical / compared /
    mismatches (greedy only), consistent / consistency_checked / max_gap.
    This is the `results` shape `transformers_poss.hub.load_benchmark` reads for model cards.
    """
    metric = metric if metric is not None else _load_acceptance_metric()
    datasets = list(dict.fromkeys(r.dataset for r in run.records))
    groups = [(d, [r for r in run.records if r.dataset == d]) for d in datasets]
    if len(datasets) > 1:
        groups.append((ALL, list(run.records)))
    rows = []
    for dataset, records in groups:
        baseline = {(r.question_id, r.turn, r.dataset): r for r in records if r.method == BASELINE}
        baseline_rate = _rate([r for r in records if r.method == BASELINE])
        for method in run.methods:
            mine = [r for r in records if r.method == method.name]
            if mine:
                rows.append(_summarize_method(dataset, method, mine, baseline, baseline_rate, metric))
    return rows


def _rate(records: list[TurnRecord]) -> float:
    seconds = sum(r.seconds for r in records)
    return sum(r.new_tokens for r in records) / seconds if seconds > 0 else math.nan


def _summarize_method(dataset, method, records, baseline, baseline_rate, metric) -> dict:
    rate = _rate(records)
    ratios = []
    for r in records:
        ref = baseline.get((r.question_id, r.turn, r.dataset))
        if ref is not None and ref.tokens_per_s > 0:
            ratios.append(r.tokens_per_s / ref.tokens_per_s)
    row = {
        "dataset": dataset,
        "method": method.name,
        "kind": method.kind,
        "mode": method.mode,
        "turns": len(records),
        "new_tokens": sum(r.new_tokens for r in records),
        "seconds": sum(r.seconds for r in records),
        "tokens_per_s": rate,
        "tokens_per_s_median": _median([r.tokens_per_s for r in records]),
        "speedup": rate / baseline_rate if baseline_rate and not math.isnan(baseline_rate) else math.nan,
        "speedup_median": _median(ratios),
        "mean_acceptance_length": None,  # null for the baseline, which drafts nothing
        "tau_source": None,
        "position_acceptance": [],  # per-position figures exist for PosS methods only
        "time_split": None,
        "peak_memory_mb": max((r.peak_memory_bytes or 0 for r in records), default=0) / 2**20 or None,
    }
    if method.kind == "poss":
        lengths = [r.acceptance_lengths or [] for r in records]
        stats = metric.compute(acceptance_lengths=lengths, depth=method.depth)
        row["mean_acceptance_length"] = stats["mean_acceptance_length"]
        row["position_acceptance"] = stats["position_acceptance"]
        row["rounds"] = stats["rounds"]
        row["tau_source"] = "rounds"
        row["time_split"] = {key: sum((r.time_split or {}).get(key, 0.0) for r in records)
                             for key in ("draft", "verify", "bookkeeping")}
        row["lookup_tokens"] = sum(r.lookup_tokens or 0 for r in records)
        counted = [r for r in records if r.in_draft_vocab is not None]
        tokens = sum(r.new_tokens for r in counted)
        row["draft_vocab_coverage"] = sum(r.in_draft_vocab for r in counted) / tokens if tokens else None
    elif method.kind != "baseline":
        tokens = sum(r.new_tokens - 1 for r in records if r.target_forwards > 1)
        rounds = sum(r.target_forwards - 1 for r in records if r.target_forwards > 1)
        row["mean_acceptance_length"] = tokens / rounds if rounds else math.nan
        row["tau_source"] = "target_forwards"
    compared = [r for r in records if r.identical is not None]
    row["compared"] = len(compared)
    row["identical"] = sum(r.identical for r in compared)
    row["mismatches"] = [{"question_id": r.question_id, "turn": r.turn, "first_mismatch": r.first_mismatch}
                         for r in compared if not r.identical]
    checked = [r for r in records if r.consistent is not None]
    row["consistency_checked"] = len(checked)
    row["consistent"] = sum(r.consistent for r in checked)
    row["max_gap"] = max((r.max_gap for r in checked), default=None)
    return row


# ---- environment ---------------------------------------------------------------------------------------------------
def environment(target=None, dtype=None) -> dict:
    """Versions, threads, dtype and machine facts for the JSON file."""
    import transformers

    from .. import __version__
    from ..devices import cpu_has_native_bf16, device_kind

    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "transformers_poss": __version__,
        "threads": torch.get_num_threads(),
        "dtype": str(dtype if dtype is not None else getattr(target, "dtype", None)).replace("torch.", ""),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu": _cpu_name(),
        "cpu_native_bf16": cpu_has_native_bf16(),
        "cpu_count": os.cpu_count(),
        "memory_gb": _memory_gb(),
    }
    for name in ("evaluate", "datasets", "accelerate"):
        try:
            env[name] = __import__(name).__version__
        except ImportError:
            env[name] = None
    if target is not None:
        device = target.get_input_embeddings().weight.device
        env["device"] = str(device)
        env["device_kind"] = device_kind(device, dtype if dtype is not None else target.dtype)
        env["target"] = getattr(target.config, "_name_or_path", None)
        if device.type == "cuda":
            env["gpu"] = torch.cuda.get_device_name(device)
    return env


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _memory_gb() -> float | None:
    try:
        with open("/proc/meminfo") as handle:
            return round(int(handle.readline().split()[1]) / 2**20, 1)
    except (OSError, ValueError, IndexError):
        return None


# ---- outputs -------------------------------------------------------------------------------------------------------
def _clean(value):
    """JSON-safe: NaN/inf -> None, recursively."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def write_json(path, run: BenchmarkRun, rows: list[dict], env: dict) -> Path:
    """Everything: `results` (one row per dataset and method, the shape the model card reads), `environment`,
    `settings`, `methods` and `prompts` (every per-turn figure)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "results": rows,
        "environment": env,
        "settings": run.settings,
        "methods": [m.describe() for m in run.methods],
        "prompts": run.to_dicts(),
    }
    path.write_text(json.dumps(_clean(payload), indent=1, default=str) + "\n")
    return path


def _fmt(value, spec=".2f", missing="-"):
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return missing
    return format(value, spec)


def markdown_table(rows: list[dict]) -> str:
    """The summary as a markdown table (losslessness columns show counts, never hide mismatches)."""
    header = ("| dataset | method | tok/s total | tok/s median | speedup | speedup median | tau | alpha_1..alpha_d "
              "| in draft vocab | draft / verify s | peak MB | identical | consistent |")
    lines = [header, "|" + "|".join(["---"] * (header.count("|") - 1)) + "|"]
    for row in rows:
        alphas = row.get("position_acceptance")
        alpha_text = " ".join(_fmt(a) for a in alphas) if alphas else "-"
        split = row.get("time_split")
        split_text = f"{split['draft']:.1f} / {split['verify']:.1f}" if split else "-"
        identical = f"{row['identical']}/{row['compared']}" if row["compared"] else "-"
        consistent = f"{row['consistent']}/{row['consistency_checked']}" if row["consistency_checked"] else "-"
        tau = _fmt(row["mean_acceptance_length"])
        if row.get("tau_source") == "target_forwards":
            tau += "*"
        lines.append(
            f"| {row['dataset']} | {row['method']} | {_fmt(row['tokens_per_s'], '.1f')} | "
            f"{_fmt(row['tokens_per_s_median'], '.1f')} | {_fmt(row['speedup'])}x | {_fmt(row['speedup_median'])}x | "
            f"{tau} | {alpha_text} | {_fmt(row.get('draft_vocab_coverage'), '.3f')} | {split_text} | "
            f"{_fmt(row['peak_memory_mb'], '.0f')} | {identical} | {consistent} |"
        )
    notes = ["", "tau* = tokens per target forward (from counting forwards; no per-round record for that method).",
             "in draft vocab = share of the answer tokens inside the drafter's reduced draft vocabulary (no draft can "
             "propose the others).",
             "identical = greedy answers equal to the baseline's token for token; consistent = every generated token "
             "plain greedy generate's own choice at its prefix, or within the dtype tolerance of it."]
    mismatched = [row for row in rows if row.get("mismatches") and row["dataset"] != ALL]
    for row in mismatched:
        where = ", ".join(f"{m['question_id']}/turn {m['turn']} @ token {m['first_mismatch']}"
                          for m in row["mismatches"])
        notes.append(f"MISMATCH {row['dataset']} {row['method']}: {where}")
    return "\n".join(lines + notes)


def write_plots(folder, rows: list[dict]) -> list[Path]:
    """`acceptance.png` (alpha_p per position, one line per PosS method) and `speedup.png` (bars per method and
    dataset); returns the files written (none when there is nothing to plot)."""
    from ..plotting import pyplot

    plt = pyplot()
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    datasets = list(dict.fromkeys(r["dataset"] for r in rows if r["dataset"] != ALL))
    pooled = ALL if any(r["dataset"] == ALL for r in rows) else (datasets[0] if datasets else None)
    written = []

    curves = [r for r in rows if r["dataset"] == pooled and r.get("position_acceptance")]
    if curves:
        fig, ax = plt.subplots(figsize=(6, 4))
        for row in curves:
            alphas = [math.nan if a is None else a for a in row["position_acceptance"]]
            ax.plot(range(1, len(alphas) + 1), alphas, marker="o", label=row["method"])
        depth = max(len(r["position_acceptance"]) for r in curves)
        ax.set_xticks(range(1, depth + 1))
        ax.set_xlim(0.5, depth + 0.5)
        ax.set_xlabel("draft position p")
        ax.set_ylabel("acceptance alpha_p")
        ax.set_ylim(0, 1.05)
        ax.set_title(f"Per-position acceptance ({pooled})")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        path = folder / "acceptance.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)

    methods = list(dict.fromkeys(r["method"] for r in rows if r["method"] != BASELINE))
    if methods and datasets:
        fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(datasets) * max(1, len(methods)) / 2), 4))
        width = 0.8 / len(methods)
        for i, method in enumerate(methods):
            values = []
            for dataset in datasets:
                row = next((r for r in rows if r["dataset"] == dataset and r["method"] == method), None)
                values.append(row["speedup"] if row and row["speedup"] is not None else math.nan)
            ax.bar([d + (i - (len(methods) - 1) / 2) * width for d in range(len(datasets))], values, width,
                   label=method)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(datasets)), datasets)
        ax.set_ylabel("speedup vs target.generate")
        ax.set_title("Speedup per dataset")
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = folder / "speedup.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    return written
