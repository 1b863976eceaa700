"""Are this device's kernels row-invariant? Why speculative outputs can differ from plain `generate` in 16-bit.

    python benchmarks/scripts/row_invariance.py                        # the default target, bfloat16, 300-token context
    python benchmarks/scripts/row_invariance.py --dtype float32 --rows 8
    python benchmarks/scripts/row_invariance.py --device cuda --config FOLDER   # random weights of FOLDER's architecture

Verification computes `n` tree tokens in one forward, plain decoding one token per forward. Where a kernel gives a
row different bits depending on how many rows it runs with, the two part at near-ties of the argmax (the output stays
the target's up to that rounding; token identity needs every kernel below to print 0). For each distinct linear
shape of the target and for its attention, prints how many output elements of an `n`-row call differ from `n`
one-row calls, with the largest difference relative to the output's scale, then the same for whole forwards (logits
of `n` new tokens in one forward against `n` one-token forwards on the same cache). In fp32 most elements differ in
their last bits, far below argmax gaps; in bf16 few differ, but by a bf16 rounding step.
"""

import argparse
import copy

import torch
import torch.nn.functional as F
from measured_target import add_target_arguments, describe, load_measured_target
from transformers import DynamicCache


def _mismatches(trials: int, run) -> tuple[int, int, float]:
    """(differing elements, elements, largest difference relative to the largest magnitude) over `trials` calls of
    `run() -> (batched output, the same from one-row calls)`."""
    differing = total = 0
    largest = 0.0
    for _ in range(trials):
        batched, one_by_one = run()
        differing += int((batched != one_by_one).sum())
        total += batched.numel()
        gap = (batched.float() - one_by_one.float()).abs().max() / one_by_one.float().abs().max()
        largest = max(largest, float(gap))
    return differing, total, largest


def linear_mismatches(weight: torch.Tensor, rows: int, trials: int) -> tuple[int, int, float]:
    """`_mismatches` of `F.linear` on random `[rows, in]` against `rows` calls on `[1, in]`."""
    def run():
        x = torch.randn(rows, weight.shape[1], dtype=weight.dtype, device=weight.device)
        return F.linear(x, weight), torch.cat([F.linear(x[i : i + 1], weight) for i in range(rows)])

    return _mismatches(trials, run)


def attention_mismatches(config, context: int, rows: int, trials: int, dtype, device) -> tuple[int, int, float]:
    """The same for causal attention of `rows` new queries over `context` cached keys (GQA heads expanded)."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    allowed = torch.ones(rows, context + rows, dtype=torch.bool, device=device)
    allowed[:, context:] = torch.tril(allowed[:, context:])

    def run():
        q = torch.randn(1, heads, rows, head_dim, dtype=dtype, device=device)
        k, v = (torch.randn(1, heads, context + rows, head_dim, dtype=dtype, device=device) for _ in range(2))
        one_by_one = [F.scaled_dot_product_attention(q[:, :, i : i + 1], k[:, :, : context + i + 1],
                                                     v[:, :, : context + i + 1]) for i in range(rows)]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed), torch.cat(one_by_one, dim=2)

    return _mismatches(trials, run)


@torch.no_grad()
def forward_mismatches(target, context: int, rows: int, trials: int) -> tuple[int, int, float]:
    """(differing rows, rows, largest logit difference): one forward over `rows` new tokens against one-token ones."""
    differing = total = 0
    largest = 0.0
    vocab = target.config.vocab_size
    for _ in range(trials):
        prompt = torch.randint(0, vocab, (1, context), device=target.device)
        new = torch.randint(0, vocab, (1, rows), device=target.device)
        cache = DynamicCache(config=target.config)
        target(prompt, cache=cache, use_cache=True, logits_to_keep=1)
        step_cache = copy.deepcopy(cache)
        positions = torch.arange(context, context + rows, device=target.device)[None]
        batched = target(new, cache=cache, use_cache=True, position_ids=positions).logits[0].float()
        one_by_one = torch.cat([target(new[:, i : i + 1], cache=step_cache, use_cache=True,
                                       position_ids=positions[:, i : i + 1]).logits[0].float() for i in range(rows)])
        differing += int((batched != one_by_one).any(dim=-1).sum())
        total += rows
        largest = max(largest, float((batched - one_by_one).abs().max()))
    return differing, total, largest


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_target_arguments(parser, default_dtype="bfloat16")
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--rows", type=int, default=8, help="rows of the batched call (tree tokens)")
    parser.add_argument("--trials", type=int, default=20)
    args = parser.parse_args()
    target = load_measured_target(args)
    torch.manual_seed(0)
    config = target.config.get_text_config()
    weights = {}
    for name, module in target.named_modules():
        if isinstance(module, torch.nn.Linear):
            weights.setdefault(tuple(module.weight.shape), (name.split(".")[-1], module.weight.detach()))
    print("| operation | shape | differing / elements | per million | largest difference (relative) |\n"
          "|---|---|---|---|---|")
    rows = []
    for (out_features, in_features), (name, weight) in weights.items():
        trials = max(1, args.trials // 10) if out_features > 8 * in_features else args.trials  # the lm_head is big
        rows.append((f"linear ({name})", f"{in_features} -> {out_features}",
                     *linear_mismatches(weight, args.rows, trials)))
    rows.append(("attention", f"{args.rows} queries, {args.context} cached keys",
                 *attention_mismatches(config, args.context, args.rows, args.trials, target.dtype, target.device)))
    for operation, shape, differing, total, gap in rows:
        print(f"| {operation} | {shape} | {differing} / {total} | {1e6 * differing / total:.1f} | {gap:.1e} |")
    differing, total, largest = forward_mismatches(target, args.context, args.rows, max(1, args.trials // 4))
    print(f"\nwhole forwards ({target.dtype}, {describe(target)}): the logits of {differing} of {total} "
          f"tokens differ from one-token forwards, by at most {largest:.2g}; greedy outputs can part where the top two "
          "logits are closer than that")


if __name__ == "__main__":
    main()
