"""Does the reduced draft vocabulary pay, and at what size? Tau and speed of one trained drafter at several sizes.

    python benchmarks/cpu-draft-vocab-sweep/draft_vocab_sweep.py --prompts ../shared/data/specbench --datasets mt_bench,gsm8k --limit 2 \
        --max-new-tokens 64 --dtype float32

The drafter's draft vocabulary is ordered most frequent first, so its first N rows are the draft vocabulary of size
N: each smaller variant keeps the first N rows of `draft_lm_head` and of the id map. `full` drops the draft head and
drafts over the target's whole vocabulary with the target's `lm_head` (the drafter was trained with its own head,
which started from those rows, so `full` is the "without" case up to that drift). All variants and plain `generate`
run interleaved through the benchmark harness (`poss bench`); the table adds drafting and verification time per round.
"""

import argparse
import json
import sys
from pathlib import Path

import torch

from transformers_poss import PosSDrafter
from transformers_poss.assets import default_drafter_path
from transformers_poss.evaluation.cli import main as bench_main


def with_draft_vocab(drafter: PosSDrafter, size: int | None) -> PosSDrafter:
    """A copy of `drafter` drafting over its `size` most frequent draft tokens (None: the target's whole vocabulary)."""
    current = drafter.config.draft_vocab_size
    if current is None or (size is not None and not 1 <= size <= current):
        raise ValueError(f"size must be in [1, {current}] or None for a drafter with draft_vocab_size={current}")
    config = drafter.config.__class__.from_dict(drafter.config.to_dict())
    own = drafter.config.own_draft_head_rows
    config.draft_vocab_size = size
    config.draft_head_rows = own if size is not None and size > own else None  # mapped rows beyond the own ones
    variant = PosSDrafter(config)
    variant.generation_config = drafter.generation_config.updated()  # the same drafting budget
    head = ("draft_lm_head", "draft_to_target", "draft_head_map")
    variant.load_state_dict({k: v for k, v in drafter.state_dict().items() if not k.startswith(head)}, strict=False)
    if size is not None:
        with torch.no_grad():
            variant.draft_lm_head.weight.copy_(drafter.draft_lm_head.weight[: min(size, own)])
            variant.draft_to_target.copy_(drafter.draft_to_target[:size])
            if variant.draft_head_map is not None:
                variant.draft_head_map.load_state_dict(drafter.draft_head_map.state_dict())
    return variant


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", default=str(default_drafter_path("poss2")), help="a drafter with a draft vocabulary")
    parser.add_argument("--sizes", default="1024,2048,4096,8192,full", help="draft vocabulary sizes; 'full' = none")
    parser.add_argument("--output-dir", default="runs/draft-vocab-sweep")
    args, bench_args = parser.parse_known_args()
    output = Path(args.output_dir)
    drafter = PosSDrafter.from_pretrained(args.drafter)
    drafter_args = []
    for text in args.sizes.split(","):
        size = None if text == "full" else int(text)
        folder = output / "variants" / f"vocab-{text}"
        with_draft_vocab(drafter, size).save_pretrained(folder)
        drafter_args += ["--drafter", f"vocab-{text}={folder}"]
    code = bench_main([*drafter_args, "--modes", "tree", "--prompt-lookup", "0", "--output-dir", str(output / "bench"),
                       *bench_args])
    if code:
        return code
    rows = [r for r in json.loads((output / "bench" / "results.json").read_text())["results"] if r["kind"] == "poss"]
    pooled = "all" if any(r["dataset"] == "all" for r in rows) else rows[0]["dataset"]
    print(f"\nPooled over {pooled}:\n| draft vocabulary | tau | tokens/s | speedup | draft ms/round | verify ms/round |\n|---|---|---|---|---|---|")
    for row in rows:
        if row["dataset"] != pooled:
            continue
        split, rounds = row["time_split"], row["rounds"]
        print(f"| {row['method'].removeprefix('vocab-').removesuffix('-tree')} | {row['mean_acceptance_length']:.2f} | "
              f"{row['tokens_per_s']:.2f} | {row['speedup']:.2f}x | {split['draft'] / rounds * 1e3:.1f} | "
              f"{split['verify'] / rounds * 1e3:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
