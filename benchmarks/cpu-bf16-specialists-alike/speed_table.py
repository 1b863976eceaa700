"""README's benchmark over several runs, split by turn:   python speed_table.py speed-1 speed-2 speed-3
Per kind of turn and method: the median speedup over the runs with the lowest and highest run, and the median tau
(`poss turns`' split of each run's results.json)."""
import json
import statistics
import sys
from pathlib import Path

from transformers_poss.evaluation.turns import split

tables = [split(json.loads((Path(run) / "results.json").read_text())["prompts"]) for run in sys.argv[1:]]
print(f"| turns | method | speedup, median of {len(tables)} (lowest-highest) | tau (median) |")
print("|---|---|---|---|")
for kind, methods in tables[0].items():
    for method in methods:
        if method == "baseline":
            continue
        rows = [table[kind][method] for table in tables]
        speedups = [row["speedup"] for row in rows]
        taus = [row["tau"] for row in rows if row["tau"] is not None]
        tau = f"{statistics.median(taus):.2f}" if taus else "-"
        print(f"| {kind} ({rows[0]['turns']}) | {method} | {statistics.median(speedups):.2f}x "
              f"({min(speedups):.2f}-{max(speedups):.2f}) | {tau} |")
