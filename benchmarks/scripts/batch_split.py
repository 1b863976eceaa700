"""Where a batched speculative round's time goes: the shipped PosS-2 on the default target (bf16, 2 threads), one
left-padded batch of MT-Bench first turns (one per category), greedy, at batch sizes 1 and 8:

    python benchmarks/scripts/batch_split.py --lookup-tokens 10      # the shipped lookup branch; 0 turns it off

Prints per round the drafting time of all rows, the shared verification forward, bookkeeping and the rest of the
call (prefill, output), summed over the rows' records (`out.row_stats`).
"""

import argparse
import time

import torch

from transformers_poss.assets import load_default_drafter, load_default_target
from transformers_poss.evaluation.prompts import chat_prompt, load_prompt_sets


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", default="../shared/data/specbench/mt_bench.jsonl")
    parser.add_argument("--lookup-tokens", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--budget", default=None, help="DEPTH/TOP_K/TOTAL instead of the drafter's own")
    args = parser.parse_args()
    torch.set_num_threads(2)
    target, tokenizer = load_default_target(dtype=torch.bfloat16)
    drafter = load_default_drafter("poss2", target).with_generation_config(lookup_num_tokens=args.lookup_tokens)
    if args.budget:
        depth, top_k, total = (int(part) for part in args.budget.split("/"))
        drafter = drafter.with_generation_config(tree_depth=depth, tree_top_k=top_k, tree_total_tokens=total)
    questions = [q for qs in load_prompt_sets(args.prompts, per_category=1).values() for q in qs]
    texts = [chat_prompt(tokenizer, q.turns, []) for q in questions]
    for size in (int(part) for part in args.batch_sizes.split(",")):
        batch = tokenizer(texts[:size], padding=True, padding_side="left", return_tensors="pt",
                          add_special_tokens=False)
        with torch.no_grad():
            target.generate(**batch, max_new_tokens=8, do_sample=False, assistant_model=drafter)  # warm-up
            start = time.perf_counter()
            out = target.generate(**batch, max_new_tokens=args.max_new_tokens, do_sample=False,
                                  assistant_model=drafter, return_dict_in_generate=True)
            wall = time.perf_counter() - start
            start = time.perf_counter()
            plain = target.generate(**batch, max_new_tokens=args.max_new_tokens, do_sample=False)
            plain_wall = time.perf_counter() - start
        plain_steps = plain.shape[1] - batch["input_ids"].shape[1]
        rows = out.row_stats or [out.speculative_stats]
        rounds = max(len(row.acceptance_lengths) for row in rows)
        parts = {name: sum(sum(getattr(row, f"{name}_seconds")) for row in rows)
                 for name in ("draft", "verify", "bookkeeping")}
        other = wall - sum(parts.values())
        print(f"batch {size}: {wall:.1f} s, {rounds} rounds, tau {out.speculative_stats.mean_acceptance_length:.2f}; "
              "per round " + ", ".join(f"{name} {seconds / rounds * 1e3:.1f} ms" for name, seconds in parts.items())
              + f", other {other / rounds * 1e3:.1f} ms; plain generate {plain_wall:.1f} s, {plain_steps} steps, "
              f"{plain_wall / plain_steps * 1e3:.1f} ms per step")


if __name__ == "__main__":
    main()
