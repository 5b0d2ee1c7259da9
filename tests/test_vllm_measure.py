"""Timing vLLM's steps for the replay's device file (``moetide.vllm.measure``): shapes read from vLLM's scheduler
output, a served step log read back, and ``moetide calibrate --engine vllm``'s argument checks."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="vLLM 0.32 is not installed here (scripts/install_vllm.sh installs it)")

from moetide.cli import main  # noqa: E402
from moetide.perf.step import StepShape  # noqa: E402
from moetide.vllm.measure import served_samples, step_shape  # noqa: E402


def test_step_shape_reads_the_context_before_the_step():
    # vLLM has advanced num_computed_tokens by the scheduled tokens when schedule() returns
    output = SimpleNamespace(num_scheduled_tokens={"a": 100, "b": 1, "c": 1}, total_num_scheduled_tokens=102)
    requests = {"a": SimpleNamespace(num_computed_tokens=100), "b": SimpleNamespace(num_computed_tokens=41),
                "c": SimpleNamespace(num_computed_tokens=8)}
    assert step_shape(output, requests) == StepShape(102, 3, 2, 100 + 41 + 8, 100 * 101 // 2 + 41 + 8)
    empty = SimpleNamespace(num_scheduled_tokens={}, total_num_scheduled_tokens=0)
    assert step_shape(empty, {}) is None


def test_served_samples_time_each_step_to_the_next_call(tmp_path):
    log = tmp_path / "steps.log"
    log.write_text("10.0 64 1 0 64 2080\n"       # warm-up, before `after`
                   "11.0 32 1 0 32 528\n"        # 11.0 -> 11.5
                   "11.5 1 1 1 33 33\n"          # 11.5 -> 11.6
                   "11.6 -\n"                    # computes nothing: no sample
                   "11.7 1 1 1 34 34\n"          # 11.7 -> 20.0 holds the idle mark 12.0: left out
                   "20.0 2 2 2 10 10\n"          # the last call has no next: left out
                   )
    samples = served_samples(str(log), idle_marks=[10.5, 12.0], after=10.5)
    assert [(s.shape.num_tokens, round(s.seconds, 6)) for s in samples] == [(32, 0.5), (1, 0.1)]


def test_a_bad_step_line_names_its_file_and_line(tmp_path):
    log = tmp_path / "steps.log"
    log.write_text("1.0 1 1 1 1 1\nnot a step\n")
    with pytest.raises(ValueError, match=r"steps.log:2: not a step line"):
        served_samples(str(log), [])


def test_calibrate_engine_vllm_needs_a_model(capsys):
    assert main(["calibrate", "--engine", "vllm", "--quick"]) != 0
    assert "--engine vllm times vLLM's steps on a checkpoint: give --model DIR too" in capsys.readouterr().err
