"""This CPU described as the replay's device: the step-time model's per-sequence and KV-read factors, the fit of
``perf.step_calibrate`` (recovering factors it was generated with), the device file ``moetide calibrate --model
--device-out`` writes and ``moetide replay --gpu FILE`` reads (dtype float32 from the device), and the engine's
``last_step_shape`` that the fit is timed against. No timing is asserted."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib

import pytest

from moetide.errors import UserError
from moetide.perf import Efficiency, StepShape, StepTimeModel
from moetide.perf.engines import engine_efficiency
from moetide.perf.step_calibrate import (StepSample, _overheads, fit_request_overhead, fit_step_efficiency,
                                         step_efficiency_for_gpu)
from moetide.sim.setup import ReplayConfig, build_replay, resolve_dtype
from moetide.specs import HardwareSpec, get_gpu, get_model
from moetide.workloads import generate_agent_sessions
from moetide.workloads.generator import GeneratorConfig

CPU = HardwareSpec(name="cpu", hbm_bytes=16 * 2**30, hbm_bandwidth_bytes_per_s=25e9, matmul_flops_per_s=70e9,
                   matmul_dtype="fp32", host_link_bandwidth_bytes_per_s=20e9, gpu_link_bandwidth_bytes_per_s=20e9)
DEVICE_TOML = """name = "cpu"
hbm_bytes = 17179869184
hbm_bandwidth_bytes_per_s = 25e9
matmul_flops_per_s = 70e9
matmul_dtype = "fp32"
host_link_bandwidth_bytes_per_s = 20e9
gpu_link_bandwidth_bytes_per_s = 20e9
"""
MOE = "qwen3-30b-a3b"


def cli(*argv: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", "import sys; from moetide.cli import main; sys.exit(main())",
                           *argv], capture_output=True, text=True, timeout=timeout)


def test_seq_overhead_and_attention_memory_add_what_they_say():
    model = get_model(MOE)
    base = Efficiency(step_overhead_s=0.0)
    shape = StepShape.decode(8, 2048)
    t0 = StepTimeModel(model, CPU, dtype_bytes=4, kv_dtype_bytes=4, efficiency=base).step_time_s(*shape.as_args())
    per_seq = StepTimeModel(model, CPU, dtype_bytes=4, kv_dtype_bytes=4,
                            efficiency=Efficiency(step_overhead_s=0.0, seq_overhead_s=1e-4))
    assert per_seq.step_time_s(*shape.as_args()) == pytest.approx(t0 + 8 * 1e-4, rel=1e-12)
    # decode attention at e_kv 0.1 or 0.2 is memory-bound: 8 x 2049 KV tokens x 48 layers x 2 x 4 x 128 x 4 B =
    # 3.2 GB at 25 GB/s x e (1.29 s, 0.64 s) against 1.29e10 FLOPs at 70 GFLOP/s x 0.5 (0.37 s)
    kv_bytes = 8 * 2049 * 48 * 2 * 4 * 128 * 4
    slow = StepTimeModel(model, CPU, dtype_bytes=4, kv_dtype_bytes=4,
                         efficiency=Efficiency(step_overhead_s=0.0, attention_memory=0.1))
    fast = StepTimeModel(model, CPU, dtype_bytes=4, kv_dtype_bytes=4,
                         efficiency=Efficiency(step_overhead_s=0.0, attention_memory=0.2))
    diff = slow.step_time_s(*shape.as_args()) - fast.step_time_s(*shape.as_args())
    assert diff == pytest.approx(kv_bytes / 25e9 * (1 / 0.1 - 1 / 0.2), rel=1e-9)
    assert slow.breakdown(shape)["total_s"] == pytest.approx(slow.step_time_s(*shape.as_args()), rel=1e-12)
    assert per_seq.breakdown(shape)["overhead_s"] == pytest.approx(8e-4)


def test_none_attention_memory_is_hbm_so_presets_are_unchanged():
    model, gpu = get_model(MOE), get_gpu("h100")
    shape = StepShape.decode(16, 8192)
    a = StepTimeModel(model, gpu).step_time_s(*shape.as_args())
    b = StepTimeModel(model, gpu, efficiency=Efficiency(attention_memory=0.8)).step_time_s(*shape.as_args())
    assert a == b
    with pytest.raises(ValueError, match="attention_memory"):
        Efficiency(attention_memory=1.5)


def test_overheads_closed_form_on_a_hand_case():
    # roofline 0 everywhere: t = a + b S exactly for a = 2 ms, b = 0.5 ms -> recovered with zero loss
    samples = [StepSample(StepShape.decode(s, 10), 0.002 + 0.0005 * s) for s in (1, 2, 4, 8)]
    a, b, loss = _overheads(samples, [0.0] * 4, [1.0] * 4)
    assert (a, b) == (pytest.approx(0.002), pytest.approx(0.0005)) and loss == pytest.approx(0.0, abs=1e-20)
    # a residual that falls with S would need b < 0: b is held at 0
    falling = [StepSample(StepShape.decode(s, 10), 0.01 - 0.001 * s) for s in (1, 2, 4, 8)]
    assert _overheads(falling, [0.0] * 4, [1.0] * 4)[1] == 0.0


TINY_CONFIG = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 256,
               "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
               "intermediate_size": 512, "moe_intermediate_size": 256, "num_experts": 8, "num_experts_per_tok": 2,
               "vocab_size": 512, "max_position_embeddings": 4096, "tie_word_embeddings": False,
               "decoder_sparse_step": 1, "mlp_only_layers": [], "dtype": "float32"}


@pytest.fixture
def tiny_config(tmp_path):
    """The config.json of benchmarks/serve_prediction.py's checkpoint (no weights: the specs read the config)."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY_CONFIG))
    return str(path)


