"""Benchmarking PosS drafters against plain `generate`, prompt lookup and assisted generation (`poss bench`).

- `prompts`: prompt sets (Spec-Bench jsonl files, Hub datasets, registry packages) and chat formatting;
- `methods`: the decoding methods run side by side;
- `runner`: the interleaved benchmark loop with per-turn figures;
- `losslessness`: token identity and bf16 greedy consistency;
- `report`: summaries, markdown, JSON and plots;
- `acceptance_metric/`: the `evaluate` metric for tau and per-position acceptance (`ACCEPTANCE_METRIC_PATH`).
"""

from pathlib import Path

from .losslessness import compare_tokens, default_tolerance, greedy_consistency
from .methods import BASELINE, Method, assistant_method, baseline_method, poss_methods, prompt_lookup_method
from .prompts import REGISTRY_SETS, Question, chat_prompt, load_prompt_file, load_prompt_sets, read_registry_set
from .report import environment, markdown_table, summarize, write_json, write_plots
from .runner import BenchmarkRun, TurnRecord, run_benchmark

# Folder of the `evaluate` metric script: `evaluate.load(str(ACCEPTANCE_METRIC_PATH))`.
ACCEPTANCE_METRIC_PATH = Path(__file__).resolve().parent / "acceptance_metric"

__all__ = [
    "ACCEPTANCE_METRIC_PATH", "BASELINE", "BenchmarkRun", "Method", "Question", "REGISTRY_SETS", "TurnRecord",
    "assistant_method", "baseline_method", "chat_prompt", "compare_tokens", "default_tolerance", "environment",
    "greedy_consistency", "load_prompt_file", "load_prompt_sets", "markdown_table", "poss_methods",
    "prompt_lookup_method", "read_registry_set", "run_benchmark", "summarize", "write_json", "write_plots",
]
