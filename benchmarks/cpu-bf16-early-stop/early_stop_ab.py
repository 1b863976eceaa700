"""Drafting with the early stop against drafting every level, interleaved in one process (real rounds, greedy).

    python benchmarks/cpu-bf16-early-stop/early_stop_ab.py --budget 2/4/4 --budget 6/4/6 --budget 6/4/12

"every level" patches `drafting.level_rank` to report no rank, so a draft runs all its levels; the trees are the same
either way (the script checks every answer). Each prompt (one MT-Bench first turn per category) runs every budget
with both paths, alternating which goes first; the shipped PosS-2 with its 8-bit weights, without the lookup branch.
The table gives median draft ms per round, the mean number of levels drafted per round, and bookkeeping.
"""

import argparse
import contextlib
import statistics

import torch

from transformers_poss import PosSDrafter
from transformers_poss.assets import default_drafter_path, load_default_target
from transformers_poss.evaluation.prompts import chat_prompt, load_prompt_sets
from transformers_poss.generation import drafting


@contextlib.contextmanager
def every_level():
    saved = drafting.level_rank
    drafting.level_rank = lambda scores, level_best: torch.zeros(scores.shape[0], dtype=torch.long)
    try:
        yield
    finally:
        drafting.level_rank = saved


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget", action="append", required=True, help="DEPTH/TOP_K/TOTAL[/DEEP_VOCAB]")
    parser.add_argument("--prompts", default="../shared/data/specbench/mt_bench.jsonl")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    args = parser.parse_args()
    torch.set_num_threads(2)
    target, tokenizer = load_default_target(dtype=torch.bfloat16)
    drafter = PosSDrafter.from_pretrained(default_drafter_path("poss2")).bind_target(target)
    questions = [q for qs in load_prompt_sets(args.prompts, per_category=1).values() for q in qs]
    prompts = [tokenizer(chat_prompt(tokenizer, q.turns[:1], []), return_tensors="pt").input_ids for q in questions]
    budgets = [[int(x) for x in b.split("/")] for b in args.budget]
    views = [drafter.with_generation_config(tree_depth=b[0], tree_top_k=b[1], tree_total_tokens=b[2],
                                            deep_draft_vocab=b[3] if len(b) > 3 else None, lookup_num_tokens=0,
                                            record_round_traces=True) for b in budgets]
    paths = ("every level", "early stop")
    found = {(i, p): {"draft": [], "book": [], "levels": [], "tokens": []} for i in range(len(budgets)) for p in paths}

    def run(ids, i, path, keep=True):
        with every_level() if path == "every level" else contextlib.nullcontext():
            out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens,
                                  do_sample=False, assistant_model=views[i], return_dict_in_generate=True)
        if keep:
            stats, record = out.speculative_stats, found[i, path]
            record["draft"] += stats.draft_seconds
            record["book"] += stats.bookkeeping_seconds
            record["levels"] += [int(t.candidates.depths.max()) for t in stats.round_traces if t.candidates is not None]
            record["tokens"].append(out.sequences[0, ids.shape[1]:])

    for i in range(len(budgets)):  # warm-up
        for path in paths:
            run(prompts[0][:, :16], i, path, keep=False)
    for n, ids in enumerate(prompts):
        for i in range(len(budgets)):
            for path in (paths if (n + i) % 2 == 0 else paths[::-1]):
                run(ids, i, path)
    print(f"{len(prompts)} prompts, {args.max_new_tokens} new tokens, bf16, {torch.get_num_threads()} threads, "
          "8-bit draft weights, no lookup branch")
    print("| depth / top-k / tokens | draft ms per round, every level | early stop | early / every | "
          "levels drafted per round | bookkeeping ms, every level | early stop | same answers |")
    print("|---|---|---|---|---|---|---|---|")
    for i, b in enumerate(budgets):
        e, s = found[i, paths[0]], found[i, paths[1]]
        de, ds = statistics.median(e["draft"]) * 1e3, statistics.median(s["draft"]) * 1e3
        same = sum(torch.equal(a, c) for a, c in zip(e["tokens"], s["tokens"]))
        print(f"| {'/'.join(map(str, b))} | {de:.1f} | {ds:.1f} | {ds / de:.2f} | "
              f"{statistics.mean(s['levels']):.2f} of {b[0]} | {statistics.median(e['book']) * 1e3:.2f} | "
              f"{statistics.median(s['book']) * 1e3:.2f} | {same}/{len(prompts)} |")


if __name__ == "__main__":
    main()
