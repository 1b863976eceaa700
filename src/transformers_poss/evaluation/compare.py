"""`poss compare`: two drafters measured on the same turns, per draft position, with a paired bootstrap.

Reads `poss bench` results JSON files (several runs pool, e.g. the two halves of a prompt set), takes the turns that
both methods answered, and prints for each method tau, alpha_1..alpha_depth (conditional acceptance) and
P(at least p drafts accepted), then the difference A - B of each with a 95% interval from resampling turns with
replacement (a turn keeps all its rounds, so rounds of one answer are not treated as independent). With fp32 greedy
runs both methods answer with the same text, and every turn is a paired sample of the two drafters.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from ..metrics import position_acceptance_from_counts, rounds_accepting_at_least

TurnKey = tuple[str, str, str]


def load_turns(paths: list[str | Path]) -> tuple[dict[str, dict[TurnKey, dict]], dict[str, int]]:
    """`{method: {(dataset, question_id, turn): row}}` of every turn with acceptance records (the row's
    `acceptance_lengths`, `output_ids`, ...) in the given `poss bench` results files, and `{method: tree_depth}` of
    the methods whose records name their drafting depth."""
    turns: dict[str, dict[TurnKey, dict]] = {}
    depths: dict[str, int] = {}
    for path in paths:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no such results file (poss bench writes results.json)")
        try:
            data = json.loads(path.read_text())
            rows = data["prompts"]
        except (json.JSONDecodeError, KeyError, TypeError) as error:
            raise ValueError(f"{path} is not a `poss bench` results file with per-turn records") from error
        for row in rows:
            if row.get("acceptance_lengths"):
                key = (str(row["dataset"]), str(row["question_id"]), str(row["turn"]))
                turns.setdefault(row["method"], {})[key] = row
        for method in data.get("methods", []):
            if method.get("tree_depth"):
                depths[method["name"]] = int(method["tree_depth"])
    return turns, depths


def turn_counts(acceptance_lengths: list[int], depth: int) -> list[int]:
    """One turn's rounds as addable counts: [accepted drafts in all, rounds with a >= 0, >= 1, ..., >= depth]."""
    return [sum(acceptance_lengths), *rounds_accepting_at_least(acceptance_lengths, depth)]


def rates_from_counts(counts: list[int]) -> dict:
    """tau, alpha_1..alpha_depth and P(accepted >= p) for p = 1..depth from summed `turn_counts`."""
    accepted, at_least = counts[0], counts[1:]
    rounds = at_least[0]
    return {"rounds": rounds, "tau": 1 + accepted / rounds,  # mean of (a + 1), as metrics.mean_acceptance_length
            "alpha": position_acceptance_from_counts(at_least), "at_least": [c / rounds for c in at_least[1:]]}


def _sum_counts(per_turn: list[list[int]], indices) -> list[int]:
    return [sum(column) for column in zip(*(per_turn[i] for i in indices))]


def _flat(rates: dict) -> list[float]:
    return [rates["tau"], *rates["alpha"], *rates["at_least"]]


def paired_bootstrap(rounds_a: list[list[int]], rounds_b: list[list[int]], depth: int, samples: int = 2000,
                     seed: int = 0) -> list[dict]:
    """Differences A - B over paired turns (`rounds_a[i]`, `rounds_b[i]`: the acceptance lengths of turn `i`).

    Returns one row per measure (`tau`, `alpha_p`, `P(>=p)`) with `difference` (on all turns), `low` and `high`
    (2.5% and 97.5% quantiles over resampled turns) and `share_above` (share of resamples with A - B > 0); a
    conditional alpha that no resampled round reached counts as 0 in that resample.
    """
    if len(rounds_a) != len(rounds_b) or not rounds_a:
        raise ValueError("paired_bootstrap needs the same, non-zero number of turns for both methods")
    counts_a = [turn_counts(r, depth) for r in rounds_a]
    counts_b = [turn_counts(r, depth) for r in rounds_b]

    def difference(indices):
        a = rates_from_counts(_sum_counts(counts_a, indices))
        b = rates_from_counts(_sum_counts(counts_b, indices))
        return [0.0 if x != x or y != y else x - y for x, y in zip(_flat(a), _flat(b))]  # x != x: NaN

    turns = range(len(rounds_a))
    observed = difference(turns)
    rng = random.Random(seed)
    draws = [difference([rng.choice(turns) for _ in turns]) for _ in range(samples)]
    names = ["tau"] + [f"alpha_{p}" for p in range(1, depth + 1)] + [f"P(>={p})" for p in range(1, depth + 1)]
    rows = []
    for i, name in enumerate(names):
        column = sorted(d[i] for d in draws)
        rows.append({"measure": name, "difference": observed[i], "low": column[int(0.025 * samples)],
                     "high": column[max(int(0.975 * samples) - 1, 0)],
                     "share_above": sum(x > 0 for x in column) / samples})
    return rows


