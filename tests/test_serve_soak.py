"""The short soak (benchmarks/serve_soak.py, 10 s a policy): rude and polite clients against ``moetide serve`` on
127.0.0.1, then nothing stuck, no block held, the pool's invariants intact and no traceback in the server's log,
under ``vllm`` and ``vamp``. The long run and its figures are in docs/serve.md."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "serve_soak.py"


@pytest.mark.slow
def test_a_short_soak_leaks_nothing_under_either_policy(tiny_checkpoint):
    result = subprocess.run([sys.executable, str(SCRIPT), "--duration-s", "10", "--clients", "6",
                             "--model", str(tiny_checkpoint("qwen3_moe"))], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    runs = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["policy"] for r in runs] == ["vllm", "vamp"]
    for run in runs:
        assert (run["stuck"], run["leaked_blocks"], run["tracebacks"], run["unexpected"]) == (0, 0, 0, 0), run
        assert run["invariants_ok"] and run["server_exit"] == -15  # stopped by its SIGTERM, drained
        outcomes = run["outcomes"]
        assert outcomes["completed"] > 0 and outcomes["completed (slow reader)"] > 0 and run["disconnects"] > 0
        for status in (400, 401, 413):
            assert outcomes[f"refused as expected ({status})"] > 0
        assert run["server_finished"]["abort"] > 0  # the disconnects reached the engine as aborts