def test_fit_recovers_the_factors_it_was_generated_with(tiny_config):
    model = get_model(tiny_config)
    truth = Efficiency(matmul=0.4, attention=0.3, hbm=0.8, attention_memory=0.2, step_overhead_s=0.002,
                       seq_overhead_s=0.0002)
    step = StepTimeModel(model, CPU, dtype_bytes=4, kv_dtype_bytes=4, efficiency=truth)
    shapes = ([StepShape.decode(s, c) for s in (1, 4, 16, 32) for c in (32, 256, 1024)]
              + [StepShape.prefill(t, c) for t in (32, 512, 4096) for c in (0, 1024)])
    samples = [StepSample(s, step.step_time_s(*s.as_args())) for s in shapes]
    fit = fit_step_efficiency(samples, model, CPU, 4)
    assert fit.max_abs_rel_error < 0.02
    assert fit.matmul == pytest.approx(0.4, rel=0.05) and fit.attention_memory == pytest.approx(0.2, rel=0.05)
    assert fit.step_overhead_s == pytest.approx(0.002, rel=0.1) and fit.seq_overhead_s == pytest.approx(2e-4, rel=0.1)
    assert fit.efficiency() == Efficiency(**fit.table())


def test_device_file_efficiency_table(tmp_path):
    path = tmp_path / "cpu.toml"
    path.write_text(DEVICE_TOML + "\n[efficiency]\nmatmul = 0.5\nseq_overhead_s = 1e-4\n\n[measured]\nsteps = 3\n")
    assert get_gpu(str(path)).matmul_dtype == "fp32"
    assert step_efficiency_for_gpu(str(path)) == Efficiency(matmul=0.5, seq_overhead_s=1e-4)
    assert step_efficiency_for_gpu("h100") == engine_efficiency()  # a preset: the engine profile
    path.write_text(DEVICE_TOML)  # a hand-written file, no table: the profile, as for a preset
    assert step_efficiency_for_gpu(str(path)) == engine_efficiency()
    assert step_efficiency_for_gpu(str(path), "roofline") == Efficiency()
    path.write_text(DEVICE_TOML + "\n[efficiency]\nmatmull = 0.5\n")
    with pytest.raises(UserError, match=r"cpu.toml: \[efficiency\]: unknown field\(s\) \['matmull'\]"):
        step_efficiency_for_gpu(str(path))
    path.write_text(DEVICE_TOML + "\n[efficiency]\nhbm = 2.0\n")
    with pytest.raises(UserError, match=r"cpu.toml: \[efficiency\]: Efficiency.hbm"):
        step_efficiency_for_gpu(str(path))


