"""Where a real draft round's time goes: by phase of `draft_trees`, or by PyTorch operator (`--ops`).

Runs the shipped PosS-2 (its 8-bit draft weights) at one budget without the lookup branch on MT-Bench first turns,
bf16, and prints milliseconds per round for each phase (a specialist's call, split into catching up over new context
and running round nodes only; the draft head with log-softmax; projections; node bookkeeping; tree assembly) or, with
`--ops`, for each top-level operator called inside `draft_trees` (the rest is Python). One process, nothing else
running:

    python benchmarks/cpu-bf16-round-limits/draft_split.py --budget 6/4/6 [--ops]
"""

import argparse
import bisect
import collections
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile, record_function

import transformers_poss.generation.drafting as drafting
from transformers_poss import PosSDrafter
from transformers_poss.assets import default_drafter_path, load_default_target
from transformers_poss.evaluation.prompts import chat_prompt, load_prompt_sets
from transformers_poss.kernels import DraftLinear


def timed(owner, name, totals, counts, label=None):
    """Replace `owner.name` by a wrapper adding its wall time to `totals[label]`."""
    function = getattr(owner, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        result = function(*args, **kwargs)
        totals[label or name] += time.perf_counter() - start
        counts[label or name] += 1
        return result

    setattr(owner, name, wrapper)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget", default="6/4/6", help="DEPTH/TOP_K/TOTAL")
    parser.add_argument("--prompts", default="../shared/data/specbench/mt_bench.jsonl")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--ops", action="store_true", help="split by operator (torch profiler) instead of by phase")
    args = parser.parse_args()
    torch.set_num_threads(2)
    depth, top_k, total = (int(part) for part in args.budget.split("/"))
    target, tokenizer = load_default_target(dtype=torch.bfloat16)
    drafter = PosSDrafter.from_pretrained(default_drafter_path("poss2")).bind_target(target)
    view = drafter.with_generation_config(tree_depth=depth, tree_top_k=top_k, tree_total_tokens=total,
                                          lookup_num_tokens=0, record_round_traces=True)
    questions = [q for qs in load_prompt_sets(args.prompts, per_category=1).values() for q in qs]
    prompts = [tokenizer(chat_prompt(tokenizer, q.turns[:1], []), return_tensors="pt").input_ids for q in questions]

    totals, counts = collections.defaultdict(float), collections.defaultdict(int)
    if not args.ops:
        run = drafting.DraftSession.run

        def run_split(session, specialist):
            kind = "catch-up" if (session.context_cached[specialist] or [0]) != session.lengths else "nodes"
            start = time.perf_counter()
            result = run(session, specialist)
            totals[f"specialist {specialist} ({kind})"] += time.perf_counter() - start
            counts[f"specialist {specialist} ({kind})"] += 1
            return result

        drafting.DraftSession.run = run_split
        for name in ("add_nodes", "begin_round"):
            timed(drafting.DraftSession, name, totals, counts)
        for name in ("_log_probs", "level_rank", "_make_tree", "select_candidates"):
            timed(drafting, name, totals, counts)
        timed(type(drafter), "project", totals, counts)
    draft_trees = drafting.draft_trees

    def draft_trees_timed(*a, **k):
        start = time.perf_counter()
        with record_function("draft_trees"):
            result = draft_trees(*a, **k)
        totals["draft_trees (all)"] += time.perf_counter() - start
        counts["draft_trees (all)"] += 1
        return result

    drafting.draft_trees = draft_trees_timed

    def generate(ids):
        with torch.no_grad():
            return target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens,
                                   do_sample=False, assistant_model=view, return_dict_in_generate=True)

    generate(prompts[0][:, :16])  # warm-up
    for module in drafter.modules():  # every 8-bit copy made before timing (a short warm-up skips deep specialists)
        if isinstance(module, DraftLinear):
            module.int8_copy()
    drafter.mapped_head_rows(int8=True)
    totals.clear()
    counts.clear()
    rounds, levels = 0, []
    profiler = profile(activities=[ProfilerActivity.CPU]) if args.ops else None
    if profiler:
        profiler.__enter__()
    for ids in prompts:
        stats = generate(ids).speculative_stats
        rounds += len(stats.acceptance_lengths)
        levels += [int(t.candidates.depths.max()) for t in stats.round_traces if t.candidates is not None]
    if profiler:
        profiler.__exit__(None, None, None)
    print(f"budget {args.budget}: {len(prompts)} prompts, {rounds} rounds, {statistics.fmean(levels):.2f} levels drafted "
          f"per round, draft_trees {1e3 * totals['draft_trees (all)'] / rounds:.2f} ms per round")
    if not args.ops:
        print("| phase | ms per round | calls per round | ms per call |\n|---|---|---|---|")
        for name in sorted(totals, key=lambda n: -totals[n]):
            print(f"| {name} | {1e3 * totals[name] / rounds:.3f} | {counts[name] / rounds:.2f} | "
                  f"{1e3 * totals[name] / counts[name]:.3f} |")
        return
    events = profiler.events()
    ranges = sorted((e.time_range.start, e.time_range.end) for e in events if e.name == "draft_trees")
    starts = [start for start, _ in ranges]
    op_totals, op_counts = collections.defaultdict(float), collections.defaultdict(int)
    for event in events:
        if not event.name.startswith("aten::") or (event.cpu_parent is not None
                                                    and event.cpu_parent.name.startswith("aten::")):
            continue
        i = bisect.bisect_right(starts, event.time_range.start) - 1
        if i >= 0 and event.time_range.end <= ranges[i][1]:
            op_totals[event.name] += event.cpu_time_total
            op_counts[event.name] += 1
    inside = sum(end - start for start, end in ranges)
    print(f"top-level operators {sum(op_totals.values()) / 1e3 / rounds:.2f} ms per round of "
          f"{inside / 1e3 / rounds:.2f} (profiled)")
    print("| operator | ms per round | calls per round | us per call |\n|---|---|---|---|")
    for name in sorted(op_totals, key=lambda n: -op_totals[n])[:16]:
        print(f"| {name} | {op_totals[name] / 1e3 / rounds:.3f} | {op_counts[name] / rounds:.2f} | "
              f"{op_totals[name] / op_counts[name]:.1f} |")


if __name__ == "__main__":
    main()
