"""How the shipped PosS-2's prompt-lookup branch fares, round by round, on the README's 16 MT-Bench turns.

Runs the README benchmark's conversations (first 8 MT-Bench questions, both turns, 128 new tokens, bf16, greedy;
later turns see the drafter's own earlier answers) with the shipped drafter as it is and counts, per turn kind, the
rounds that graft a branch, the nodes it appends to the drafted tree and the tokens accepted from those nodes:

    python benchmarks/cpu-bf16-round-limits/branch_stats.py
"""

import collections
import statistics

import torch

import transformers_poss.generation.tree_decoding as tree_decoding
from transformers_poss import PosSDrafter
from transformers_poss.assets import default_drafter_path, load_default_target
from transformers_poss.evaluation.prompts import chat_prompt, load_prompt_sets


def main() -> None:
    torch.set_num_threads(2)
    target, tokenizer = load_default_target(dtype=torch.bfloat16)
    drafter = PosSDrafter.from_pretrained(default_drafter_path("poss2")).bind_target(target)
    questions = load_prompt_sets("../shared/data/specbench/mt_bench.jsonl", limit=8)["mt_bench"]
    grafts = []  # per grafted round: [drafted nodes, branch length, appended nodes, accepted, accepted from appended]
    graft_branch, accept_greedy = tree_decoding.graft_branch, tree_decoding._accept_greedy

    def graft(tree, tokens):
        grafted = graft_branch(tree, tokens)
        grafts.append([len(tree), tokens.shape[0], len(grafted) - len(tree)])
        return grafted

    def accept(processed, tree):
        path, next_token = accept_greedy(processed, tree)
        if grafts and len(grafts[-1]) == 3:
            grafts[-1] += [len(path) - 1, sum(1 for node in path[1:] if node >= grafts[-1][0])]
        return path, next_token

    tree_decoding.graft_branch, tree_decoding._accept_greedy = graft, accept
    by_turn = collections.defaultdict(lambda: {"rounds": 0, "grafts": []})
    for question in questions:
        answers = []
        for turn in range(len(question.turns)):
            ids = tokenizer(chat_prompt(tokenizer, question.turns, answers), add_special_tokens=False,
                            return_tensors="pt").input_ids
            first = len(grafts)
            with torch.no_grad():
                out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=128, do_sample=False,
                                      assistant_model=drafter, return_dict_in_generate=True)
            answers.append(tokenizer.decode(out.sequences[0, ids.shape[1]:], skip_special_tokens=True))
            by_turn[turn]["rounds"] += len(out.speculative_stats.acceptance_lengths)
            by_turn[turn]["grafts"] += [g for g in grafts[first:] if g[1] > 0]
    print("| turn | rounds | rounds with a branch | branch tokens | appended nodes | accepted per round | "
          "accepted from appended nodes | rounds accepting none of them |")
    print("|---|---|---|---|---|---|---|---|")
    for turn, found in sorted(by_turn.items()):
        g = found["grafts"]
        print(f"| {'first' if turn == 0 else 'follow-up'} | {found['rounds']} | {len(g)} | "
              f"{statistics.fmean(r[1] for r in g):.2f} | {statistics.fmean(r[2] for r in g):.2f} | "
              f"{statistics.fmean(r[3] for r in g):.2f} | {statistics.fmean(r[4] for r in g):.2f} | "
              f"{sum(1 for r in g if r[4] == 0)} |")
    for turn, found in sorted(by_turn.items()):
        counts = sorted(collections.Counter(r[4] for r in found["grafts"]).items())
        print(f"{'first' if turn == 0 else 'follow-up'} turns, tokens accepted from appended nodes: rounds {counts}")


if __name__ == "__main__":
    main()