def compare(paths: list[str | Path], method_a: str, method_b: str, samples: int = 2000, seed: int = 0) -> dict:
    """Pooled per-position acceptance of both methods and their paired-bootstrap differences (see module doc)."""
    turns, depths = load_turns(paths)
    for method in (method_a, method_b):
        if method not in turns:
            known = ", ".join(sorted(turns)) or "none"
            raise ValueError(f"no acceptance records of method {method!r} in the results (methods with records: "
                             f"{known})")
    keys = sorted(set(turns[method_a]) & set(turns[method_b]))
    if not keys:
        raise ValueError(f"{method_a!r} and {method_b!r} share no turn: benchmark both on the same prompts")
    rounds_a = [turns[method_a][k]["acceptance_lengths"] for k in keys]
    rounds_b = [turns[method_b][k]["acceptance_lengths"] for k in keys]
    # the drafting depth the records name, else the longest acceptance seen
    depth = max(depths.get(method_a, 0), depths.get(method_b, 0), *(max(r) for r in rounds_a + rounds_b), 1)
    differing = sum(turns[method_a][k].get("output_ids") != turns[method_b][k].get("output_ids") for k in keys)
    return {
        "turns": len(keys), "turns_with_different_answers": differing, "depth": depth, "samples": samples,
        "methods": {m: rates_from_counts(turn_counts([x for r in rs for x in r], depth))
                    for m, rs in ((method_a, rounds_a), (method_b, rounds_b))},
        "differences": paired_bootstrap(rounds_a, rounds_b, depth, samples, seed),
    }


def format_comparison(result: dict, method_a: str, method_b: str) -> str:
    """Markdown tables of `compare`'s result."""
    depth = result["depth"]
    lines = [f"{result['turns']} paired turns, {result['samples']} bootstrap samples"]
    if result["turns_with_different_answers"]:
        lines.append(f"note: {result['turns_with_different_answers']} turns have different answers (not fp32 "
                     "greedy?), so those pairs compare drafters on different text")
    lines += ["", "| method | rounds | tau | alpha_1..alpha_%d | P(at least p accepted), p = 1..%d |" % (depth, depth),
              "|---|---|---|---|---|"]
    for name, rates in result["methods"].items():
        lines.append(f"| {name} | {rates['rounds']} | {rates['tau']:.3f} | "
                     + " ".join(f"{a:.3f}" for a in rates["alpha"]) + " | "
                     + " ".join(f"{g:.3f}" for g in rates["at_least"]) + " |")
    lines += ["", f"| {method_a} - {method_b} | difference | 95% interval | share of samples > 0 |",
              "|---|---|---|---|"]
    for row in result["differences"]:
        lines.append(f"| {row['measure']} | {row['difference']:+.3f} | {row['low']:+.3f} .. {row['high']:+.3f} | "
                     f"{row['share_above']:.2f} |")
    return "\n".join(lines)


def run_compare(args) -> int:
    if args.samples < 100:
        raise SystemExit("poss compare: --samples must be at least 100")
    try:
        result = compare(args.results, args.method_a, args.method_b, samples=args.samples, seed=args.seed)
    except (OSError, ValueError) as error:
        raise SystemExit(f"poss compare: {error}") from error
    print(format_comparison(result, args.method_a, args.method_b))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


def add_subcommand(subparsers) -> None:
    parser = subparsers.add_parser(
        "compare", help="compare two benchmarked drafters per draft position, with bootstrap intervals",
        description=__doc__.splitlines()[0])
    parser.add_argument("method_a", help="method name as in the results, e.g. poss2-tree")
    parser.add_argument("method_b", help="the method to subtract, e.g. single-tree")
    parser.add_argument("results", nargs="+", help="poss bench results.json files (several runs are pooled)")
    parser.add_argument("--samples", type=int, default=2000, help="bootstrap resamples of the turns (default 2000)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the resampling (default 0)")
    parser.add_argument("--output-json", help="also write the numbers to this JSON file")
    parser.set_defaults(func=run_compare)
