"""Held-out top-1 accuracy by draft position against optimizer steps: the EAGLE-3-style runs' validations and the
shipped EAGLE-2-style pair's recorded ones (the same held-out records 4000-4031, answered by the target).

    python curves.py --output curves.png "E3 single=runs/e3-single" "E3 PosS-2=runs/e3-poss2@runs/e3-single" ...

`NAME=RUN` reads `RUN/train_log.jsonl` (RUN may also be a train log itself, `.jsonl` or `.jsonl.gz`, as in
`records/`); `NAME=RUN@BASE` draws the run after the steps of `BASE` (a run warm started from BASE's end) and joins
BASE's last point to it; `NAME=RUN@BASE@BASE2` after BASE's and BASE2's steps (BASE itself warm started from BASE2).
"""
import argparse
import gzip
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

# Held-out top-1 accuracy at draft positions 1..6 that the shipped drafters' records and benchmarks/HISTORY.md give, by
# steps in all. These runs trained on original ShareGPT answers up to 3,662 steps (validated then on other answers,
# so not drawn), and on the target's answers after.
SHIPPED = {
    "shipped PosS-2 (EAGLE-2 style)": {
        4005: [0.522, 0.458, 0.460, 0.457, 0.450, 0.445], 5253: [0.570, 0.518, 0.507, 0.494, 0.495, 0.492],
        5881: [0.582, 0.535, 0.533, 0.528, 0.525, 0.523], 7598: [0.602, 0.548, 0.546, 0.542, 0.534, 0.530],
        9315: [0.598, 0.550, 0.549, 0.537, 0.531, 0.529]},
    "shipped single (EAGLE-2 style)": {
        4005: [0.504, 0.468, 0.463, 0.465, 0.456, 0.450], 5253: [0.557, 0.514, 0.511, 0.505, 0.500, 0.497],
        5881: [0.563, 0.530, 0.527, 0.525, 0.521, 0.519], 7598: [0.585, 0.547, 0.542, 0.545, 0.543, 0.538],
        9315: [0.587, 0.549, 0.544, 0.542, 0.539, 0.537]},
}


def validations(run: str) -> dict[int, list[float]]:
    path = Path(run) / "train_log.jsonl" if Path(run).is_dir() else Path(run)
    text = gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()
    points = {}
    for line in text.splitlines():
        record = json.loads(line)
        if record.get("event") == "validation":
            points[record["step"]] = record["position_accuracy"]
    if not points:
        raise SystemExit(f"{path}: no validation in it")
    return points


def curve(spec: str) -> tuple[str, dict[int, list[float]]]:
    name, chain = spec.split("=", 1)
    run, *bases = chain.split("@")
    if not bases:
        return name, validations(run)
    before = [validations(base) for base in bases]
    offset = sum(max(points) for points in before)
    start = before[0][max(before[0])]
    return name, {offset: start, **{offset + step: v for step, v in validations(run).items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="NAME=RUN or NAME=RUN@BASE")
    parser.add_argument("--output", default="curves.png")
    parser.add_argument("--no-shipped", action="store_true", help="leave the shipped pair's points out")
    parser.add_argument("--from-step", type=int, default=0, help="draw only the points from this step on")
    args = parser.parse_args()
    curves = [(name, {s: v for s, v in points.items() if s >= args.from_step})
              for name, points in map(curve, args.runs)]
    figure, axes = plt.subplots(2, 3, figsize=(13, 7), sharey=True)
    for position, axis in enumerate(axes.flat):
        for name, points in curves:
            steps = sorted(points)
            axis.plot(steps, [points[s][position] for s in steps], marker=".", label=name)
        if not args.no_shipped:
            for (name, points), marker in zip(SHIPPED.items(), ("s", "^")):
                steps = sorted(points)
                axis.plot(steps, [points[s][position] for s in steps], marker=marker, linestyle=":", label=name)
        axis.set_title(f"draft position {position + 1}")
        axis.set_xlabel("optimizer steps in all")
        axis.grid(alpha=0.3)
    axes[0][0].set_ylabel("held-out top-1 accuracy")
    axes[1][0].set_ylabel("held-out top-1 accuracy")
    axes[0][0].legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(args.output, dpi=110)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
