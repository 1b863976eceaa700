#!/usr/bin/env bash
# The measurements of this run, in order (nothing else running while they time):
#   bash measure.sh prompts|validate|acceptance|compare|tune|speed RUNS DATA [HALF [DRAFTER]]
# RUNS: the folder holding the training runs (e3-single, e3-single-400, e3-poss2: README's Training section);
# DATA: the folder holding val-e3 and mt_bench_2per.jsonl / mt_bench_34.jsonl (MT-Bench questions 81, 82, 91, 92, ...
# and 83, 84, 93, 94, ...: the first four of each category, as the shipped pair's depth-6 runs used them).
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
STAGE=$1 RUNS=$2 DATA=$3
SHIPPED="$HERE/../cpu-fp32-all-rounds-d6-mt_bench"
DRAFTERS="$HERE/../../src/transformers_poss/drafters"
REC="$HERE/records"
case $STAGE in
prompts)  # the two halves of the 64 turns, from Spec-Bench's MT-Bench file (SPECBENCH: its folder)
  python - "${SPECBENCH:-$HERE/../../../shared/data/specbench}/mt_bench.jsonl" "$DATA" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
categories = dict.fromkeys(r["category"] for r in rows)
for name, part in (("2per", slice(0, 2)), ("34", slice(2, 4))):
    picked = {r["question_id"] for c in categories for r in [r for r in rows if r["category"] == c][part]}
    with open(f"{sys.argv[2]}/mt_bench_{name}.jsonl", "w") as out:
        out.writelines(json.dumps(r) + "\n" for r in rows if r["question_id"] in picked)
PY
  ;;
validate)  # held-out accuracy of all four on the same held-out features
  python "$HERE/validate.py" "$DATA/val-e3" "E3 PosS-2=$RUNS/e3-poss2" "E3 single=$RUNS/e3-single-400" \
      "shipped PosS-2=$DRAFTERS/poss2-smollm2-135m-instruct" "shipped single=$DRAFTERS/single-smollm2-135m-instruct" \
      --output "$HERE/validation.json"
  python "$HERE/curves.py" --output "$HERE/curves.png" "E3 single, pass 1=$RUNS/e3-single" \
      "E3 single, 400 more=$RUNS/e3-single-400@$RUNS/e3-single" "E3 PosS-2=$RUNS/e3-poss2@$RUNS/e3-single" \
      "E3 single, pass 2 (earlier)=$REC/train_log-e3-single2.jsonl.gz@$RUNS/e3-single" \
      "E3 PosS-2 from pass 2 (earlier)=$REC/train_log-e3-poss2-fork.jsonl.gz@$REC/train_log-e3-single2.jsonl.gz@$RUNS/e3-single"
  python "$HERE/curves.py" --output "$HERE/curves-forks.png" --no-shipped --from-step 1000 \
      "E3 single, pass 1=$RUNS/e3-single" "E3 single, 400 more=$RUNS/e3-single-400@$RUNS/e3-single" \
      "E3 PosS-2=$RUNS/e3-poss2@$RUNS/e3-single" ;;
acceptance)  # fp32, depth 6 / top-k 10 / 60 tokens, the 64 turns in two halves (every answer checked against plain),
  # each drafter on its own (one half and one drafter a run: HALF = 2per or 34, then DRAFTER = e3-poss2 or e3-single)
  for half in ${4:-2per 34}; do
    for name in ${5:-e3-poss2 e3-single}; do
      run=$([ "$name" = e3-single ] && echo e3-single-400 || echo "$name")
      poss bench --target default --dtype float32 --threads 2 --max-new-tokens 128 --prompt-lookup 0 --modes tree \
          --tree-depth 6 --tree-top-k 10 --tree-total-tokens 60 --lookup-tokens 0 --quiet \
          --drafter "$name=$RUNS/$run" --prompts "$DATA/mt_bench_$half.jsonl" --output-dir "$HERE/fp32-$half-$name"
    done
  done ;;
compare)  # paired bootstrap over the 64 turns; the shipped pair's rounds are from its own runs on the same turns
  E3=("$HERE"/fp32-{2per,34}-{e3-poss2,e3-single}/results.json)
  poss compare e3-poss2-tree e3-single-tree "${E3[@]}" --output-json "$HERE/compare-e3.json"
  poss compare e3-poss2-tree poss2-all2-tree "${E3[@]}" "$SHIPPED"/results-pass2-{2per,34}.json \
      --output-json "$HERE/compare-e3-poss2-vs-shipped-poss2.json"
  poss compare e3-single-tree single-all2-tree "${E3[@]}" "$SHIPPED"/results-single-pass2-{2per,34}.json \
      --output-json "$HERE/compare-e3-single-vs-shipped-single.json" ;;
tune)  # the budget for bf16 on this device kind, as the shipped drafters were tuned
  # (the shipped default's bf16 entry came from the same grid, with its 8-bit draft weights on)
  poss tune "$RUNS/e3-poss2" --prompts mt_bench --limit 3 --max-new-tokens 48 --dtype bfloat16 --threads 2 \
      --top-k 1,2,4,8 --max-depth 6 --totals 2,3,4,6,8,12,16,24,32 --int8-draft-weights on \
      --output-dir "$RUNS/e3-poss2-tuned"
  mkdir -p "$HERE/tune" && cp "$RUNS"/e3-poss2-tuned/{generation_config.json,tuning_record.json} "$HERE/tune/" ;;
speed)  # README's benchmark, the shipped default against the tuned E3 PosS-2, methods interleaved turn by turn;
  # both with the shipped default's prompt-lookup branch (10 tokens; poss train leaves it off in a new drafter) and
  # 8-bit draft weights (as tuned)
  for run in 1 2 3; do
    poss bench --target default --dtype bfloat16 --threads 2 --prompts mt_bench --limit 8 --max-new-tokens 128 \
        --prompt-lookup 10 --lookup-tokens 10 --int8-draft-weights on --modes tree \
        --drafter "shipped=$DRAFTERS/poss2-smollm2-135m-instruct" --drafter "e3-poss2=$RUNS/e3-poss2-tuned" \
        --output-dir "$HERE/bf16-$run"
  done ;;
*) echo "unknown stage $STAGE" >&2; exit 2 ;;
esac
