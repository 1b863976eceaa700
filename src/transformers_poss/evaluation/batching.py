"""`poss bench --batch-size`: throughput of plain batched `generate` and of PosS tree drafting on padded batches.

For each batch size `B`, the questions' first turns are cut into batches of `B` prompts, left-padded, and every batch
is generated greedily by each method in turn (the order rotates from batch to batch). Throughput is generated tokens
over the batch per second: a row's tokens up to and including its end-of-sequence token (the padding plain
`generate` and the drafter add after it does not count). Speedup is a method's throughput over plain batched
`generate`'s at the same batch size, in the same run.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

from .prompts import Question, chat_prompt


def generated_tokens(sequences: torch.LongTensor, prompt_width: int, eos_token_ids: list[int]) -> list[int]:
    """Tokens each row `[B, L]` generated after the padded prompt, up to and including its first end token."""
    counts = []
    for row in sequences[:, prompt_width:].tolist():
        ends = [i for i, token in enumerate(row) if token in eos_token_ids]
        counts.append(ends[0] + 1 if ends else len(row))
    return counts


def prompt_batches(tokenizer, questions: list[Question], batch_size: int, use_chat_template: bool = True) -> list:
    """The first turns of `questions` as left-padded batches of `batch_size` (`BatchEncoding`s; a last partial batch
    is left out so every batch has `batch_size` rows)."""
    texts = [chat_prompt(tokenizer, q.turns, [], use_chat_template) for q in questions]
    return [tokenizer(texts[i : i + batch_size], padding=True, padding_side="left", return_tensors="pt",
                      add_special_tokens=False)
            for i in range(0, len(texts) - batch_size + 1, batch_size)]


def run_batch_benchmark(target, tokenizer, questions: list[Question], drafters: dict, batch_sizes: list[int],
                        max_new_tokens: int = 128, warmup: int = 1, use_chat_template: bool = True,
                        progress=None) -> list[dict]:
    """Rows `{"batch_size", "method", "batches", "tokens", "seconds", "tokens_per_s", "speedup", "tau"}` for plain
    batched `generate` (`"baseline"`) and each drafter of `drafters` (`{name: drafter}`, drafted in tree mode).

    Raises `ValueError` before any work when a batch size is below 1 or larger than the number of questions.
    """
    if not batch_sizes or min(batch_sizes) < 1 or max(batch_sizes) > len(questions):
        raise ValueError(f"batch sizes must lie in [1, {len(questions)} questions], got {batch_sizes}")
    if tokenizer.pad_token_id is None:
        raise ValueError("the target's tokenizer has no pad token: batches need one")
    log = progress or (lambda message: None)
    device = target.get_input_embeddings().weight.device
    eos = target.generation_config.eos_token_id
    eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    methods = {"baseline": None, **{name: d.with_generation_config(draft_mode="tree") for name, d in drafters.items()}}

    def generate(batch, drafter):
        inputs = {k: v.to(device) for k, v in batch.items()}
        start = time.perf_counter()
        with torch.no_grad():
            out = target.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, assistant_model=drafter,
                                  pad_token_id=tokenizer.pad_token_id, return_dict_in_generate=True)
        seconds = time.perf_counter() - start
        stats = getattr(out, "speculative_stats", None)
        return sum(generated_tokens(out.sequences, inputs["input_ids"].shape[1], eos_ids)), seconds, stats

    rows = []
    for batch_size in batch_sizes:
        batches = prompt_batches(tokenizer, questions, batch_size, use_chat_template)
        for drafter in methods.values():
            for _ in range(warmup):
                generate(prompt_batches(tokenizer, questions[:batch_size], batch_size, use_chat_template)[0], drafter)
        totals = {name: {"tokens": 0, "seconds": 0.0, "lengths": []} for name in methods}
        names = list(methods)
        for index, batch in enumerate(batches):
            for name in names[index % len(names):] + names[: index % len(names)]:
                tokens, seconds, stats = generate(batch, methods[name])
                totals[name]["tokens"] += tokens
                totals[name]["seconds"] += seconds
                if stats is not None:
                    totals[name]["lengths"] += stats.acceptance_lengths
        base_rate = totals["baseline"]["tokens"] / totals["baseline"]["seconds"]
        for name, total in totals.items():
            rate = total["tokens"] / total["seconds"]
            rows.append({"batch_size": batch_size, "method": name, "batches": len(batches), "tokens": total["tokens"],
                         "seconds": total["seconds"], "tokens_per_s": rate, "speedup": rate / base_rate,
                         "tau": statistics.fmean(total["lengths"]) + 1 if total["lengths"] else None})
        log(f"batch {batch_size}: " + ", ".join(f"{r['method']} {r['tokens_per_s']:.1f} tok/s"
                                               for r in rows if r["batch_size"] == batch_size))
    return rows


def batch_table(rows: list[dict]) -> str:
    """Markdown: one line per batch size and method."""
    lines = ["| batch size | method | tokens/s | speedup | tau | tokens | seconds |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        tau = "-" if r["tau"] is None else f"{r['tau']:.2f}"
        lines.append(f"| {r['batch_size']} | {r['method']} | {r['tokens_per_s']:.1f} | {r['speedup']:.2f}x | {tau} | "
                     f"{r['tokens']} | {r['seconds']:.1f} |")
    return "\n".join(lines)


def write_batch_results(folder, rows: list[dict], environment: dict, plots: bool = True) -> list[Path]:
    """`batch.json`, `batch.md` and (with `plots`) `batch.png`: tokens/s and speedup against batch size."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    written = [folder / "batch.json", folder / "batch.md"]
    written[0].write_text(json.dumps({"rows": rows, "environment": environment}, indent=2) + "\n")
    written[1].write_text(batch_table(rows) + "\n")
    if plots:
        from ..plotting import pyplot

        plt = pyplot()
        fig, (rate_ax, speed_ax) = plt.subplots(1, 2, figsize=(10, 4))
        for method in dict.fromkeys(r["method"] for r in rows):
            mine = [r for r in rows if r["method"] == method]
            sizes = [r["batch_size"] for r in mine]
            rate_ax.plot(sizes, [r["tokens_per_s"] for r in mine], marker="o", label=method)
            speed_ax.plot(sizes, [r["speedup"] for r in mine], marker="o", label=method)
        for ax, label in ((rate_ax, "generated tokens/s over the batch"), (speed_ax, "speedup over plain batched")):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("batch size")
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
        rate_ax.legend()
        fig.tight_layout()
        written.append(folder / "batch.png")
        fig.savefig(written[-1], dpi=120)
        plt.close(fig)
    return written
