"""Tokens per round by MT-Bench category for one drafter measured twice on the same turns (fp32, token-identical
answers): with its prompt-lookup branch and without, and the share of answer tokens accepted from the branch alone.

    R3=../cpu-fp32-self-distilled3-d6-mt_bench
    python category_tau.py --with results-2per.json results-34.json --method-with poss2-tree \
        --without $R3/results-2per.json $R3/results-34.json --method-without poss2-r3-tree
"""
import argparse
import json
from collections import defaultdict


def turns(paths: list[str], method: str) -> dict[tuple, dict]:
    """`{(question_id, turn): per-turn record}` of one method over several `poss bench` results files."""
    return {(t["question_id"], t["turn"]): t for path in paths for t in json.load(open(path))["prompts"]
            if t["method"] == method}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--with", dest="with_lookup", nargs="+", required=True)
    parser.add_argument("--without", nargs="+", required=True)
    parser.add_argument("--method-with", required=True)
    parser.add_argument("--method-without", required=True)
    args = parser.parse_args()
    with_lookup, without = turns(args.with_lookup, args.method_with), turns(args.without, args.method_without)
    # per category: tokens, rounds with the branch, tokens from the branch alone, rounds without
    totals = defaultdict(lambda: [0, 0, 0, 0])
    for key, turn in with_lookup.items():
        for category in (turn["category"], "all"):
            row = totals[category]
            row[0] += turn["new_tokens"]
            row[1] += len(turn["acceptance_lengths"])
            row[2] += turn["lookup_tokens"]
            row[3] += len(without[key]["acceptance_lengths"])
    print("| category | answer tokens | tokens per round without the branch | with it | from the branch alone |")
    print("|---|---|---|---|---|")
    for category, (tokens, rounds, lookup, rounds_without) in sorted(totals.items(), key=lambda kv: kv[0] == "all"):
        print(f"| {category} | {tokens} | {tokens / rounds_without:.2f} | {tokens / rounds:.2f} "
              f"| {lookup / tokens:.2f} |")


if __name__ == "__main__":
    main()
