"""`poss turns`: a `poss bench` run split by turn, new questions (first turns) against follow-ups (later turns).

MT-Bench's second turns mostly ask the model to rework its previous answer ("Rewrite your previous response ..."),
so much of the answer is already in the context, and the prompt-lookup branch (and transformers' prompt lookup)
copies it: a pooled figure mixes two very different cases. Per method and kind of turn: the speedup (tokens per second
against the baseline's on the same turns), tau and alpha_1 from the per-round records, and how many accepted tokens
only the prompt-lookup branch proposed. `poss bench` prints this table itself when its prompts have follow-ups.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from .methods import BASELINE

KINDS = (("new questions", lambda turn: turn == 0), ("follow-ups", lambda turn: turn > 0), ("all", lambda turn: True))


def split(prompts: list[dict]) -> dict[str, dict[str, dict]]:
    """`{kind: {method: {"turns", "speedup", "tau", "alpha_1", "lookup_tokens"}}}` from a results.json's `prompts`
    (kinds without turns are left out)."""
    methods = list(dict.fromkeys(r["method"] for r in prompts))
    table = {}
    for kind, keep in KINDS:
        rows = [r for r in prompts if keep(r["turn"])]
        base = [r for r in rows if r["method"] == BASELINE]
        if not base:
            continue
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


def has_follow_ups(prompts: list[dict]) -> bool:
    return any(r["turn"] > 0 for r in prompts)


def turn_table(table: dict[str, dict[str, dict]]) -> str:
    """The split as a markdown table (the baseline's rows left out: 1.00x by definition)."""
    lines = ["| turns | method | n | speedup | tau | alpha_1 | tokens from the lookup branch alone |",
             "|---|---|---|---|---|---|---|"]
    for kind, methods in table.items():
        for method, row in methods.items():
            if method == BASELINE:
                continue
            tau = "-" if row["tau"] is None else f"{row['tau']:.2f}"
            alpha = "-" if row["alpha_1"] is None else f"{row['alpha_1']:.2f}"
            lookup = "-" if row["lookup_tokens"] is None else str(row["lookup_tokens"])
            lines.append(f"| {kind} | {method} | {row['turns']} | {row['speedup']:.2f}x | {tau} | {alpha} | {lookup} |")
    return "\n".join(lines)


def plot_turns(table: dict[str, dict[str, dict]], environment: dict, path) -> Path:
    """A bar chart of the speedups by kind of turn (PNG)."""
    from ..plotting import pyplot

    plt = pyplot()
    kinds = list(table)
    methods = [m for m in next(iter(table.values())) if m != BASELINE]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    width = 0.8 / max(len(methods), 1)
    for i, method in enumerate(methods):
        values = [table[kind][method]["speedup"] for kind in kinds]
        bars = ax.bar([k + (i - (len(methods) - 1) / 2) * width for k in range(len(kinds))], values, width,
                      label=method)
        ax.bar_label(bars, labels=[f"{v:.2f}x" for v in values], fontsize=8)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(kinds)), [f"{kind} ({table[kind][BASELINE]['turns']} turns)" for kind in kinds])
    ax.set_ylabel("speedup over plain generate")
    ax.set_title(f"{environment.get('dtype', '')}, {environment.get('cpu', '')} (native bf16: "
                 f"{environment.get('cpu_native_bf16', '?')}), {environment.get('threads', '?')} threads", fontsize=9)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run_turns(args) -> int:
    try:
        run = json.loads(Path(args.results).read_text(encoding="utf-8"))
        prompts = run["prompts"]
    except (OSError, ValueError, KeyError) as error:
        print(f"poss turns: error: {args.results} is not a poss bench results.json ({error})", file=sys.stderr)
        return 2
    table = split(prompts)
    env = run.get("environment", {})
    print(f"{env.get('cpu', '?')} (native bf16: {env.get('cpu_native_bf16', '?')}), {env.get('dtype', '?')}, "
          f"{env.get('threads', '?')} threads; {env.get('command', '')}\n")
    print(turn_table(table))
    if args.plot:
        print(f"\nwrote {plot_turns(table, env, args.plot)}")
    return 0


def add_subcommand(subparsers) -> None:
    parser = subparsers.add_parser("turns", help="split a poss bench run into new questions and follow-ups",
                                   description=__doc__.splitlines()[0])
    parser.add_argument("results", help="a results.json written by `poss bench --output-dir`")
    parser.add_argument("--plot", default=None, help="write a bar chart of the speedups here (PNG)")
    parser.set_defaults(func=run_turns)
