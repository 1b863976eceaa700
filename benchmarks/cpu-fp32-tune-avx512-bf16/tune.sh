#!/usr/bin/env bash
# Issue 58: the shipped drafters' fp32 entry for AVX-512 BF16 CPUs (the kind `--dtype float32` runs as here), tuned as
# their other entries were (same grid, 8-bit draft weights as shipped), plus the prompt-lookup branch (0 or 10 tokens)
# and batches of 1, 2 and 4; nothing else may run while it times. Writes each drafter's generation_config.json entry
# and tuning_record.json, and this folder's logs:   bash tune.sh [poss2|single ...]
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
PROMPTS="${SPECBENCH:-$HERE/../../../shared/data/specbench}/mt_bench.jsonl"
for drafter in "${@:-poss2 single}"; do
  for name in $drafter; do
    poss tune "$name" --prompts "$PROMPTS" --limit 4 --max-new-tokens 48 --dtype float32 --threads 2 \
        --top-k 1,2,4,8 --max-depth 6 --totals 2,3,4,6,8,12,16,24,32 --lookup-tokens 0,10 --batch-sizes 1,2,4 \
        2>&1 | grep -v "calibrating on\|timing the prompt-lookup\|it/s\]" | tee "$HERE/tune-$name.log"
  done
done
