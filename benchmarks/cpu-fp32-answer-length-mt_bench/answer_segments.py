"""tau by where a round starts in the answer, and how much of each segment repeats the answer's own earlier text.

    python answer_segments.py results.json [results.json ...] --edges 128,256,512

Reads `poss bench` results: per turn, each method's per-round accepted draft counts (`acceptance_lengths`) and the
baseline's answer tokens (`output_ids`). A round that starts at answer token `s` and accepts `a` drafts produces
`a + 1` tokens; it counts in the segment that holds `s`. "Repeats" is the share of the segment's 4-token windows that
occurred earlier in the same answer (a loop the target fell into).
"""
import argparse
import json


def segment_of(position: int, edges: list[int]) -> int:
    return sum(position >= edge for edge in edges[:-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+")
    parser.add_argument("--edges", default="128,256,512", help="segment ends in answer tokens")
    args = parser.parse_args()
    edges = [int(edge) for edge in args.edges.split(",")]
    tokens, rounds, repeats, windows = {}, {}, [0] * len(edges), [0] * len(edges)
    for path in args.results:
        for turn in json.load(open(path))["prompts"]:
            if turn["method"] == "baseline":
                ids, seen = turn["output_ids"], set()
                for start in range(len(ids) - 3):
                    window = tuple(ids[start:start + 4])
                    segment = segment_of(start, edges)
                    repeats[segment] += window in seen
                    windows[segment] += 1
                    seen.add(window)
            if not turn.get("acceptance_lengths"):
                continue
            start = 0
            method_tokens = tokens.setdefault(turn["method"], [0] * len(edges))
            method_rounds = rounds.setdefault(turn["method"], [0] * len(edges))
            for accepted in turn["acceptance_lengths"]:
                segment = segment_of(start, edges)
                method_tokens[segment] += accepted + 1
                method_rounds[segment] += 1
                start += accepted + 1
    lows = [0] + edges[:-1]
    print("| answer tokens | " + " | ".join(f"{lo + 1}-{hi}" for lo, hi in zip(lows, edges)) + " |")
    print("|---" * (len(edges) + 1) + "|")
    for method in sorted(tokens):
        cells = [f"{t / r:.2f} ({r} rounds)" if r else "-" for t, r in zip(tokens[method], rounds[method])]
        print(f"| {method} tau | " + " | ".join(cells) + " |")
    print("| 4-token windows repeating the answer's earlier text | "
          + " | ".join(f"{rep / n:.0%} of {n}" if n else "-" for rep, n in zip(repeats, windows)) + " |")


if __name__ == "__main__":
    main()
