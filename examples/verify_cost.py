"""How much does verifying a tree of n tokens cost on this machine, relative to one decode step?

    python examples/verify_cost.py                      # the default target, fp32, 300-token context
    python examples/verify_cost.py --dtype bfloat16 --sizes 1,8,16,32,64

Prints the median time of one target forward over `n` new tokens on top of a cached context; the ratio to n=1 is
what a draft tree of that size costs in decode steps (speculation pays only when tau exceeds it plus drafting).
"""

import argparse
import time

import torch
from transformers import DynamicCache

from transformers_poss.assets import DTYPES, load_default_target, resolve_dtype


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="auto")
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--sizes", default="1,4,8,16,32")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    target, _ = load_default_target(dtype=resolve_dtype(args.dtype))
    context = torch.randint(0, target.config.vocab_size, (1, args.context))
    results = {}
    with torch.no_grad():
        for n in (int(s) for s in args.sizes.split(",")):
            times = []
            for _ in range(args.repeats):
                cache = DynamicCache(config=target.config)
                target(context, cache=cache, use_cache=True, logits_to_keep=1)
                new = torch.randint(0, target.config.vocab_size, (1, n))
                start = time.perf_counter()
                target(new, cache=cache, use_cache=True, position_ids=torch.arange(args.context, args.context + n)[None])
                times.append(time.perf_counter() - start)
            results[n] = sorted(times)[len(times) // 2]
    base = results[min(results)]
    print(f"| new tokens | ms (median of {args.repeats}) | decode steps |\n|---|---|---|")
    for n, seconds in results.items():
        print(f"| {n} | {seconds * 1e3:.1f} | {seconds / base:.2f} |")


if __name__ == "__main__":
    main()
