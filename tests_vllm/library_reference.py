"""The library side of the vLLM tests (run with the main environment's python, not vLLM's).

    python tests_vllm/library_reference.py --drafter DIR --depths 3 6 --max-new-tokens 96 --output ref.json

For each chat prompt of `PROMPTS` (the default target's chat template, fp32, greedy) it writes the prompt's token
ids, plain `generate`'s answer ids, and per chain depth K the rounds' accepted draft counts of this library's chain
mode (`drafter.with_generation_config(draft_mode="chain", tree_depth=K)` through `target.generate(...,
assistant_model=...)`) and its per-position acceptance alpha_1..alpha_K over all prompts (`transformers_poss.metrics`).
"""

from __future__ import annotations

import argparse
import json

PROMPTS = [
    "What is the capital of France? Answer in two sentences.",
    "Write a haiku about the sea.",
    "Explain what a hash table is to a beginner.",
    "List three tips for staying focused while studying.",
    "Translate 'good morning, how are you?' into Spanish and French.",
    "Write a short Python function that checks whether a number is prime.",
]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drafter", default="poss2", help="a drafter folder, or 'poss2' / 'single' (shipped)")
    parser.add_argument("--depths", type=int, nargs="+", default=[3, 6])
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--output", required=True)
    args = parser.parse_args(argv)

    import torch

    from transformers_poss import PosSDrafter
    from transformers_poss.assets import default_drafter_path, load_default_target
    from transformers_poss.metrics import position_acceptance_from_counts, rounds_accepting_at_least

    torch.manual_seed(0)
    target, tokenizer = load_default_target(dtype=torch.float32)
    path = default_drafter_path(args.drafter) if args.drafter in ("poss2", "single") else args.drafter
    drafter = PosSDrafter.from_pretrained(path).to(torch.float32)
    if hasattr(drafter, "int8_draft_weights"):  # full-precision drafting, as vLLM's (a setting of the drafter)
        drafter.int8_draft_weights = False
    result = {"prompts": [], "depths": {}}
    for prompt in PROMPTS:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)["input_ids"]
        with torch.no_grad():
            plain = target.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False)
        result["prompts"].append({"text": prompt, "prompt_ids": ids[0].tolist(),
                                  "plain_ids": plain[0, ids.shape[1]:].tolist()})
    for depth in args.depths:
        settings = {"draft_mode": "chain", "tree_depth": depth, "lookup_num_tokens": 0}
        if "int8_draft_weights" in getattr(drafter.generation_config, "POSS_DEFAULTS", {}):
            settings["int8_draft_weights"] = False
        view = drafter.with_generation_config(**settings)
        lengths, same = [], []
        for entry in result["prompts"]:
            ids = torch.tensor([entry["prompt_ids"]])
            with torch.no_grad():
                out = target.generate(ids, assistant_model=view, max_new_tokens=args.max_new_tokens, do_sample=False,
                                      return_dict_in_generate=True)
            lengths.append(list(out.speculative_stats.acceptance_lengths))
            same.append(out.sequences[0, ids.shape[1]:].tolist() == entry["plain_ids"])
        flat = [a for row in lengths for a in row]
        counts = rounds_accepting_at_least(flat, depth)
        result["depths"][str(depth)] = {
            "acceptance_lengths": lengths, "at_least": counts,
            "alpha": position_acceptance_from_counts(counts),
            "tau": sum(a + 1 for a in flat) / len(flat), "identical_to_plain": same,
        }
        print(f"library chain K={depth}: alpha {[round(a, 3) for a in result['depths'][str(depth)]['alpha']]}, "
              f"tau {result['depths'][str(depth)]['tau']:.3f}, rounds {len(flat)}")
    with open(args.output, "w", encoding="utf-8") as handle:
        json.dump(result, handle, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
