"""Benchmark vLLM (CPU) plain against vLLM with PosS drafters served by the poss_vllm plugin; prints a table.

Run with vLLM's python (`bash scripts/vllm_env.sh` builds `.venv-vllm`):

    .venv-vllm/bin/python benchmarks/scripts/vllm_bench.py --target $(poss fetch-target) \
        --prompts ../shared/data/specbench/mt_bench.jsonl --limit 8 --max-tokens 128 --dtype bfloat16 --k 3

Configurations (each in a fresh engine, a subprocess, which runs every `--concurrency` mode in turn): `plain` (no
speculation), `poss2` (the shipped PosS-2, every position with its own specialist, drafting at every batch size:
`num_speculative_tokens_per_batch_size` null), `poss2-schedule` (the same export with its batch-size schedule, which
the plugin applies: K draft tokens up to the drafter's tuned `max_batch_size` scheduled requests, none above),
`spec0` (its specialist 0 alone at every position, no schedule). Each conversation is an MT-Bench question's two
turns, the second asked after the configuration's own first answer. Modes: one request at a time (`--concurrency
1`: the conversations one after another) and N concurrent (`--concurrency 8`: the first turns of N conversations
together, then their second turns). Reported per configuration and mode: output tokens/s over the timed generation
(engine start and a warm-up request excluded), tau = 1 + accepted / drafts, and alpha_p = accepted at p / accepted at
p - 1 (drafts for p = 1), from vLLM's spec-decode counters over the mode's requests, and the engine's schedule.
The exports are written with the main environment's python (`--main-python`, default `$POSS_MAIN_PYTHON` or
`python3`) when `--exports` lacks them: `poss export --format vllm [--first-specialist]`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ("plain", "poss2", "poss2-schedule", "spec0")
EXPORT_OF = {"poss2": "poss2", "poss2-schedule": "poss2", "spec0": "spec0"}


def load_questions(path: str, limit: int) -> list[list[str]]:
    questions = []
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            if line.strip():
                questions.append(json.loads(line)["turns"])
    return questions[:limit]


def spec_counters(llm) -> dict:
    counters = {}
    for metric in llm.get_metrics():
        name = metric.name.removeprefix("vllm:")
        if name.startswith("spec_decode"):
            counters[name] = list(metric.values) if hasattr(metric, "values") else metric.value
    return counters


def counter_delta(after: dict, before: dict) -> dict:
    delta = {}
    for name, value in after.items():
        old = before.get(name, [0] * len(value) if isinstance(value, list) else 0)
        delta[name] = [a - b for a, b in zip(value, old)] if isinstance(value, list) else value - old
    return delta


def run_one(args) -> int:
    """Worker: one configuration in one engine, each concurrency in turn; writes one JSON result per concurrency."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from vllm import LLM, SamplingParams

    speculative = None
    if args.config != "plain":
        speculative = {"method": "eagle", "model": str(Path(args.exports) / EXPORT_OF[args.config]),
                       "num_speculative_tokens": args.k}
        if args.config != "poss2-schedule":
            speculative["num_speculative_tokens_per_batch_size"] = None  # draft at every batch size
    llm = LLM(model=args.target, dtype=args.dtype, enforce_eager=True, speculative_config=speculative,
              max_model_len=4096, seed=0, disable_log_stats=False)
    engine_speculative = getattr(getattr(llm.llm_engine, "vllm_config", None), "speculative_config", None)
    schedule = getattr(engine_speculative, "num_speculative_tokens_per_batch_size", None)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    questions = load_questions(args.prompts, args.limit)
    llm.chat([[{"role": "user", "content": "Say hello."}]], params, use_tqdm=False)  # warm-up
    for concurrency in args.concurrency:
        before = spec_counters(llm)
        tokens, seconds, answers = 0, 0.0, [[] for _ in questions]

        def timed(conversations):
            nonlocal tokens, seconds
            start = time.perf_counter()
            outputs = llm.chat(conversations, params, use_tqdm=False)
            seconds += time.perf_counter() - start
            tokens += sum(len(o.outputs[0].token_ids) for o in outputs)
            return [o.outputs[0].text for o in outputs]

        def conversation(i, turn):
            messages = []
            for t in range(turn + 1):
                messages.append({"role": "user", "content": questions[i][t]})
                if t < turn:
                    messages.append({"role": "assistant", "content": answers[i][t]})
            return messages

        for group_start in range(0, len(questions), concurrency):
            group = range(group_start, min(group_start + concurrency, len(questions)))
            for turn in range(2):
                texts = timed([conversation(i, turn) for i in group])
                for i, text in zip(group, texts):
                    answers[i].append(text)
        counters = counter_delta(spec_counters(llm), before)
        result = {"config": args.config, "concurrency": concurrency, "tokens": tokens, "seconds": seconds,
                  "tokens_per_second": tokens / seconds if seconds else float("nan"), "counters": counters,
                  "turns": 2 * len(questions), "schedule": schedule}
        drafts = counters.get("spec_decode_num_drafts", 0)
        if drafts:
            result["tau"] = 1 + counters["spec_decode_num_accepted_tokens"] / drafts
            previous, alpha = drafts, []
            for count in counters["spec_decode_num_accepted_tokens_per_pos"]:
                alpha.append(count / previous if previous else float("nan"))
                previous = count
            result["alpha"] = alpha
        Path(args.output, f"{args.config}_c{concurrency}.json").write_text(json.dumps(result), encoding="utf-8")
    return 0