def test_dtype_auto_is_the_devices_and_an_explicit_one_must_match(tmp_path, tiny_config):
    assert resolve_dtype("auto", get_gpu("h100")) == "bfloat16"
    assert resolve_dtype("auto", get_gpu("v100-32gb")) == "float16"
    assert resolve_dtype("auto", CPU) == "float32"
    with pytest.raises(ValueError, match="ReplayConfig.dtype float32: .* quoted at bf16"):
        resolve_dtype("float32", get_gpu("h100"))
    with pytest.raises(ValueError, match="ReplayConfig.dtype must be one of"):
        ReplayConfig(dtype="fp8")
    path = tmp_path / "cpu.toml"
    path.write_text(DEVICE_TOML)
    workload = generate_agent_sessions(0, config=GeneratorConfig(num_sessions=2))
    fp32 = build_replay(workload, ReplayConfig(model=tiny_config, gpu=str(path), kv_cache_memory=1 * 2**30))
    bf16 = build_replay(workload, ReplayConfig(model=tiny_config, gpu="h100", kv_cache_memory=1 * 2**30))
    assert fp32.config.dtype == "float32" and bf16.config.dtype == "bfloat16"
    assert fp32.budget.block_bytes == 2 * bf16.budget.block_bytes  # 4-byte KV
    assert fp32.budget.weights_bytes_per_gpu == 2 * bf16.budget.weights_bytes_per_gpu


def test_engine_last_step_shape(mixtral_engine):
    from moetide.engine.sampling import SamplingParams

    engine = mixtral_engine
    engine.add_request(list(range(3, 23)), SamplingParams(max_tokens=3, ignore_eos=True))
    engine.step()  # the 20-token prompt: one sequence, pairs 20 x 21 / 2
    assert engine.last_step_shape == (20, 1, 0, 20, 210)
    engine.step()  # one decode token after 20 cached (the first sampled token is token 21)
    assert engine.last_step_shape == (1, 1, 1, 21, 21)


def test_calibrate_writes_a_device_file_the_replay_runs_on(tiny_checkpoint, tmp_path):
    ckpt = tiny_checkpoint("qwen3_moe")
    device = tmp_path / "cpu.toml"
    done = cli("calibrate", "--quick", "--threads", "1", "--model", str(ckpt), "--device-out", str(device))
    assert done.returncode == 0, done.stderr
    assert "engine steps on" in done.stdout and f"wrote {device}" in done.stdout
    data = tomllib.loads(device.read_text())
    assert data["matmul_dtype"] == "fp32" and set(data["efficiency"]) == {
        "matmul", "attention", "hbm", "attention_memory", "step_overhead_s", "seq_overhead_s", "request_overhead_s",
        "request_overhead_s_per_token"}
    assert data["measured"]["engine_steps"] > 10
    replay = cli("replay", "--model", str(ckpt), "--gpu", str(device), "--sessions", "2", "--kv-cache-memory",
                 "64MiB", "--max-num-batched-tokens", "1024", "--json", str(tmp_path / "r.json"))
    assert replay.returncode == 0, replay.stderr
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["config"]["dtype"] == "float32" and result["metrics"]["completed"] > 0


@pytest.mark.parametrize("argv,needle", [
    (("--device-out", "x.toml"), "--device-out describes the engine on a checkpoint: give --model DIR too"),
    (("--model", "/nonexistent"), "--model /nonexistent: not a checkpoint folder"),
])
def test_calibrate_device_argument_errors(argv, needle):
    done = cli("calibrate", "--quick", *argv, timeout=120)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and needle in done.stderr


