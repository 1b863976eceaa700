"""The A/B of issue 63 as a table: held-out top-1 (and top-10) accuracy per draft position of two runs at the
validation steps both logged, and their difference.

    python ab_table.py RUNS/ab-flow RUNS/ab-detach [--steps 500 1000 1500] [--plot curves.png]

`--plot` also draws each run's held-out top-1 against steps, one panel per draft position (PNG).
"""
import argparse
import json
from pathlib import Path


def validations(run: str) -> dict[int, dict]:
    """`{step: validation record}` of a run's `train_log.jsonl` (the last record of a step wins: a resumed run
    validates a step again)."""
    points = {}
    for line in (Path(run) / "train_log.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record.get("event") == "validation":
            points[record["step"]] = record
    return points


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("a")
    parser.add_argument("b")
    parser.add_argument("--steps", type=int, nargs="*", help="default: every step both validated")
    parser.add_argument("--plot", help="write the curves here (PNG)")
    args = parser.parse_args()
    a, b = validations(args.a), validations(args.b)
    steps = args.steps or sorted(set(a) & set(b))
    names = Path(args.a).name, Path(args.b).name
    for key, label in (("position_accuracy", "top-1"), ("position_top_k_accuracy", "top-10")):
        print(f"\n{label} by draft position ({names[0]} / {names[1]} / difference)\n")
        positions = len(a[steps[0]][key])
        print("| step | " + " | ".join(f"pos {p}" for p in range(1, positions + 1)) + " | mean |")
        print("|---" * (positions + 2) + "|")
        for step in steps:
            x, y = a[step][key], b[step][key]
            cells = [f"{u:.3f} / {v:.3f} / {u - v:+.3f}" for u, v in zip(x, y)]
            mean = sum(x) / len(x) - sum(y) / len(y)
            print(f"| {step} | " + " | ".join(cells) + f" | {mean:+.3f} |")
    if args.plot:
        plot(args.plot, {name: run for name, run in zip(names, (a, b))})


def plot(path: str, runs: dict[str, dict[int, dict]]) -> None:
    """Held-out top-1 against steps, one panel per draft position."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    positions = len(next(iter(next(iter(runs.values())).values()))["position_accuracy"])
    figure, axes = plt.subplots(1, positions, figsize=(2.6 * positions, 3), sharey=True)
    for index, axis in enumerate(axes):
        for name, points in runs.items():
            steps = sorted(points)
            axis.plot(steps, [points[s]["position_accuracy"][index] for s in steps], label=name)
        axis.set_title(f"position {index + 1}")
        axis.set_xlabel("step")
        axis.grid(alpha=0.3)
    axes[0].set_ylabel("held-out top-1")
    axes[-1].legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
