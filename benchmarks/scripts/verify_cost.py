"""How much does verifying a tree of n tokens cost on this machine, relative to one decode step?

    python benchmarks/scripts/verify_cost.py                      # the default target, fp32, 300-token context
    python benchmarks/scripts/verify_cost.py --dtype bfloat16 --sizes 1,8,16,32,64
    python benchmarks/scripts/verify_cost.py --dtype bfloat16 --lm-head --sizes 1,2,4,8,14
    python benchmarks/scripts/verify_cost.py --device cuda --config FOLDER   # random weights of FOLDER's architecture

Prints the median time of one target forward over `n` new tokens on top of a cached context; the ratio to n=1 is
what a draft tree of that size costs in decode steps (speculation pays only when tau exceeds it plus drafting).
With `--lm-head`, times the target's `lm_head` on `n` rows instead: verification projects every tree node in one
pass where that costs little more than one row (`keeps_every_tree_row` in `transformers_poss.generation`).
"""

import argparse
import time

import torch
from measured_target import add_target_arguments, describe, load_measured_target, synchronize
from transformers import DynamicCache


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_target_arguments(parser, default_dtype="auto")
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--sizes", default="1,4,8,16,32")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--lm-head", action="store_true", help="time the lm_head on n rows instead of a forward")
    args = parser.parse_args()
    target = load_measured_target(args)
    device = target.device
    context = torch.randint(0, target.config.vocab_size, (1, args.context), device=device)
    results = {}
    with torch.no_grad():
        for n in (int(s) for s in args.sizes.split(",")):
            if args.lm_head:
                results[n] = _median_lm_head_seconds(target, n, args.repeats)
                continue
            times = []
            for _ in range(args.repeats):
                cache = DynamicCache(config=target.config)
                target(context, cache=cache, use_cache=True, logits_to_keep=1)
                new = torch.randint(0, target.config.vocab_size, (1, n), device=device)
                positions = torch.arange(args.context, args.context + n, device=device)[None]
                synchronize(device)
                start = time.perf_counter()
                target(new, cache=cache, use_cache=True, position_ids=positions)
                synchronize(device)
                times.append(time.perf_counter() - start)
            results[n] = sorted(times)[len(times) // 2]
    base = results[min(results)]
    unit = "rows | ms" if args.lm_head else "new tokens | ms"
    print(f"{target.dtype}, {describe(target)}, {args.context}-token context\n"
          f"| {unit} (median of {args.repeats}) | ratio to {min(results)} |\n|---|---|---|")
    for n, seconds in results.items():
        print(f"| {n} | {seconds * 1e3:.1f} | {seconds / base:.2f} |")


def _median_lm_head_seconds(target, rows: int, repeats: int) -> float:
    """Median time of the target's `lm_head` on `rows` hidden states, logits to float32 and argmax included."""
    head = target.get_output_embeddings()
    times = []
    for _ in range(repeats):
        hidden = torch.randn(rows, head.in_features, dtype=head.weight.dtype, device=head.weight.device)
        synchronize(hidden.device)
        start = time.perf_counter()
        head(hidden).float().argmax(dim=-1)
        synchronize(hidden.device)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


if __name__ == "__main__":
    main()