def test_calibrate_refuses_a_bf16_checkpoint_and_a_bad_device_out(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text('{"model_type": "qwen3_moe", "dtype": "bfloat16"}')
    done = cli("calibrate", "--quick", "--model", str(ckpt), timeout=120)
    assert done.returncode == 2 and "the checkpoint is bfloat16; a CPU device is calibrated at fp32" in done.stderr
    (ckpt / "config.json").write_text('{"model_type": "qwen3_moe", "dtype": "float32"}')
    done = cli("calibrate", "--quick", "--model", str(ckpt), "--device-out", str(tmp_path / "cpu.json"), timeout=120)
    assert done.returncode == 2 and "must end in .toml" in done.stderr


def test_replay_dtype_errors_are_one_line_before_the_run(tmp_path):
    wrong = cli("replay", "--gpu", "h100", "--dtype", "float32", "--sessions", "2", timeout=120)
    assert wrong.returncode == 2 and wrong.stderr.count("\n") == 1
    assert "--dtype float32: h100-sxm's matmul rate is quoted at bf16" in wrong.stderr and "--dtype auto" in wrong.stderr
    path = tmp_path / "cpu.toml"
    path.write_text(DEVICE_TOML.replace("17179869184", str(256 * 2**30)))
    host = cli("replay", "--gpu", str(path), "--sessions", "2", "--kv-host-memory", "8GiB", timeout=120)
    assert host.returncode == 2 and host.stderr.count("\n") == 1
    assert "--kv-host-memory with --dtype float32" in host.stderr


def test_engine_steps_skip_runs_past_the_models_context(copy_checkpoint):
    from moetide.engine.measure import measure_engine_steps

    ckpt = copy_checkpoint("qwen3_moe")
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 200}))
    samples, requests = measure_engine_steps(str(ckpt), quick=True, num_threads=1)
    assert {n for n, _ in requests} == {32, 128} and all(t > 0 for _, t in requests)
    assert samples and max(s.shape.kv_tokens_read // s.shape.num_seqs for s in samples) <= 200
    assert {s.shape.num_tokens for s in samples} >= {32, 512}  # the 1 x 32 and 4 x 128 prompts ran


def test_request_overhead_is_charged_at_each_send(tmp_path, tiny_config):
    """A device whose server shares its core: each arriving request costs a + b x prompt tokens before it can run.
    One request alone: its TTFT grows by exactly that."""
    from test_bench_serve import write_mooncake

    from moetide.sim.setup import run_replay
    from moetide.workloads import load_workload

    trace = write_mooncake(tmp_path / "t.jsonl", [(0, 300, 4, [1])])
    plain, charged = tmp_path / "plain.toml", tmp_path / "charged.toml"
    plain.write_text(DEVICE_TOML + "\n[efficiency]\nrequest_overhead_s = 0.0\n")  # a measured file's table, no charge
    charged.write_text(DEVICE_TOML + "\n[efficiency]\nrequest_overhead_s = 0.004\nrequest_overhead_s_per_token = 1e-5\n")
    ttft = {}
    for path in (plain, charged):
        result, _ = run_replay(load_workload(trace, seed=0), ReplayConfig(model=tiny_config, gpu=str(path),
                                                                          kv_cache_memory=int(0.5 * 2**30)))
        ttft[path] = result["metrics"]["ttft_s"]["p50"]
    assert ttft[charged] - ttft[plain] == pytest.approx(0.004 + 300 * 1e-5, rel=1e-9)
    assert Efficiency().request_overhead_s == 0.0  # the presets charge nothing


def test_request_overhead_fit_on_hand_cases():
    assert fit_request_overhead([(100, 0.002), (300, 0.004), (500, 0.006)]) == (pytest.approx(0.001),
                                                                               pytest.approx(1e-5))
    assert fit_request_overhead([(100, 0.001), (300, 0.001)]) == (pytest.approx(0.001), 0.0)  # flat: no slope
    assert fit_request_overhead([(100, 0.001), (200, 0.004)])[0] == 0.0  # a negative intercept: through 0
    assert fit_request_overhead([]) == (0.0, 0.0)
