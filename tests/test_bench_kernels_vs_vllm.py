"""benchmarks/kernels_vs_vllm.py without vLLM: one line saying so and exit 0; bad arguments: exit 2 and why."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "kernels_vs_vllm.py"


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is importable here: it would run")
def test_without_vllm_it_says_so_in_one_line_and_exits_zero():
    pytest.importorskip("torch")
    result = run("--tokens", "1")
    assert result.returncode == 0, result.stderr
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert lines[0]["peer"] == "vllm" and lines[0]["status"] == "absent" and len(lines) == 1


@pytest.mark.parametrize(("args", "says"), [(("--tokens", "1,x"), "--tokens"), (("--what", "attention"), "--what"),
                                            (("--top-k", "9"), "--top-k")])
def test_bad_arguments_exit_2_naming_the_flag(args, says):
    result = run(*args)
    assert result.returncode == 2 and says in result.stderr
