"""The published GPU measurements load offline and reproduce: every point has its source and setup, the table
covers what the step model is held to, and the fitted engine profile is closer to the points it was never fitted on
than the plain roofline."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from moetide.errors import UserError
from moetide.perf.engines import engine_efficiency
from moetide.perf.published import load_points, modeled

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "benchmarks" / "data" / "published_gpu.jsonl"
SCRIPT = ROOT / "benchmarks" / "published_gpu.py"


def rms_log(points, efficiency) -> float:
    logs = []
    for p in points:
        value = modeled(p, efficiency)
        logs.append(math.log(value / p.value if p.metric.endswith("_per_s") else p.value / value))
    return math.sqrt(sum(x * x for x in logs) / len(logs))


def test_the_table_covers_the_four_families_every_kind_and_both_sets():
    points = load_points(DATA)
    assert len(points) >= 30
    assert {p.model for p in points} >= {"mixtral-8x7b", "qwen3-30b-a3b", "qwen3-next-80b-a3b", "deepseek-v2-lite"}
    assert {p.kind for p in points} == {"moe_layer", "gemm", "allreduce", "latency", "serving"}
    assert {p.tp for p in points} >= {1, 2, 4, 8}
    assert all(p.source.startswith("https://") for p in points)
    assert {p.set for p in points} == {"fit", "check"}
    batches = {p.setup.get("batch", p.setup.get("concurrency")) for p in points if p.kind in ("latency", "serving")}
    assert min(batches) == 1 and max(batches) >= 64


def test_the_fitted_profile_beats_the_roofline_on_the_check_set():
    check = [p for p in load_points(DATA) if p.set == "check"]
    fitted, plain = rms_log(check, engine_efficiency()), rms_log(check, engine_efficiency("roofline"))
    assert fitted < 0.8 * plain, (fitted, plain)


def test_the_benchmark_prints_a_line_per_point_and_profile_and_the_summaries():
    result = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    points = load_points(DATA)
    rows = [x for x in lines if "point" in x]
    assert len(rows) == 2 * len(points)  # roofline and vllm-0.32
    assert all(x["ratio"] > 0 and x["terms_s"] and x["source"] for x in rows)
    summaries = {(x["profile"], x["set"]): x for x in lines if "point" not in x and "kind" not in x}
    assert set(summaries) == {(p, s) for p in ("roofline", "vllm-0.32") for s in ("fit", "check")}
    assert summaries[("vllm-0.32", "check")]["rms_log"] == pytest.approx(
        rms_log([p for p in points if p.set == "check"], engine_efficiency()))


@pytest.mark.parametrize(("line", "message"), [
    ("not json", r"bad.jsonl:2: not JSON"),
    ('{"id": "x"}', r"bad.jsonl:2: field 'set' is missing"),
    ('{"id": "y", "set": "fit", "group": "g", "kind": "gemm", "metric": "time_us", "value": 5, "gpu": "h100", '
     '"tp": 1, "dtype": "bf16", "engine": "e", "source": "s", "quote": "q", "m": 0, "n": 1, "k": 1}',
     r"bad.jsonl:2: field 'm': expected a positive integer, got 0"),
    ('{"id": "z", "set": "fit", "group": "g", "kind": "gemm", "metric": "time_us", "value": 5, "gpu": "b300", '
     '"tp": 1, "dtype": "bf16", "engine": "e", "source": "s", "quote": "q", "m": 1, "n": 1, "k": 1}',
     r"bad.jsonl:2: field 'gpu'"),
])
def test_a_bad_line_is_named_by_file_line_and_field(tmp_path, line, message):
    good = DATA.read_text().splitlines()[0]
    path = tmp_path / "bad.jsonl"
    path.write_text(good + "\n" + line + "\n")
    with pytest.raises(UserError, match=message):
        load_points(path)
    result = subprocess.run([sys.executable, str(SCRIPT), "--data", str(path)], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode != 0 and "bad.jsonl:2" in result.stderr and "Traceback" not in result.stderr
