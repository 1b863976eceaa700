"""Lean draft rounds against the earlier eager path, interleaved in one process (real rounds, greedy, no lookup).

    python benchmarks/cpu-bf16-lean-specialists/lean_ab.py --budget 2/4/4 --budget 6/4/12/4096

"earlier" switches off, by patching the library for that call only, two changes of this run: the lean specialist
forward (`runs_lean`) and RoPE rows from a table (`_rope_table_allowed`); the per-round mask buffer stays in both. Each prompt runs every budget with both
paths, alternating which goes first; the table gives median draft ms per round and per depth, and bookkeeping.
`--repeated` instead drafts the same tree over and over on one 300-token context (as
`benchmarks/scripts/draft_profile.py`), alternating the paths round by round.
"""

import argparse
import contextlib
import statistics
import time

import torch

from transformers_poss import PosSDrafter, modeling_poss
from transformers_poss.assets import default_drafter_path, load_default_target
from transformers_poss.evaluation.prompts import chat_prompt, load_prompt_sets
from transformers_poss.generation.drafting import DraftSession, draft_tree


@contextlib.contextmanager
def earlier_path(drafter):
    saved = modeling_poss.runs_lean, drafter._rope_table_allowed
    modeling_poss.runs_lean = lambda attention: False
    drafter._rope_table_allowed = False
    try:
        yield
    finally:
        modeling_poss.runs_lean, drafter._rope_table_allowed = saved


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget", action="append", required=True, help="DEPTH/TOP_K/TOTAL[/DEEP_VOCAB]")
    parser.add_argument("--prompts", default="../shared/data/specbench/mt_bench.jsonl")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--repeated", action="store_true", help="repeated rounds on one context instead")
    args = parser.parse_args()
    torch.set_num_threads(2)
    target, tokenizer = load_default_target(dtype=torch.bfloat16)
    drafter = PosSDrafter.from_pretrained(default_drafter_path("poss2")).bind_target(target)
    if args.repeated:
        return repeated_rounds(target, tokenizer, drafter, args.budget)
    questions = [q for qs in load_prompt_sets(args.prompts, per_category=1).values() for q in qs]
    prompts = [tokenizer(chat_prompt(tokenizer, q.turns[:1], []), return_tensors="pt").input_ids for q in questions]
    budgets = [[int(x) for x in b.split("/")] for b in args.budget]
    views = [drafter.with_generation_config(tree_depth=b[0], tree_top_k=b[1], tree_total_tokens=b[2],
                                            deep_draft_vocab=b[3] if len(b) > 3 else None, lookup_num_tokens=0,
                                            int8_draft_weights=True) for b in budgets]
    found = {(i, path): {"draft": [], "book": [], "tokens": []} for i in range(len(budgets)) for path in ("earlier", "lean")}

    def run(ids, view, i, path):
        with earlier_path(drafter) if path == "earlier" else contextlib.nullcontext():
            out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens,
                                  do_sample=False, assistant_model=view, return_dict_in_generate=True)
        if found is not None and ids.shape[1] > 16:
            found[i, path]["draft"] += out.speculative_stats.draft_seconds
            found[i, path]["book"] += out.speculative_stats.bookkeeping_seconds
            found[i, path]["tokens"].append(out.sequences[0, ids.shape[1]:])

    for i, view in enumerate(views):  # warm-up
        run(prompts[0][:, :16], view, i, "earlier"), run(prompts[0][:, :16], view, i, "lean")
    for n, ids in enumerate(prompts):
        for i, view in enumerate(views):
            for path in (("earlier", "lean") if (n + i) % 2 == 0 else ("lean", "earlier")):
                run(ids, view, i, path)
    print(f"{len(prompts)} prompts, {args.max_new_tokens} new tokens, bf16, 2 threads, 8-bit draft weights")
    print("| depth / top-k / tokens | draft ms per round (per depth), earlier | lean | lean / earlier | "
          "bookkeeping ms, earlier | lean | same answers |")
    print("|---|---|---|---|---|---|---|")
    for i, b in enumerate(budgets):
        e, l = found[i, "earlier"], found[i, "lean"]
        de, dl = statistics.median(e["draft"]) * 1e3, statistics.median(l["draft"]) * 1e3
        same = sum(torch.equal(a, c) for a, c in zip(e["tokens"], l["tokens"]))
        print(f"| {'/'.join(map(str, b))} | {de:.1f} ({de / b[0]:.2f}) | {dl:.1f} ({dl / b[0]:.2f}) | {dl / de:.2f} | "
              f"{statistics.median(e['book']) * 1e3:.2f} | {statistics.median(l['book']) * 1e3:.2f} | "
              f"{same}/{len(prompts)} |")


def repeated_rounds(target, tokenizer, drafter, budgets, rounds=100):
    text = "Explain in detail how a CPU cache hierarchy works and why it matters for performance. " * 8
    ids = tokenizer(text, return_tensors="pt").input_ids[:, :300]
    with torch.no_grad():
        out = target(input_ids=ids[:, :-1], output_hidden_states=drafter.config.input_feature_layers, logits_to_keep=1)
    session = DraftSession(drafter)
    session.commit(drafter.target_features(out.hidden_states)[0], ids[0, 1:])
    print(f"repeated rounds on one 300-token context, {rounds} per path, alternating; bf16, 2 threads, 8-bit weights")
    print("| depth / top-k / tokens | draft ms per round (per depth), earlier | lean | lean / earlier |")
    print("|---|---|---|---|")
    with drafter.int8_weights():
        for budget in budgets:
            b = [int(x) for x in budget.split("/")]
            times = {"earlier": [], "lean": []}
            for n in range(rounds + 10):
                for path in ("earlier", "lean") if n % 2 else ("lean", "earlier"):
                    with earlier_path(drafter) if path == "earlier" else contextlib.nullcontext():
                        start = time.perf_counter()
                        draft_tree(session, ids[0, -1], b[0], b[1], b[2], b[3] if len(b) > 3 else None)
                        session.end_round()
                        if n >= 10:
                            times[path].append(time.perf_counter() - start)
            e, l = (statistics.median(times[p]) * 1e3 for p in ("earlier", "lean"))
            print(f"| {budget} | {e:.2f} ({e / b[0]:.2f}) | {l:.2f} ({l / b[0]:.2f}) | {l / e:.2f} |")


if __name__ == "__main__":
    main()
