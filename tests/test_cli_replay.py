"""`moetide replay`: JSON shape, determinism, and one clear error for bad input."""

import json
import subprocess
import sys

from moetide.cli import main


def write_trace(path, lines):
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    return path


def mooncake_lines(n=6):
    return [{"timestamp": 1000 * i, "input_length": 1100 + 10 * i, "output_length": 5, "hash_ids": [1, 2, 100 + i]}
            for i in range(n)]


def test_replay_json_has_the_documented_shape(tmp_path, capsys):
    trace = write_trace(tmp_path / "t.jsonl", mooncake_lines())
    out = tmp_path / "out.json"
    assert main(["replay", str(trace), "--model", "qwen3-30b-a3b", "--gpu", "h100", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    metrics = result["metrics"]
    for key in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
        assert set(metrics[key]) == {"mean", "p50", "p90", "p99"}
    for key in ("request_throughput_per_s", "output_tokens_per_s", "prefix_hit_rate", "recomputed_tokens",
                "preemptions", "completed", "failed"):
        assert key in metrics
    assert metrics["completed"] == 6 and metrics["failed"] == 0
    # every prompt shares the first two 512-token blocks with the first one: 1024 of ~1100 tokens hit
    assert metrics["prefix_hit_rate"] > 0.75
    assert result["config"]["workload"]["requests"] == 6 and result["config"]["policy"] == "vllm"
    assert "MODELED" in capsys.readouterr().out


def test_same_command_twice_gives_the_same_bytes(tmp_path):
    outs = []
    for name in ("a.json", "b.json"):
        assert main(["replay", "--kv-cache-memory", "4GiB", "--json", str(tmp_path / name)]) == 0
        outs.append((tmp_path / name).read_bytes())
    assert outs[0] == outs[1]


def test_malformed_trace_line_names_file_and_line(tmp_path, capsys):
    lines = [json.dumps(line) for line in mooncake_lines(3)]
    lines[1] = '{"timestamp": 5, "input_length": "many"}'
    trace = tmp_path / "bad.jsonl"
    trace.write_text("\n".join(lines) + "\n")
    assert main(["replay", str(trace)]) == 2
    err = capsys.readouterr().err
    assert f"{trace}:2" in err and "input_length" in err and len(err.strip().splitlines()) == 1


def test_weights_that_do_not_fit_are_one_clear_error(capsys):
    assert main(["replay", "--model", "qwen3-next-80b-a3b", "--gpu", "a100-40gb"]) == 2
    err = capsys.readouterr().err.strip()
    assert "does not fit" in err and "--tensor-parallel-size" in err and len(err.splitlines()) == 1


def test_bad_time_window_and_missing_trace(tmp_path, capsys):
    trace = write_trace(tmp_path / "t.jsonl", mooncake_lines())
    assert main(["replay", str(trace), "--time-window", "10:5"]) == 2
    assert main(["replay", str(tmp_path / "nope.jsonl")]) == 2
    err = capsys.readouterr().err
    assert "--time-window" in err and "no such trace file" in err


def test_exit_code_two_without_traceback_from_a_real_process(tmp_path):
    trace = tmp_path / "bad.jsonl"
    trace.write_text("not json\n")
    proc = subprocess.run([sys.executable, "-m", "moetide.cli", "replay", str(trace), "--format", "mooncake"],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and f"{trace}:1" in proc.stderr


def session_lines(n=4):
    """Mooncake lines whose prompts extend each other: turns of one conversation (5 shared 512-token blocks)."""
    return [{"timestamp": 20000 * i, "input_length": 2600 + 512 * i, "output_length": 5,
             "hash_ids": list(range(1, 6 + i))} for i in range(n)]


def test_hybrid_prefix_caching_follows_vllms_mamba_cache_modes(tmp_path, capsys):
    """Qwen3-Next: align (the default with prefix caching) caches states and hits; none needs prefix caching
    off."""
    trace = write_trace(tmp_path / "t.jsonl", session_lines())
    base = ["replay", str(trace), "--model", "qwen3-next-80b-a3b", "--gpu", "h200", "-tp", "2"]
    results = {}
    for name, extra in (("align", []), ("dense", ["--prefix-cache-retention-interval", "none"]),
                        ("off", ["--no-prefix-caching"])):
        out = tmp_path / f"{name}.json"
        assert main([*base, *extra, "--json", str(out)]) == 0
        results[name] = json.loads(out.read_text())["metrics"]["prefix_hit_rate"]
        printed = capsys.readouterr()
        assert ("mamba_cache_mode none" in printed.out) == (name == "off")
    assert results["align"] > 0.5 and results["off"] == 0 and results["dense"] >= results["align"]
    assert main([*base, "--mamba-cache-mode", "none"]) == 2
    assert "--no-prefix-caching" in capsys.readouterr().err
    assert main([*base, "--block-size", "16"]) == 2
    assert "544" in capsys.readouterr().err


def test_vllm_015_defaults(tmp_path, capsys):
    """--vllm-version 0.15: first-chunk admission, and no prefix caching for hybrid models unless asked for."""
    trace = write_trace(tmp_path / "t.jsonl", session_lines())
    base = ["replay", str(trace), "--model", "qwen3-next-80b-a3b", "--gpu", "h200", "-tp", "2",
            "--vllm-version", "0.15"]
    for extra, hits in (([], False), (["--enable-prefix-caching"], True)):
        out = tmp_path / "out.json"
        assert main([*base, *extra, "--json", str(out)]) == 0
        result = json.loads(out.read_text())
        assert (result["metrics"]["prefix_hit_rate"] > 0.5) == hits
        assert result["config"]["scheduler_reserve_full_isl"] is False
        assert result["config"]["prefix_cache_retention_interval"] is None
        assert "vLLM 0.15's v1 rules (admission on the first chunk" in capsys.readouterr().out


def test_a_moved_line_is_reported_in_words(capsys):
    """vLLM 0.15's first-chunk admission into 2 GiB of KV: vamp moves the line and the report says how far, with
    the counters of the table it sits under; vllm's report has no such sentence."""
    common = ["replay", "--model", "qwen3-next-80b-a3b", "--gpu", "h100-nvl", "-tp", "2", "--kv-cache-memory",
              "2GiB", "--vllm-version", "0.15", "--sessions", "8"]
    assert main([*common, "--policy", "vamp", "--json", "-"]) == 0
    metrics = json.loads(capsys.readouterr().out)["metrics"]
    assert main([*common, "--policy", "vamp"]) == 0
    out = capsys.readouterr().out
    [line] = [x for x in out.splitlines() if x.startswith("the weights/KV line moved: ")]
    assert metrics["offloaded_ratio_max"] > 0
    assert f"up to {metrics['offloaded_ratio_max']:.1%} of the routed-expert bytes" in line
    assert f"({metrics['offloads']:,} offloads, {metrics['reclaims']:,} regions given back)" in line
    assert main([*common, "--policy", "vllm"]) == 0
    assert "the weights/KV line moved" not in capsys.readouterr().out


def test_vamp_priced_from_a_cost_record(tmp_path, capsys):
    """--vamp-costs: the replay prices vamp from the record as vLLM's plugin does (its ``RecordSteps``, told every
    step's tokens), a report's "vamp_costs" or the bare record; the config carries it; a bad field is one line."""
    from moetide.core.pressure.step_costs import RecordSteps
    from moetide.sim.setup import ReplayConfig, build_replay
    from moetide.workloads.generator import GeneratorConfig, generate_agent_sessions

    record = {"prefill_s_per_token": 2e-5, "copy_s_per_expert": 2e-4}
    built = build_replay(generate_agent_sessions(0, config=GeneratorConfig(num_sessions=3)),
                         ReplayConfig(policy="vamp", kv_cache_memory=2**30, vamp_costs=record))
    built.replay.run()
    params = built.replay.scheduler.policy.params
    assert isinstance(params.steps, RecordSteps) and params.prefill_s_per_token == 2e-5
    assert params.token_budget == built.config.max_num_batched_tokens and params.steps.busy > 0

    report = tmp_path / "report.json"
    report.write_text(json.dumps({"vamp_costs": record}))
    out = tmp_path / "out.json"
    argv = ["replay", "--sessions", "2", "--model", "qwen3-30b-a3b", "--gpu", "h100", "--policy", "vamp",
            "--kv-cache-memory", "1GiB"]
    assert main([*argv, "--vamp-costs", str(report), "--json", str(out)]) == 0
    assert json.loads(out.read_text())["config"]["vamp_costs"] == record
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"prefill_s_per_token": 2e-5, "copy_s_per_expert": 2e-4, "per_step_s": 1}))
    capsys.readouterr()
    assert main([*argv, "--vamp-costs", str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "vamp-costs" in err[0] and "per_step_s" in err[0]
