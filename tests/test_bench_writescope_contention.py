"""The two-user lines of benchmarks/writescope_paper.py take the measured slowdown (benchmarks/host_contention.py
measures it): the static split slows with it, feedback recovers part of it, and bad values exit 2 naming the flag."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "writescope_paper.py"


def lines(*args: str) -> list[dict]:
    cmd = [sys.executable, str(SCRIPT), "--contention", "--no-grid", "--hosts", "kernel-share", *args]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return [json.loads(line) for line in result.stdout.splitlines()]


def test_two_user_lines_follow_the_slowdown_given():
    by_slowdown = {s: lines("--cpu-slowdown", s) for s in ("1", "2.5")}
    idle, busy = by_slowdown["1"], by_slowdown["2.5"]
    assert len(idle) == len(busy) == 18 and all(x["cpu_slowdown"] == 2.5 for x in busy)
    for a, b in zip(idle, busy, strict=True):
        assert (a["model"], a["gpu"], a["host_experts"]) == (b["model"], b["gpu"], b["host_experts"])
        assert a["static_ms"] == pytest.approx(a["one_user_ms"], rel=1e-3)  # nobody else: nothing to recover
        assert b["one_user_ms"] == a["one_user_ms"]
        assert b["static_ms"] > 1.5 * b["one_user_ms"]
        assert b["one_user_ms"] < b["feedback_ms"] < b["static_ms"]
        assert b["feedback_cpu_share"] < b["static_cpu_share"]  # feedback moves work off the slow CPU


@pytest.mark.parametrize("value", ["0", "-1", "nan"])
def test_a_slowdown_that_means_nothing_exits_2(value):
    result = subprocess.run([sys.executable, str(SCRIPT), "--contention", "--no-grid", "--cpu-slowdown", value],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "--cpu-slowdown" in result.stderr
