"""A prototype, not part of the library: 4-bit draft weights against the shipped 8-bit ones, in real rounds.

Patches `modeling_poss.pack_int8` / `int8_product` so that a second copy of the shipped PosS-2 multiplies with 4-bit
weights (asymmetric, one scale and zero per `--group` inputs, `torch.ops.aten._weight_int4pack_mm_for_cpu`) wherever
the 8-bit path runs; weights whose output count is not a multiple of 16 (the head map's 577 rows) stay 8-bit.
`--max-rows` sets `INT8_MAX_ROWS` for both. MT-Bench first turns, no lookup branch, bf16, 2 threads; per prompt plain
decoding, then both drafters in alternating order. Prints tau, median draft ms per round, speedup and identical
answers for each:

    python benchmarks/cpu-bf16-round-limits/weight_bits_ab.py --budget 2/4/4 --budget 6/4/6
"""

import argparse
import statistics
import time

import torch

import transformers_poss.modeling_poss as modeling
from transformers_poss import PosSDrafter
from transformers_poss.assets import default_drafter_path, load_default_target
from transformers_poss.evaluation.prompts import chat_prompt, load_prompt_sets

PACK_8BIT, PRODUCT_8BIT = modeling.pack_int8, modeling.int8_product


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget", action="append", help="DEPTH/TOP_K/TOTAL (repeatable)")
    parser.add_argument("--group", type=int, default=32, help="inputs per 4-bit scale and zero")
    parser.add_argument("--max-rows", type=int, default=4, help="INT8_MAX_ROWS for both")
    parser.add_argument("--prompts", default="../shared/data/specbench/mt_bench.jsonl")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    args = parser.parse_args()
    torch.set_num_threads(2)
    bits = [8]

    def pack(weight):
        if bits[0] == 8 or weight.shape[0] % 16 or weight.shape[1] % args.group:
            return PACK_8BIT(weight)
        out_features, in_features = weight.shape
        grouped = weight.detach().float().reshape(out_features, in_features // args.group, args.group)
        low, high = grouped.amin(-1, keepdim=True), grouped.amax(-1, keepdim=True)
        scale = (high - low).clamp(min=1e-8) / 15
        values = torch.round((grouped - low) / scale).clamp(0, 15).to(torch.int32).reshape(out_features, in_features)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(values, 1)
        # the kernel computes (q - 8) * scale + zero: zero = low + 8 * scale; layout [in / group, out, 2]
        scales_zeros = torch.stack((scale[..., 0], (low + 8 * scale)[..., 0]), -1).transpose(0, 1).contiguous()
        return packed, scales_zeros.to(weight.dtype)

    def product(x, values, scales):
        if values.dtype == torch.int8:
            return PRODUCT_8BIT(x, values, scales)
        flat = x.reshape(-1, x.shape[-1]).to(scales.dtype).contiguous()
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, values, args.group, scales)
        return out.reshape(*x.shape[:-1], out.shape[-1])

    modeling.pack_int8, modeling.int8_product, modeling.INT8_MAX_ROWS = pack, product, args.max_rows
    target, tokenizer = load_default_target(dtype=torch.bfloat16)
    questions = [q for qs in load_prompt_sets(args.prompts, per_category=1).values() for q in qs]
    prompts = [tokenizer(chat_prompt(tokenizer, q.turns[:1], []), return_tensors="pt").input_ids for q in questions]
    drafters = {}
    for bits[0] in (8, 4):  # each copy packs its weights with the setting of its time
        drafter = PosSDrafter.from_pretrained(default_drafter_path("poss2")).bind_target(target)
        for module in drafter.modules():
            if isinstance(module, modeling.DraftLinear):
                module.int8_copy()
        drafter.mapped_head_rows(int8=True)
        drafters[bits[0]] = drafter

    def generate(ids, assistant=None):
        start = time.perf_counter()
        with torch.no_grad():
            out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens,
                                  do_sample=False, assistant_model=assistant, return_dict_in_generate=True)
        return out, time.perf_counter() - start

    for budget in args.budget or ["2/4/4"]:
        depth, top_k, total = (int(part) for part in budget.split("/"))
        views = {b: d.with_generation_config(tree_depth=depth, tree_top_k=top_k, tree_total_tokens=total,
                                             lookup_num_tokens=0, int8_draft_weights=True)
                 for b, d in drafters.items()}
        for view in views.values():
            generate(prompts[0][:, :16], view)
        found = {b: {"draft": [], "lengths": [], "tokens": 0, "seconds": 0.0, "identical": 0} for b in views}
        decode = []
        for i, ids in enumerate(prompts):
            out, seconds = generate(ids)
            decode.append(seconds / (out.sequences.shape[1] - ids.shape[1]))
            for b in (8, 4) if i % 2 == 0 else (4, 8):
                spec, seconds = generate(ids, views[b])
                row = found[b]
                row["draft"] += spec.speculative_stats.draft_seconds
                row["lengths"] += spec.speculative_stats.acceptance_lengths
                row["tokens"] += spec.sequences.shape[1] - ids.shape[1]
                row["seconds"] += seconds
                row["identical"] += int(torch.equal(spec.sequences, out.sequences))
        step = statistics.median(decode)
        print(f"budget {budget}, group {args.group}, max rows {args.max_rows}: plain {1e3 * step:.1f} ms per token")
        for b, row in found.items():
            print(f"  {b}-bit: tau {statistics.fmean(row['lengths']) + 1:.3f}, draft "
                  f"{1e3 * statistics.median(row['draft']):.2f} ms per round, speedup "
                  f"{row['tokens'] / row['seconds'] * step:.3f}x, identical {row['identical']}/{len(prompts)}, "
                  f"{len(row['lengths'])} rounds")


if __name__ == "__main__":
    main()
