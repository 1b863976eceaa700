"""Paired bootstrap over turns: how sure is a per-position difference between two drafters?

Both drafters must have been benchmarked on the same turns with token-identical answers (fp32 greedy), so each turn
is one paired sample. Resampling turns with replacement (a turn keeps all its rounds) gives a 95% interval for the
difference A - B in tau, in conditional acceptance alpha_p and in P(at least p drafts accepted).

    python paired_bootstrap.py METHOD_A METHOD_B results-a.json [results-b.json ...]
"""
import json
import random
import sys


def position_rates(rounds: list[list[int]], depth: int) -> tuple[float, list[float], list[float]]:
    """tau, alpha_1..alpha_depth and P(accepted >= p) of the pooled acceptance lengths of several turns."""
    accepted = [a for turn in rounds for a in turn]
    n = len(accepted)
    at_least = [sum(a >= p for a in accepted) / n for p in range(1, depth + 1)]
    alpha = [at_least[0]] + [at_least[p] / at_least[p - 1] if at_least[p - 1] else 0.0 for p in range(1, depth)]
    return 1 + sum(accepted) / n, alpha, at_least


def main(method_a: str, method_b: str, paths: list[str], samples: int = 2000, depth: int = 6) -> None:
    turns: dict[tuple, dict[str, list[int]]] = {}
    for path in paths:
        for row in json.load(open(path))["prompts"]:
            if row["method"] in (method_a, method_b) and row.get("acceptance_lengths"):
                key = (row["dataset"], row["question_id"], row["turn"])
                turns.setdefault(key, {})[row["method"]] = row["acceptance_lengths"]
    paired = [t for t in turns.values() if method_a in t and method_b in t]
    if not paired:
        sys.exit(f"no turn has rounds of both {method_a!r} and {method_b!r}")

    def difference(sample):
        tau_a, alpha_a, least_a = position_rates([t[method_a] for t in sample], depth)
        tau_b, alpha_b, least_b = position_rates([t[method_b] for t in sample], depth)
        return ([tau_a - tau_b] + [x - y for x, y in zip(alpha_a, alpha_b)]
                + [x - y for x, y in zip(least_a, least_b)])

    observed = difference(paired)
    rng = random.Random(0)
    draws = [difference([rng.choice(paired) for _ in paired]) for _ in range(samples)]
    names = (["tau"] + [f"alpha_{p}" for p in range(1, depth + 1)]
             + [f"P(>={p})" for p in range(1, depth + 1)])
    print(f"{method_a} - {method_b}, {len(paired)} paired turns, {samples} bootstrap samples")
    print("| measure | difference | 95% interval | share of samples > 0 |\n|---|---|---|---|")
    for i, name in enumerate(names):
        column = sorted(d[i] for d in draws)
        low, high = column[int(0.025 * samples)], column[int(0.975 * samples) - 1]
        above = sum(x > 0 for x in column) / samples
        print(f"| {name} | {observed[i]:+.3f} | {low:+.3f} .. {high:+.3f} | {above:.2f} |")


if __name__ == "__main__":
    if len(sys.argv) < 4:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
