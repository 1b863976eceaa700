"""Pool the per-round acceptance records of several `poss bench` runs: tau, conditional acceptance alpha_p and
P(at least p drafts accepted) per method.

    python pool_rounds.py results-2per.json results-34.json
"""
import json
import sys


def main(paths: list[str]) -> None:
    lengths: dict[str, list[int]] = {}
    for path in paths:
        for turn in json.load(open(path))["prompts"]:
            if turn.get("acceptance_lengths"):
                lengths.setdefault(turn["method"], []).extend(turn["acceptance_lengths"])
    for method, accepted in lengths.items():
        rounds, depth = len(accepted), 6
        at_least = [sum(a >= p for a in accepted) / rounds for p in range(1, depth + 1)]
        alpha = [at_least[0]] + [at_least[p] / at_least[p - 1] if at_least[p - 1] else float("nan")
                                 for p in range(1, depth)]
        print(f"{method}: {rounds} rounds, tau {1 + sum(accepted) / rounds:.3f}, alpha "
              + " ".join(f"{a:.3f}" for a in alpha) + ", P(accepted >= p) " + " ".join(f"{g:.3f}" for g in at_least))


if __name__ == "__main__":
    main(sys.argv[1:])
