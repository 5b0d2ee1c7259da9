"""`moetide compare` and `moetide sweep`: JSON shape, one seed for every run, clear errors."""

import json

from moetide.cli import main


def small_trace(tmp_path):
    lines = [{"timestamp": 200 * i, "input_length": 2600 + 30 * i, "output_length": 20,
              "hash_ids": [1, 2, 3, 4, 5, 100 + i]} for i in range(12)]
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    return path


def test_compare_writes_one_run_per_policy(tmp_path, capsys):
    out = tmp_path / "cmp.json"
    args = ["compare", str(small_trace(tmp_path)), "--kv-cache-memory", "0.5GiB", "--max-offload-ratio", "0.02",
            "--policies", "vllm,static-offload", "--json", str(out)]
    assert main(args) == 0
    result = json.loads(out.read_text())
    assert list(result["runs"]) == ["vllm", "static-offload"]
    for policy, run in result["runs"].items():
        assert run["config"]["policy"] == policy and run["config"]["seed"] == 0
        assert {"offloaded_ratio_max", "staged_bytes", "ttft_s", "tpot_s"} <= set(run["metrics"])
        assert run["metrics"]["completed"] + run["metrics"]["failed"] == 12
    assert result["runs"]["vllm"]["metrics"]["offloaded_ratio_max"] == 0.0
    assert 0 < result["runs"]["static-offload"]["metrics"]["offloaded_ratio_max"] <= 0.02
    assert "static-offload/vllm" in result["ratios"]
    assert "MODELED" in capsys.readouterr().out


def test_sweep_runs_each_cap(tmp_path):
    out = tmp_path / "sweep.json"
    args = ["sweep", str(small_trace(tmp_path)), "--kv-cache-memory", "0.5GiB", "--policy", "static-offload",
            "--max-offload-ratios", "0,0.02", "--json", str(out)]
    assert main(args) == 0
    runs = json.loads(out.read_text())["runs"]
    assert list(runs) == ["0", "0.02"]
    assert runs["0"]["metrics"]["offloaded_ratio_max"] == 0.0
    assert runs["0.02"]["config"]["max_offload_ratio"] == 0.02


def test_bad_lists_are_one_clear_error(tmp_path, capsys):
    trace = str(small_trace(tmp_path))
    assert main(["compare", trace, "--policies", "vllm,vllm"]) == 2
    assert main(["sweep", trace, "--max-offload-ratios", "0,2"]) == 2
    assert main(["compare", trace, "--policies", "vllm,lru"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and "distinct" in err[0] and "[0, 1]" in err[1] and "unknown policy 'lru'" in err[2]
