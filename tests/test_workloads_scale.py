"""``workloads.scale``: one scaling rule for bench-serve and the replay, so both see the same requests."""

from __future__ import annotations

import json

import pytest

from moetide.cli import main
from moetide.serve.bench_prompts import bench_sessions
from moetide.workloads import load_workload
from moetide.workloads.scale import WorkloadScale, scale_workload
from test_bench_serve import write_mooncake


def test_lengths_keys_and_times_scale_together(tmp_path):
    trace = write_mooncake(tmp_path / "t.jsonl", [(0, 2048, 100, [1, 2, 3, 4]), (1000, 1536, 300, [1, 2, 9])])
    workload = load_workload(trace, seed=0)
    assert scale_workload(workload, WorkloadScale()) is workload
    scaled = scale_workload(workload, WorkloadScale(length_scale=1 / 16, max_input_tokens=80, max_output_tokens=10,
                                                    time_scale=0.5))
    assert scaled.key_block_size == 32  # 512 / 16
    first, second = (s.turns[0] for s in scaled.sessions)
    # 2048 / 16 = 128 capped at 80: two whole 32-token keys fit; 1536 / 16 = 96 capped at 80: two of three
    assert (first.prompt_tokens, tuple(first.block_keys)) == (80, (1, 2))
    assert (second.prompt_tokens, tuple(second.block_keys)) == (80, (1, 2))
    assert (first.output_tokens, second.output_tokens) == (6, 10)  # round(100 / 16) = 6; 300 / 16 capped at 10
    assert (first.arrival_s, second.arrival_s) == (0.0, 0.5)  # 1 s x 0.5
    assert [s.start_s for s in scaled.sessions] == [0.0, 0.5]


@pytest.mark.parametrize("field,value,needle", [("length_scale", 0, "length_scale must be > 0"),
                                                ("time_scale", -1.0, "time_scale must be > 0"),
                                                ("max_input_tokens", 0, "max_input_tokens must be >= 1")])
def test_bad_scale(field, value, needle):
    with pytest.raises(ValueError, match=needle):
        WorkloadScale(**{field: value})


def test_replay_models_the_requests_bench_serve_sends(tmp_path, capsys):
    rows = [(i * 700, 1024 + 256 * i, 40 + i, [1, 2, 10 + i]) for i in range(6)]
    trace = write_mooncake(tmp_path / "t.jsonl", rows)
    flags = ["--length-scale", "0.0625", "--max-input-tokens", "72", "--max-output-tokens", "8", "--time-scale", "0.2"]
    out = tmp_path / "r.json"
    assert main(["replay", str(trace), *flags, "--json", str(out)]) == 0
    capsys.readouterr()
    result = json.loads(out.read_text())
    sent = bench_sessions(scale_workload(load_workload(trace, seed=0), WorkloadScale(0.0625, 72, 8, 0.2)), seed=0)
    prompts = [len(t.prompt_token_ids) for s in sent for t in s.turns]
    assert result["config"]["workload"]["requests"] == len(prompts) == 6
    assert result["config"]["workload"]["key_block_size"] == 32
    assert result["metrics"]["prompt_tokens"] == sum(prompts)
    assert result["metrics"]["output_tokens"] == sum(t.output_tokens for s in sent for t in s.turns)


def test_bad_scale_flag_is_one_line(tmp_path, capsys):
    trace = write_mooncake(tmp_path / "t.jsonl", [(0, 64, 4, [1])])
    assert main(["replay", str(trace), "--time-scale", "0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--time-scale must be > 0, got 0.0" in err
