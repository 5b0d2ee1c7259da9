"""benchmarks/vllm_serve_vamp.py without serving anything: each workload's flags are ones bench-serve and replay
both take, texts are compared request by request, and the verdict reads the medians it should."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM 0.32 is not installed here (scripts/install_vllm.sh installs it)")

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load():
    sys.path.insert(0, str(BENCHMARKS))  # its sibling modules (serve_prediction, vllm_serve_prediction)
    try:
        spec = importlib.util.spec_from_file_location("vllm_serve_vamp", BENCHMARKS / "vllm_serve_vamp.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCHMARKS))
    return module


def arguments(module, *extra):
    sys_argv = sys.argv
    sys.argv = ["vllm_serve_vamp.py", "--model", "M", "--trace", "T.jsonl.gz", *extra]
    try:
        return module.arguments()
    finally:
        sys.argv = sys_argv


@pytest.mark.parametrize("workload", ["weka", "agent"])
def test_each_workloads_flags_are_bench_serves_and_the_replays(workload):
    from moetide.cli import build_parser

    module = load()
    flags = module.workload_flags(arguments(module), workload, 3)
    bench = build_parser("bench-serve").parse_args(["bench-serve", *flags, "--url", "http://127.0.0.1:1"])
    replay = build_parser("replay").parse_args(["replay", *flags])
    assert bench.seed == replay.seed == 3 and bench.max_input_tokens == replay.max_input_tokens == 900
    assert (bench.trace is None) == (workload == "agent") and bench.trace == replay.trace


def test_texts_are_compared_request_by_request():
    module = load()
    texts = {("w", "stock", 0): {"a": "x", "b": "y", "c": "z"}, ("w", "vamp", 0): {"a": "x", "b": "Y", "d": "z"}}
    assert module.text_mismatches(texts, "w", "vamp", 0) == 3  # b differs, c and d are each missing once


def test_the_verdict_divides_stocks_medians_by_vamps(capsys):
    import json

    module = load()

    def row(impl, seed, ttft90, tpot50):
        return {"impl": impl, "seed": seed, "median_ttft_ms": 10.0, "p90_ttft_ms": ttft90, "median_tpot_ms": tpot50,
                "p90_tpot_ms": tpot50, "failed": 0, "line_moves": 4.0}

    rows = {"stock": [row("stock", 0, 300.0, 4.0), row("stock", 1, 200.0, 4.0)],
            "vamp": [row("vamp", 0, 100.0, 5.0), row("vamp", 1, 100.0, 4.0)],
            "stock-cap": [row("stock-cap", 0, 50.0, 4.4), row("stock-cap", 1, 50.0, 4.4)]}
    metrics = {"ttft_s": {"p50": 0.01, "p90": 0.1}, "tpot_s": {"p50": 0.004, "p90": 0.004}, "offloads": 3,
               "reclaims": 2}
    predicted = {(impl, seed): metrics for impl in rows for seed in (0, 1)}
    texts = {("w", impl, seed): {"r": "t"} for impl in rows for seed in (0, 1)}
    module.summarize("w", rows, predicted, texts, unloaded_ms=10.0)
    verdict = [json.loads(line) for line in capsys.readouterr().out.splitlines() if '"verdict"' in line][0]
    assert verdict["stock_queue_factor"] == 25.0 and verdict["ttft_p90_divisor"] == 2.5
    assert verdict["tpot_p50_change"] == pytest.approx(0.125) and verdict["bound_ttft_p90_divisor"] == 5.0
    assert verdict["vamp_over_bound_ttft_p90"] == 2.0 and verdict["line_moves_predicted"] == [5, 5]
    assert verdict["text_mismatches"] == {"vamp": [0, 0], "stock-cap": [0, 0]}
