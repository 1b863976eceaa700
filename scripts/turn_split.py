"""Split a `poss bench` run by turn: new questions (first turns) against follow-ups (later turns of a conversation).

    python scripts/turn_split.py docs/benchmarks/cpu-fp32-all-rounds-d6-mt_bench/bf16-shipped-pass2/results.json \
        --plot docs/benchmarks/cpu-fp32-all-rounds-d6-mt_bench/bf16-shipped-pass2/turns.png

MT-Bench's second turns mostly ask the model to rework its previous answer ("Rewrite your previous response ..."),
so much of the answer is already in the context, and the prompt-lookup branch (and transformers' prompt lookup)
copies it: a pooled figure mixes two very different cases. Prints per method and kind of turn: the speedup (tokens
per second against the baseline's on the same turns), tau and alpha_1 from the per-round records, and how many
accepted tokens only the prompt-lookup branch proposed; `--plot` draws the speedups.
"""

import argparse
import json

KINDS = (("new questions", lambda turn: turn == 0), ("follow-ups", lambda turn: turn > 0), ("all", lambda turn: True))


def split(prompts: list[dict]) -> dict[str, dict[str, dict]]:
    """`{kind: {method: {"turns", "speedup", "tau", "alpha_1", "lookup_tokens"}}}` from a results.json's `prompts`."""
    methods = list(dict.fromkeys(r["method"] for r in prompts))
    table = {}
    for kind, keep in KINDS:
        rows = [r for r in prompts if keep(r["turn"])]
        base = [r for r in rows if r["method"] == "baseline"]
        base_rate = sum(r["new_tokens"] for r in base) / sum(r["seconds"] for r in base)
        table[kind] = {}
        for method in methods:
            mine = [r for r in rows if r["method"] == method]
            lengths = [a for r in mine for a in (r.get("acceptance_lengths") or [])]
            table[kind][method] = {
                "turns": len(mine),
                "speedup": sum(r["new_tokens"] for r in mine) / sum(r["seconds"] for r in mine) / base_rate,
                "tau": 1 + sum(lengths) / len(lengths) if lengths else None,
                "alpha_1": sum(a >= 1 for a in lengths) / len(lengths) if lengths else None,
                "lookup_tokens": sum(r.get("lookup_tokens") or 0 for r in mine) if lengths else None,
            }
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("results", help="a results.json written by `poss bench --output-dir`")
    parser.add_argument("--plot", default=None, help="write a bar chart of the speedups here (PNG)")
    args = parser.parse_args()
    with open(args.results) as f:
        run = json.load(f)
    table = split(run["prompts"])
    env = run.get("environment", {})
    print(f"{env.get('cpu', '?')} (native bf16: {env.get('cpu_native_bf16', '?')}), {env.get('dtype', '?')}, "
          f"{env.get('threads', '?')} threads; {env.get('command', '')}\n")
    print("| turns | method | n | speedup | tau | alpha_1 | tokens from the lookup branch alone |")
    print("|---|---|---|---|---|---|---|")
    for kind, methods in table.items():
        for method, row in methods.items():
            if method == "baseline":
                continue
            tau = "-" if row["tau"] is None else f"{row['tau']:.2f}"
            alpha = "-" if row["alpha_1"] is None else f"{row['alpha_1']:.2f}"
            lookup = "-" if row["lookup_tokens"] is None else str(row["lookup_tokens"])
            print(f"| {kind} | {method} | {row['turns']} | {row['speedup']:.2f}x | {tau} | {alpha} | {lookup} |")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        methods = [m for m in next(iter(table.values())) if m != "baseline"]
        fig, ax = plt.subplots(figsize=(7, 3.6))
        width = 0.8 / len(methods)
        for i, method in enumerate(methods):
            values = [table[kind][method]["speedup"] for kind, _ in KINDS]
            bars = ax.bar([k + (i - (len(methods) - 1) / 2) * width for k in range(len(KINDS))], values, width,
                          label=method)
            ax.bar_label(bars, labels=[f"{v:.2f}x" for v in values], fontsize=8)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(KINDS)), [f"{kind} ({table[kind]['baseline']['turns']} turns)" for kind, _ in KINDS])
        ax.set_ylabel("speedup over plain generate")
        ax.set_title(f"{env.get('dtype', '')}, {env.get('cpu', '')} (native bf16: {env.get('cpu_native_bf16', '?')}),"
                     f" {env.get('threads', '?')} threads", fontsize=9)
        ax.legend(fontsize=8, loc="upper left")
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)
        print(f"\nwrote {args.plot}")


if __name__ == "__main__":
    main()