def ensure_exports(args) -> None:
    folder = Path(args.exports)
    python = args.main_python or os.environ.get("POSS_MAIN_PYTHON") or shutil.which("python3")
    for name, extra in (("poss2", []), ("spec0", ["--first-specialist"])):
        if name not in {EXPORT_OF.get(c) for c in args.configs} or (folder / name / "config.json").is_file():
            continue
        shipped = subprocess.run(
            [python, "-c", "from transformers_poss.assets import default_drafter_path as p; print(p('poss2'))"],
            check=True, capture_output=True, text=True).stdout.strip()
        subprocess.run([python, "-m", "transformers_poss.cli", "export", "--format", "vllm", shipped,
                        str(folder / name), "--target", args.target, *extra], check=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--target", default=str(Path.home() / ".cache/transformers_poss/SmolLM2-135M-Instruct"))
    parser.add_argument("--prompts", default=str(ROOT.parent / "shared/data/specbench/mt_bench.jsonl"))
    parser.add_argument("--limit", type=int, default=8, help="MT-Bench questions (two turns each)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--k", type=int, default=3, help="num_speculative_tokens (a chain of K draft positions)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    parser.add_argument("--exports", default=str(ROOT / "runs" / "vllm_exports"))
    parser.add_argument("--main-python", help="python with transformers_poss (for the exports)")
    parser.add_argument("--output-dir", help="keep each run's JSON here (default: a temporary folder)")
    parser.add_argument("--worker", nargs=2, metavar=("CONFIG", "OUTPUT_DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        args.config, args.output = args.worker
        return run_one(args)

    ensure_exports(args)
    import tempfile

    out = Path(args.output_dir or tempfile.mkdtemp(prefix="vllm_bench_"))
    out.mkdir(parents=True, exist_ok=True)
    for config in args.configs:
        command = [sys.executable, __file__, "--target", args.target, "--prompts", args.prompts,
                   "--limit", str(args.limit), "--max-tokens", str(args.max_tokens), "--dtype", args.dtype,
                   "--k", str(args.k), "--exports", args.exports, "--concurrency", *map(str, args.concurrency),
                   "--worker", config, str(out)]
        print(f"[vllm_bench] {config}, {' then '.join(map(str, args.concurrency))} at a time ...", file=sys.stderr,
              flush=True)
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
                       if not os.environ.get("VLLM_BENCH_VERBOSE") else None)
    results = [json.loads((out / f"{config}_c{concurrency}.json").read_text())
               for concurrency in args.concurrency for config in args.configs]
    lines = [f"vLLM {args.dtype}, {args.limit} MT-Bench questions x 2 turns, {args.max_tokens} new tokens, "
             f"K={args.k} (chain), greedy", "",
             "| requests at a time | configuration | tokens/s | vs plain | tau | drafts | per-position acceptance |",
             "|---|---|---|---|---|---|---|"]
    for concurrency in args.concurrency:
        plain = next((r for r in results if r["config"] == "plain" and r["concurrency"] == concurrency), None)
        for r in (r for r in results if r["concurrency"] == concurrency):
            speed = f"{r['tokens_per_second'] / plain['tokens_per_second']:.2f}x" if plain else "-"
            tau = f"{r['tau']:.2f}" if "tau" in r else "-"
            drafts = r["counters"].get("spec_decode_num_drafts", 0) if r["config"] != "plain" else "-"
            alpha = ", ".join(f"{a:.2f}" for a in r.get("alpha", [])) or "-"
            lines.append(f"| {concurrency} | {r['config']} | {r['tokens_per_second']:.1f} | {speed} | {tau} | "
                         f"{drafts} | {alpha} |")
    schedules = {r["config"]: r["schedule"] for r in results if r.get("schedule")}
    if schedules:
        lines += ["", "schedules: " + "; ".join(f"{c} {s}" for c, s in schedules.items())]
    text = "\n".join(lines) + "\n"
    print("\n" + text)
    (out / "table.md").write_text(text, encoding="utf-8")
    print(f"per-run JSON: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
