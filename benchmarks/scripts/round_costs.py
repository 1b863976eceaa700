"""Where a speculative round's time goes: drafting per depth, verification in decode steps, bookkeeping.

Runs the shipped PosS-2 drafter (or `--drafter`) on the default target over chat prompts for several tree budgets
(without the prompt-lookup branch) and plain greedy decoding, each prompt
through plain decoding and then every budget, and prints one row per budget: tau, median draft ms per round and per
level drafted (drafting stops early where deeper nodes could not enter the tree), median verify ms and decode steps,
median bookkeeping ms, tokens/s and speedup over plain decoding. `--json` writes the rows. Greedy, one process,
nothing else running:

    python benchmarks/scripts/round_costs.py --dtype bfloat16 --threads 2 --prompts ../shared/data/specbench/mt_bench.jsonl
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from transformers_poss.assets import default_drafter_path, load_default_target, load_drafter, resolve_dtype
from transformers_poss.generation.decoding import observe_rounds
from transformers_poss.evaluation.prompts import chat_prompt, load_prompt_sets

BUDGETS = ((2, 4, 4), (4, 4, 8), (6, 4, 12), (6, 10, 60))


def _budget(text: str) -> tuple[int, int, int]:
    parts = [int(part) for part in text.split("/")]
    if len(parts) != 3:
        raise argparse.ArgumentTypeError(f"expected DEPTH/TOP_K/TOTAL, got {text!r}")
    return tuple(parts)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", help="drafter folder (default: the shipped PosS-2)")
    parser.add_argument("--prompts", required=True, help="prompt set (jsonl); first turns are used")
    parser.add_argument("--per-category", type=int, default=1, help="questions per category (default 1)")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--budget", action="append", type=_budget,
                        help="DEPTH/TOP_K/TOTAL (repeatable; default 2/4/4 4/4/8 6/4/12 6/10/60)")
    parser.add_argument("--int8-draft-weights", action=argparse.BooleanOptionalAction, default=None,
                        help="draft with 8-bit weight copies (default: the drafter's shipped choice)")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    target, tokenizer = load_default_target(dtype=resolve_dtype(args.dtype))
    drafter = load_drafter(args.drafter or default_drafter_path("poss2"),
                           int8_draft_weights=args.int8_draft_weights)
    questions = [q for qs in load_prompt_sets(args.prompts, per_category=args.per_category).values() for q in qs]
    prompts = [tokenizer(chat_prompt(tokenizer, q.turns[:1], []), return_tensors="pt").input_ids for q in questions]

    def generate(ids, assistant=None, traces=None):
        start = time.perf_counter()
        with torch.no_grad(), observe_rounds(None if traces is None else traces.append):
            out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens,
                                  do_sample=False, assistant_model=assistant, return_dict_in_generate=True)
        return out, time.perf_counter() - start

    budgets = args.budget or BUDGETS
    views = [drafter.with_generation_config(tree_depth=depth, tree_top_k=top_k, tree_total_tokens=total,
                                            lookup_num_tokens=0, draft_mode="tree")
             for depth, top_k, total in budgets]
    generate(prompts[0][:, :16])  # warm-ups
    for view in views:
        generate(prompts[0][:, :16], view)
    # Each prompt runs plain decoding and then every budget, so a drifting machine speed moves them alike.
    decode_times = []
    found = [{"draft": [], "verify": [], "bookkeeping": [], "lengths": [], "levels": [], "tokens": 0, "seconds": 0.0}
             for _ in views]
    for ids in prompts:
        out, elapsed = generate(ids)
        decode_times.append(elapsed / (out.sequences.shape[1] - ids.shape[1]))
        for view, acc in zip(views, found):
            traces = []
            out, elapsed = generate(ids, view, traces)
            stats = out.speculative_stats
            acc["draft"] += stats.draft_seconds
            acc["verify"] += stats.verify_seconds
            acc["bookkeeping"] += stats.bookkeeping_seconds
            acc["lengths"] += stats.acceptance_lengths
            acc["levels"] += [int(t.candidates.depths.max()) for t in traces if t.candidates is not None]
            acc["tokens"] += out.sequences.shape[1] - ids.shape[1]
            acc["seconds"] += elapsed
    decode = statistics.median(decode_times)
    rows = []
    for (depth, top_k, total), acc in zip(budgets, found):
        draft, verify = statistics.median(acc["draft"]), statistics.median(acc["verify"])
        levels = statistics.fmean(acc["levels"])
        rows.append({
            "budget": f"{depth}/{top_k}/{total}",
            "tau": statistics.fmean(acc["lengths"]) + 1,
            "draft_ms": 1e3 * draft, "levels_drafted": levels, "draft_ms_per_level": 1e3 * draft / levels,
            "verify_ms": 1e3 * verify, "verify_decode_steps": verify / decode,
            "bookkeeping_ms": 1e3 * statistics.median(acc["bookkeeping"]),
            "tokens_per_s": acc["tokens"] / acc["seconds"], "speedup": acc["tokens"] / acc["seconds"] * decode,
            "rounds": len(acc["lengths"]),
        })
    print(f"plain decoding {decode * 1e3:.1f} ms per token; {len(prompts)} prompts, {args.max_new_tokens} new tokens")
    print("| depth / top-k / tokens | tau | levels drafted | draft ms per round (per level) | verify ms (decode steps) | "
          "bookkeeping ms | tokens/s | speedup |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['budget']} | {r['tau']:.2f} | {r['levels_drafted']:.2f} | {r['draft_ms']:.1f} "
              f"({r['draft_ms_per_level']:.2f}) | "
              f"{r['verify_ms']:.1f} ({r['verify_decode_steps']:.2f}) | {r['bookkeeping_ms']:.2f} | "
              f"{r['tokens_per_s']:.1f} | {r['speedup']:.2f}x |")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump({"decode_ms_per_token": decode * 1e3, "rows": rows, "prompts": len(prompts),
                       "max_new_tokens": args.max_new_tokens, "dtype": args.dtype, "threads": args.threads}, handle,
                      indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
