#!/usr/bin/env bash
# Issue 63's EAGLE-3 runs, by the specforge-eagle3 recipe (poss train's default for --drafter-type eagle3):
#   bash train.sh ab-flow|ab-detach|poss2|single400 WORK RUNS
# ab-flow:   one EAGLE-3 specialist, gradients through the fed-back states (the recipe), planned for 9,300 steps (the
#            shipped EAGLE-2-style pair's count) so that its first 1,500 are the A/B's and the rest the long run;
# ab-detach: the same with --detach-fed-back (the old objective), the A/B's other arm: stop it (Ctrl-C or SIGTERM
#            writes a checkpoint) once its step-1,500 validation is logged (README: the A/B, run);
# poss2:     the PosS-2 fork (3 specialists x 2 positions) from ab-flow's final weights, 400 steps (the recipe over
#            400 steps, seed 2), and single400: the single specialist itself forked alike, so that the two compared
#            drafters have trained the same 9,700 steps (as the shipped EAGLE-2-style pair and cpu-fp32-eagle3-poss's
#            forks were trained alike).
# Every run checkpoints each 100 steps and resumes from its latest checkpoint when the same command runs again
# (`--resume auto`); its training_record.json says where it resumed.
set -euo pipefail
RUN=$1 WORK=$2 RUNS=$3
# bf16 autocast on a CPU that computes bf16 (avx512_bf16), else fp32; DTYPE overrides (as in prepare.sh)
DTYPE=${DTYPE:-$(lscpu | grep -q avx512_bf16 && echo bfloat16 || echo float32)}
PREC=$([ "$DTYPE" = bfloat16 ] && echo bf16 || echo no)
T=$(poss fetch-target)
COMMON=(--target "$T" --target-dtype $DTYPE --features "$WORK/feat-a,$WORK/feat-b,$WORK/feat-c"
        --val-features "$WORK/feat-val" --drafter-type eagle3 --feature-layers 2,15,27,-1
        --draft-vocab-size 16384 --batch-size 4 --max-length 384 --mixed-precision $PREC --epochs 9
        --save-steps 100 --save-total-limit 2 --resume auto --val-steps 100 --log-steps 10 --seed 0 --no-progress)
FORK=("${COMMON[@]}" --max-steps 400 --seed 2 --init-from "$RUNS/ab-flow")
case $RUN in
ab-flow)   poss train "${COMMON[@]}" --max-steps 9300 --output-dir "$RUNS/ab-flow" ;;
ab-detach) poss train "${COMMON[@]}" --max-steps 9300 --detach-fed-back --output-dir "$RUNS/ab-detach" ;;
poss2)     poss train "${FORK[@]}" --num-specialists 3 --positions-per-specialist 2 --output-dir "$RUNS/poss2" ;;
single400) poss train "${FORK[@]}" --output-dir "$RUNS/single400" ;;
*) echo "unknown run $RUN" >&2; exit 2 ;;
esac
