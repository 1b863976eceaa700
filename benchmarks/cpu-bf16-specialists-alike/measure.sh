#!/usr/bin/env bash
# The measurements of the four forks, in order (nothing else running while `tune` and `speed` time):
#   bash measure.sh prompts|tune|tune-avx2|heldout|fp32-d6|compare|speed RUNS DATA [BUDGET | HALF]
# RUNS: train.sh's folder (single, poss2, groups134, lora134); DATA: the folder holding distilled-val.jsonl (see
# train.sh) and where the prompt files go. Acceptance runs (heldout, fp32-d6) are not timed.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
STAGE=$1 RUNS=$2 DATA=$3
SPECBENCH="${SPECBENCH:-$HERE/../../../shared/data/specbench}"
read -ra FORKS <<< "${FORKS:-single poss2 groups134 lora134}"  # FORKS="single groups134": only these
TUNE=(--limit 3 --max-new-tokens 48 --threads 2 --top-k 1,2,4,8 --max-depth 6 --totals 2,3,4,6,8,12,16,24,32
      --lookup-tokens 0,10 --int8-draft-weights on --prompts "$SPECBENCH/mt_bench.jsonl")
drafters() {  # --drafter $2NAME=RUNS/NAME$1 for the four forks
  for name in "${FORKS[@]}"; do printf -- "--drafter %s=%s " "${2:-}$name" "$RUNS/$name$1"; done
}
case $STAGE in
prompts)  # held-out prompts: the first user turn of each held-out ShareGPT record (4000-4031, never trained on);
  # the 32 category-balanced MT-Bench turns (first two questions of each category, both turns)
  python - "$DATA/distilled-val.jsonl" "$DATA/heldout.jsonl" <<'PY'
import json, sys
with open(sys.argv[2], "w") as out:
    for line in open(sys.argv[1]):
        record = json.loads(line)
        first = [turn["value"] for turn in record["conversations"] if turn["from"] == "human"][:1]
        if first:  # one record (4sJAod7_0) is empty
            out.write(json.dumps({"question_id": record["id"], "category": "sharegpt", "turns": first}) + "\n")
PY
  SPECBENCH="$SPECBENCH" bash "$HERE/../cpu-fp32-eagle3-poss/measure.sh" prompts unused "$DATA" ;;
tune)  # each fork's bf16 budget on this CPU kind (AVX-512 BF16), as the shipped drafters were tuned
  for name in "${FORKS[@]}"; do
    poss tune "$RUNS/$name" --dtype bfloat16 "${TUNE[@]}" --output-dir "$RUNS/$name-tuned" | tee "$HERE/tune/$name-bf16.txt"
  done ;;
tune-avx2)  # each fork's fp32 budget on an AVX2-only CPU kind (dtype auto picks fp32 there), into the same folder
  for name in "${FORKS[@]}"; do
    ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 poss tune "$RUNS/$name-tuned" --dtype float32 "${TUNE[@]}" \
        | tee "$HERE/tune/$name-avx2-fp32.txt"
    for file in tuning_record.json generation_config.json; do cp "$RUNS/$name-tuned/$file" "$HERE/tune/$name-$file"; done
  done ;;
heldout)  # acceptance on the held-out prompts in bf16 at one budget (BUDGET = depth/top-k/tokens, default the
  # shipped default's 2/4/4), no lookup branch, every fork at the same budget
  budget=${4:-2/4/4}
  IFS=/ read -r depth topk total <<< "$budget"
  poss bench --target default --dtype bfloat16 --threads 2 --prompts "$DATA/heldout.jsonl" --max-new-tokens 96 \
      --prompt-lookup 0 --modes tree --tree-depth "$depth" --tree-top-k "$topk" --tree-total-tokens "$total" \
      --lookup-tokens 0 --int8-draft-weights on --quiet --no-plots $(drafters "") \
      --output-dir "$HERE/heldout-${budget//\//-}" ;;
fp32-d6)  # the paper's budget in fp32 on 64 category-balanced MT-Bench turns in two halves of 32 (BUDGET = 2per or
  # 34, default both: questions 1-2 and 3-4 of each category, both turns), every answer checked against plain
  for half in ${4:-2per 34}; do
    poss bench --target default --dtype float32 --threads 2 --prompts "$DATA/mt_bench_$half.jsonl" --max-new-tokens 128 \
        --prompt-lookup 0 --modes tree --tree-depth 6 --tree-top-k 10 --tree-total-tokens 60 --lookup-tokens 0 \
        --quiet --no-plots $(drafters "") --output-dir "$HERE/fp32-d6-$half"
  done ;;
compare)  # each fork against the single one, per draft position, paired bootstrap over the turns: held-out bf16
  # runs (one per budget) and the fp32 depth-6 halves pooled
  mkdir -p "$HERE/compare"
  for name in poss2 groups134 lora134; do
    for run in "$HERE"/heldout-*/; do
      budget=$(basename "$run")
      grep -q "\"$name-tree\"" "$run/results.json" || continue  # not run at this budget
      poss compare "$name-tree" single-tree "$run/results.json" --output-json "$HERE/compare/$budget-$name.json" \
          > "$HERE/compare/$budget-$name.txt"
    done
    compgen -G "$HERE/fp32-d6-*/results.json" > /dev/null || continue  # fp32-d6 not run yet
    poss compare "$name-tree" single-tree "$HERE"/fp32-d6-*/results.json --output-json "$HERE/compare/fp32-d6-$name.json" \
        > "$HERE/compare/fp32-d6-$name.txt"
  done ;;
speed)  # README's benchmark, three runs: the shipped drafters and the tuned forks (named fork-NAME), each at its own
  # budget, methods interleaved turn by turn
  for run in 1 2 3; do
    poss bench --target default --dtype bfloat16 --threads 2 --prompts mt_bench --limit 8 --max-new-tokens 128 \
        --prompt-lookup 10 --modes tree --int8-draft-weights on --drafter default $(drafters -tuned fork-) --no-plots \
        --output-dir "$HERE/speed-$run"
  done ;;
*) echo "unknown stage $STAGE" >&2; exit 2 ;;
esac
