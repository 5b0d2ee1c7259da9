"""benchmarks/vllm_scheduler_cost.py on a few steps of one config: every side measured, the lines' shape, and the
overall line from the summaries (no timing is asserted)."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM 0.32 is not installed here (scripts/install_vllm.sh installs it)")

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "vllm_scheduler_cost.py"
TRACES = ROOT.parent / "shared" / "traces"
needs_traces = pytest.mark.skipif(not TRACES.is_dir(), reason=f"recorded traces not found at {TRACES}")


def load_benchmark():
    spec = importlib.util.spec_from_file_location("vllm_scheduler_cost", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@needs_traces
def test_a_tight_config_measures_every_side_for_a_few_steps():
    """mooncake-tight: its own budget for stock and ``vllm``, the roomy one for ``vamp`` and ``stock-still``."""
    bench = load_benchmark()
    lines = bench.config_lines("mooncake-tight", repeats=2, max_steps=3)
    sides, summary = lines[:-1], lines[-1]
    assert [line["side"] for line in sides] == ["stock", "vllm", "vamp", "stock-still"]
    assert [line["num_blocks"] for line in sides] == [2_000, 2_000, 40_000, 40_000]
    for line in sides:
        assert line["steps"] == 3 and line["repeats"] == 2 and line["line_moves"] == 0
        assert len(line["cpu_us_per_step"]["rounds"]) == 2 and line["cpu_us_per_step"]["median"] > 0
        assert set(line["call_us_per_step"]) == {"schedule", "update_from_output"}
    assert summary["summary"] and summary["line_still"] and summary["line_moves"] == 0
    for side in ("vllm", "vamp"):
        ratio = summary[f"{side}_over_stock"]
        assert ratio["min"] <= ratio["median"] <= ratio["max"] and len(ratio["rounds"]) == 2
        assert summary[f"{side}_same_steps_as_stock"]
    overall = bench.overall_line([summary, summary])
    assert overall["configs"] == ["mooncake-tight", "mooncake-tight"] and overall["line_moves"] == 0
    assert math.isclose(overall["vllm_over_stock"]["geomean"], summary["vllm_over_stock"]["median"], rel_tol=1e-3)
