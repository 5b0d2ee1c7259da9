"""benchmarks/host_contention.py without timing anything: where each process runs, and bad arguments exit 2."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "host_contention.py"


def load():
    spec = importlib.util.spec_from_file_location("host_contention", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_shared_runs_both_on_every_core_and_partitioned_splits_them():
    placements = load().placements
    assert placements([0, 1]) == {"shared": (2, [0, 1], [0, 1]), "partitioned": (1, [0], [1])}
    assert placements([0, 1, 2, 3, 4]) == {"shared": (5, [0, 1, 2, 3, 4], [0, 1, 2, 3, 4]),
                                           "partitioned": (2, [0, 1], [2, 3])}
    assert placements([3]) == {"shared": (1, [3], [3])}  # one core: nothing to partition


@pytest.mark.parametrize("argv", [["--rounds", "0"], ["--calls", "0"]])
def test_bad_counts_exit_2_naming_them(argv):
    result = subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "--rounds and --calls" in result.stderr
