#!/usr/bin/env bash
# Issue 56: four forks of the shipped single specialist, trained alike (same data, order, seed and schedule):
#   bash train.sh RUNS FEATURES [NAME ...]
# RUNS: where the runs go; FEATURES: the folder holding feat-a (train: 1,433 conversations, one epoch is 358 steps)
# and feat-val (held out), made by
#   python ../cpu-fp32-eagle3-poss/data/answers.py unpack ../cpu-fp32-eagle3-poss/data/answers-a.jsonl.xz SHAREGPT distilled-a.jsonl
#   python ../cpu-fp32-eagle3-poss/data/answers.py unpack ../cpu-fp32-eagle3-poss/data/val-4000-4031.jsonl.xz SHAREGPT distilled-val.jsonl
#   poss features --target $(poss fetch-target) --target-dtype bfloat16 --max-length 384 --batch-size 4 \
#       --data distilled-X.jsonl --output feat-X          # X = val, a: the final target state only
# NAME: single | poss2 | groups134 | lora134 (default: all four, in this order).
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
RUNS=$1 FEAT=$2
shift 2
SINGLE="$HERE/../../src/transformers_poss/drafters/single-smollm2-135m-instruct"
T=$(poss fetch-target | tail -n 1)
COMMON=(--target "$T" --target-dtype bfloat16 --features "$FEAT/feat-a" --val-features "$FEAT/feat-val"
        --depth 6 --draft-vocab-size 16384 --draft-head-rows 4096 --warmup-steps 20 --batch-size 4 --max-length 384
        --mixed-precision bf16 --epochs 1 --save-steps 50 --resume auto --val-steps 100 --log-steps 10
        --lr 5e-5 --seed 2 --max-steps 350 --init-from "$SINGLE")
for name in "${@:-single poss2 groups134 lora134}"; do
  for run in $name; do
    case $run in
      single)    shape=(--num-specialists 1 --positions-per-specialist 6) ;;
      poss2)     shape=(--num-specialists 3 --positions-per-specialist 2) ;;
      groups134) shape=(--position-groups 1,3,4) ;;
      lora134)   shape=(--position-groups 1,3,4 --lora-rank 16) ;;
      *) echo "unknown run $run" >&2; exit 2 ;;
    esac
    poss train "${COMMON[@]}" "${shape[@]}" --output-dir "$RUNS/$run" > "$RUNS/$run.log" 2>&1
  done
done
