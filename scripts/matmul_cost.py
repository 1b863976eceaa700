"""Median time of the drafter's matrix products on this CPU, alone and with hot caches: `[4, 576] x [576, N]` for
the row counts of one SmolLM2-135M drafter depth (q/k/v/o 576, MLP 1536, own draft-head rows 4096, mapped rows
12288), bf16 and fp32, 2 threads:

    python scripts/matmul_cost.py
"""

import statistics
import time

import torch


def median_us(fn, repeats: int = 200) -> float:
    for _ in range(10):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main() -> None:
    torch.set_num_threads(2)
    print("| rows | bf16 us | fp32 us |\n|---|---|---|")
    for rows in (576, 1536, 4096, 12288):
        cells = []
        for dtype in (torch.bfloat16, torch.float32):
            weight, x = torch.randn(rows, 576, dtype=dtype), torch.randn(4, 576, dtype=dtype)
            cells.append(median_us(lambda: torch.nn.functional.linear(x, weight)))
        print(f"| {rows} | {cells[0]:.0f} | {cells[1]:.0f} |")


if __name__ == "__main__":
    main()
