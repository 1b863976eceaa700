"""The README benchmark's typical figures for the drafter cards: per method, the median over the runs of speedup,
tokens/s, tau and each alpha_p, with the lowest and highest speedup.

    python benchmarks/cpu-bf16-one-loop/median_benchmark.py > benchmarks/cpu-bf16-one-loop/median.json
    python benchmarks/cpu-bf16-one-loop/median_benchmark.py RUN_FOLDER ... > median.json   # other runs
    python benchmarks/cpu-bf16-one-loop/median_benchmark.py --drop fork- RUN_FOLDER ...     # without fork-* rows

(with no folder: the seven runs below, each a folder under benchmarks/ holding results.json or results.json.gz)
    poss card src/transformers_poss/drafters/poss2-smollm2-135m-instruct --method poss2 --force \
        --benchmark benchmarks/cpu-bf16-one-loop/median.json
"""

import gzip
import json
import statistics
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1]
RUNS = ["cpu-bf16-lean-rounds/bench-1", "cpu-bf16-lean-rounds/bench-2", "cpu-bf16-lean-rounds/bench-3",
        "cpu-bf16-early-stop/bench-1", "cpu-bf16-round-limits/bench-1", "cpu-bf16-lean-specialists/bench-1",
        "cpu-bf16-one-loop/readme-bench"]
# The lean-rounds runs named the shipped (8-bit) PosS-2 "poss2-int8-tree" beside a 16-bit variant, and bench-3 named
# it "poss2-tree" beside "poss2-16bit-tree": only the shipped drafter's rows count.
RENAMED = {"poss2-int8-tree": "poss2-tree"}
LEFT_OUT = {"cpu-bf16-lean-rounds/bench-1": {"poss2-tree"}, "cpu-bf16-lean-rounds/bench-2": {"poss2-tree"},
            "cpu-bf16-lean-rounds/bench-3": {"poss2-16bit-tree"}}


def load(folder: Path) -> dict:
    plain = folder / "results.json"
    return json.loads(plain.read_text()) if plain.is_file() else json.load(gzip.open(folder / "results.json.gz"))


def main() -> None:
    arguments = sys.argv[1:]
    drop = ()
    if arguments[:1] == ["--drop"]:
        drop, arguments = (arguments[1],), arguments[2:]
    runs = arguments or RUNS
    rows, environment = {}, {}
    for run in runs:
        data = load(BENCHMARKS / run)
        environment = data["environment"]
        for row in data["results"]:
            if row["method"] not in LEFT_OUT.get(run, ()) and not row["method"].startswith(drop):
                rows.setdefault(RENAMED.get(row["method"], row["method"]), []).append(row)
    results = []
    for method, found in rows.items():
        alphas = [r.get("position_acceptance") or [] for r in found]
        taus = [r["mean_acceptance_length"] for r in found if r.get("mean_acceptance_length") is not None]
        speedups = [r["speedup"] for r in found]
        results.append({
            "dataset": found[0]["dataset"], "method": method, "runs": len(found),
            "speedup": round(statistics.median(speedups), 3),
            "speedup_range": [round(min(speedups), 3), round(max(speedups), 3)],
            "tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in found), 1),
            "mean_acceptance_length": round(statistics.median(taus), 3) if taus else None,
            "position_acceptance": [round(statistics.median(a[p] for a in alphas), 4)
                                    for p in range(min(len(a) for a in alphas))] if all(alphas) else [],
        })
    environment = {"summary": f"median of {len(runs)} runs of the README benchmark (docs/results.md)",
                   **{k: environment[k] for k in ("cpu", "cpu_native_bf16", "dtype", "threads", "torch",
                                                  "transformers") if k in environment}}
    print(json.dumps({"results": results, "environment": environment}, indent=2))


if __name__ == "__main__":
    main()
