"""Cost of the drafter's matrix products in bf16, 8-bit (the library's) and 4-bit weights, hot and cold.

Random bf16 weights of the shipped PosS-2's shapes (SmolLM2-135M: q/o 576 x 576, k/v 192 x 576, gate/up 1536 x 576,
down 576 x 1536, fc 576 x 1152, the 16,384-row draft head), inputs of 1 to 300 rows; median of 20 calls, "cold"
after streaming 300 MB through the caches as a target forward does. 2 threads:

    python benchmarks/cpu-bf16-round-limits/product_bits.py
"""

import statistics
import time

import torch

from transformers_poss.kernels import int8_product, pack_int8

GROUP = 32


def pack_4bit(weight):
    out_features, in_features = weight.shape
    grouped = weight.float().reshape(out_features, in_features // GROUP, GROUP)
    low, high = grouped.amin(-1, keepdim=True), grouped.amax(-1, keepdim=True)
    scale = (high - low).clamp(min=1e-8) / 15
    values = torch.round((grouped - low) / scale).clamp(0, 15).to(torch.int32).reshape(out_features, in_features)
    scales_zeros = torch.stack((scale[..., 0], (low + 8 * scale)[..., 0]), -1).transpose(0, 1).contiguous()
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(values, 1), scales_zeros.to(weight.dtype)


def main() -> None:
    torch.set_num_threads(2)
    flush = torch.randn(300_000_000 // 4)

    def median_ms(call, cold):
        times = []
        for _ in range(20):
            if cold:
                flush.mul_(1.0)
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
        return 1e3 * statistics.median(times)

    print("| weight (out x in) | rows | bf16 hot | 8-bit hot | 4-bit hot | bf16 cold | 8-bit cold | 4-bit cold |")
    print("|---|---|---|---|---|---|---|---|")
    shapes = ((576, 576), (192, 576), (1536, 576), (576, 1536), (576, 1152), (16384, 576))
    for out_features, in_features in shapes:
        weight = torch.randn(out_features, in_features, dtype=torch.bfloat16) * 0.02
        values8, scales8 = pack_int8(weight)
        values4, scales4 = pack_4bit(weight)
        for rows in (1, 4, 16, 64, 300) if out_features < 16384 else (1, 4):
            x = torch.randn(rows, in_features, dtype=torch.bfloat16)
            calls = (lambda: x @ weight.T, lambda: int8_product(x, values8, scales8),
                     lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(x, values4, GROUP, scales4))
            cells = [median_ms(call, cold) for cold in (False, True) for call in calls]
            print(f"| {out_features} x {in_features} | {rows} | " + " | ".join(f"{c:.3f}" for c in cells) + " |")


if __name__ == "__main__":
    main()
