"""Seconds per training step of the specforge-eagle3 recipe for several source trees, interleaved run by run.

    python step_time.py WORK --tree before=/path/to/old/checkout --tree after=. [--rounds 3] [--steps 40]

Each round runs `poss train` once per tree (`python -m transformers_poss.cli` with the tree's `src/` first on
`PYTHONPATH`) on the first batches of `WORK/feat-a`, the run's own settings (EAGLE-3, feature layers 2,15,27,-1, draft
vocabulary 16,384, batch 4, max length 384, TTT 7, bf16 autocast where the CPU computes bf16), logging every 5 steps.
A run's seconds per step is the median over its logged windows after the first (its training wall time, from
`train_log.jsonl`, between log lines, over 5 steps); the table gives each tree's median over rounds, with the lowest
and highest, and each tree's ratio to the first tree's. Nothing else should run meanwhile.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def run_once(tree: Path, work: Path, steps: int, dtype: str, out: Path) -> float:
    """Median seconds per step of one `poss train` run of `steps` steps from source tree `tree`."""
    target = subprocess.check_output(["poss", "fetch-target"], text=True).strip()
    precision = "bf16" if dtype == "bfloat16" else "no"
    command = [sys.executable, "-m", "transformers_poss.cli", "train", "--target", target, "--target-dtype", dtype,
               "--features", str(work / "feat-a"), "--drafter-type", "eagle3", "--feature-layers", "2,15,27,-1",
               "--draft-vocab-size", "16384", "--batch-size", "4", "--max-length", "384", "--mixed-precision",
               precision, "--max-steps", str(steps), "--log-steps", "5", "--val-steps", "100000",
               "--save-steps", "100000", "--val-fraction", "0.01", "--val-max-examples", "4", "--seed", "0",
               "--no-progress", "--output-dir", str(out)]
    env = {**os.environ, "PYTHONPATH": str(tree / "src")}
    subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    walls = [r["wall_time_s"] for r in map(json.loads, (out / "train_log.jsonl").read_text().splitlines())
             if r.get("event") == "train"]
    return statistics.median((b - a) / 5 for a, b in zip(walls[1:], walls[2:]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("work", type=Path, help="prepare.sh's folder (feat-a is read)")
    parser.add_argument("--tree", action="append", required=True, help="NAME=PATH of a checkout; the first is the base")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--dtype", default=None, help="bfloat16 or float32 (default: bfloat16 where lscpu shows "
                                                       "avx512_bf16)")
    args = parser.parse_args()
    trees = [(name, Path(path).resolve()) for name, path in (t.split("=", 1) for t in args.tree)]
    dtype = args.dtype or ("bfloat16" if "avx512_bf16" in subprocess.run(["lscpu"], capture_output=True,
                                                                         text=True).stdout else "float32")
    times: dict[str, list[float]] = {name: [] for name, _ in trees}
    with tempfile.TemporaryDirectory() as scratch:
        for round_ in range(args.rounds):
            for name, tree in trees:
                seconds = run_once(tree, args.work, args.steps, dtype, Path(scratch) / f"{name}-{round_}")
                times[name].append(seconds)
                print(f"round {round_ + 1} {name}: {seconds:.3f} s/step", flush=True)
    base = statistics.median(times[trees[0][0]])
    print(f"\n{dtype}, {os.environ.get('OMP_NUM_THREADS', 'all')} threads, {args.steps} steps a run, "
          f"{args.rounds} rounds\n")
    print("| tree | s/step, median (lowest-highest) | ratio to " + trees[0][0] + " |\n|---|---|---|")
    for name, _ in trees:
        median = statistics.median(times[name])
        print(f"| {name} | {median:.3f} ({min(times[name]):.3f}-{max(times[name]):.3f}) | {median / base:.2f} |")


if __name__ == "__main__":
    main()
