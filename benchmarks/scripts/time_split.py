"""Where does the time of a speculative `generate` go? Per-round draft / verify / bookkeeping split.

Runs on a tiny random Llama target with a freshly initialised PosS drafter (seconds, no downloads), or on a real
target and drafter given as paths:

    python benchmarks/scripts/time_split.py
    python benchmarks/scripts/time_split.py --target PATH --drafter PATH --prompt "Explain KV caches." --max-new-tokens 64
"""

import argparse

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from transformers_poss import PosSDrafter


def tiny_setup():
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                         num_hidden_layers=4, vocab_size=512)
    target = LlamaForCausalLM(config).eval()
    drafter = PosSDrafter.from_target(target, num_specialists=3, positions_per_specialist=2)
    return target, drafter, torch.randint(0, 512, (1, 24))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", help="target model folder (default: a tiny random Llama)")
    parser.add_argument("--drafter", help="PosS drafter folder (required with --target)")
    parser.add_argument("--prompt", default="Write a haiku about caches.")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--mode", choices=["tree", "chain"], default="tree")
    args = parser.parse_args()
    if args.target:
        target = AutoModelForCausalLM.from_pretrained(args.target).eval()
        tokenizer = AutoTokenizer.from_pretrained(args.target)
        drafter = PosSDrafter.from_pretrained(args.drafter)
        input_ids = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}],
                                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    else:
        target, drafter, input_ids = tiny_setup()
    out = target.generate(input_ids, max_new_tokens=args.max_new_tokens, do_sample=False,
                          assistant_model=drafter.with_generation_config(draft_mode=args.mode),
                          return_dict_in_generate=True)
    stats = out.speculative_stats
    print(f"{'round':>5} {'tree':>5} {'accepted':>8} {'draft ms':>9} {'verify ms':>9} {'bookkeep ms':>11}")
    for i, (size, accepted, d, v, b) in enumerate(zip(stats.tree_sizes, stats.acceptance_lengths, stats.draft_seconds,
                                                      stats.verify_seconds, stats.bookkeeping_seconds)):
        print(f"{i:>5} {size:>5} {accepted:>8} {d * 1e3:>9.2f} {v * 1e3:>9.2f} {b * 1e3:>11.2f}")
    split = stats.time_split()
    total = sum(split.values())
    print("total: " + ", ".join(f"{name} {seconds * 1e3:.1f} ms ({seconds / total:.0%})" for name, seconds in split.items()))
    print(f"tau {stats.mean_acceptance_length:.2f}; alpha " + " ".join(f"{a:.2f}" for a in stats.position_acceptance))


if __name__ == "__main__":
    main()
