"""Median time of the drafter's matrix products on this CPU: `[4, 576] x [576, N]` for the row counts of one
SmolLM2-135M drafter depth (q/k/v/o 576, MLP 1536, own draft-head rows 4096, mapped rows 12288), bf16, fp32 and
8-bit weights with bf16 activations (`torch._weight_int8pack_mm`, per-row scales), 2 threads; hot (the weight just
used) and cold (300 MB streamed through the cache before each product, as a target forward streams it):

    python benchmarks/scripts/matmul_cost.py
"""

import statistics
import time

import torch


def median_us(fn, repeats: int = 200, before=None) -> float:
    for _ in range(10):
        fn()
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main() -> None:
    torch.set_num_threads(2)
    flush = torch.zeros(75_000_000)
    evict = lambda: flush.add_(1.0)  # noqa: E731
    print("| rows | bf16 hot / cold us | fp32 hot / cold us | int8 weights hot / cold us |\n|---|---|---|---|")
    for rows in (576, 1536, 4096, 12288):
        cells = []
        for dtype in (torch.bfloat16, torch.float32):
            weight, x = torch.randn(rows, 576, dtype=dtype), torch.randn(4, 576, dtype=dtype)
            product = lambda: torch.nn.functional.linear(x, weight)  # noqa: E731
            cells.append((median_us(product), median_us(product, 50, evict)))
        x = torch.randn(4, 576, dtype=torch.bfloat16)
        quantized = torch.randint(-127, 128, (rows, 576), dtype=torch.int8)
        scales = torch.rand(rows, dtype=torch.bfloat16)
        product = lambda: torch._weight_int8pack_mm(x, quantized, scales)  # noqa: E731
        cells.append((median_us(product), median_us(product, 50, evict)))
        print(f"| {rows} | " + " | ".join(f"{hot:.0f} / {cold:.0f}" for hot, cold in cells) + " |")


if __name__ == "__main__":
    main()
