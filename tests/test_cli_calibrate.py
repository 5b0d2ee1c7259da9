"""``moetide calibrate``: the host file it writes (round trip, plan-split accepts it), its fit, its errors, and which
kernel it times for which shape (the engine's: native paged decode for fp32 decode, flash otherwise).

One real ``--quick`` run (module fixture, needs torch); everything else uses a synthetic ``Calibration`` so it is
fast and exact, or times tiny shapes once. No timing is asserted: the measured figures only have to be positive and
finite.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import tomllib
from pathlib import Path

import pytest

import moetide.commands.calibrate as calibrate_cmd
from moetide.cli import main
from moetide.commands.calibrate import host_file_text
from moetide.errors import UserError
from moetide.perf.attention import AttentionCostModel, OffloadEfficiency
from moetide.perf.calibrate import (
    FLASH_KERNEL,
    KERNELS,
    KV_DTYPE_BYTES,
    MLA_SHAPE,
    NATIVE_KERNEL,
    AttentionSample,
    AttentionShape,
    Calibration,
    CpuFit,
    DramResult,
    calibration_kernels,
    calibration_shapes,
    errors_by_kernel,
    fit_cpu_efficiency,
    model_cpu_s,
    offload_efficiency_for_host,
)
from moetide.specs import get_gpu, get_host, get_model
from moetide.specs.loader import get_host_calibration

D, C = 25e9, 90e9  # synthetic triad bandwidth and GEMM rate


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def assert_one_line_error(rc: int, out: str, err: str, verb: str, *needles: str) -> None:
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith(f"moetide {verb}: error: ")
    assert "Traceback" not in err
    for needle in needles:
        assert needle in err


def engine_kernel(shape: AttentionShape) -> str:
    """The kernel a 1-thread calibration with the native library times ``shape`` with."""
    return "native" if shape.num_queries == 1 and shape.kv_dtype == "fp32" else "flash"


def synthetic(*, h2d: dict | None = None) -> Calibration:
    fit = CpuFit(0.25, 0.6, 1.5e-4, 0.05, 0.2)
    shapes = calibration_shapes(True, 1)
    samples = tuple(AttentionSample(s, t, t * 0.9, engine_kernel(s)) for s in shapes
                    for t in [model_cpu_s(s, D, C, **fit.efficiency())])
    return Calibration(measured_at="2026-01-02T03:04:05+00:00", quick=True, clock="wall", torch_version="2.13.0+cpu",
                       num_threads=1, logical_cpus=2, cpu_model='AMD "EPYC"', dram_bytes=24 * 2**30,
                       llc_bytes=32 * 2**20, dram=DramResult(128 * 2**20, D, 20e9, 28e9),
                       append_bytes_per_s=0.25 * D, gemm_n=1024,
                       gemm_flops_per_s=C, attention=samples, fit=fit,
                       host_to_device=h2d or {"skipped": "no CUDA device (test)"})


# ---- one real quick run -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    pytest.importorskip("torch")
    out = tmp_path_factory.mktemp("calibrate") / "host.toml"
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        rc = main(["calibrate", "--quick", "--threads", "1", "--json", "-", "--out", str(out)])
    assert rc == 0 and stderr.getvalue() == ""
    return json.loads(stdout.getvalue()), out


def test_quick_run_json(quick_run):
    doc, out = quick_run
    assert doc["measured"] is True and doc["quick"] is True and doc["num_threads"] == 1 and doc["out"] == str(out)
    for key in ("triad_bytes_per_s", "copy_bytes_per_s", "read_bytes_per_s"):
        assert math.isfinite(doc["dram"][key]) and doc["dram"][key] > 0
    assert doc["dram"]["buffer_bytes"] >= 4 * doc["llc_bytes"]  # much larger than the last-level cache
    assert len(doc["attention"]) == len(calibration_shapes(True, 1))
    assert {a["kv_dtype"] for a in doc["attention"]} == {"fp32", "bf16"}
    assert all(a["seconds"] > 0 and a["kv_bytes_per_s"] > 0 for a in doc["attention"])
    assert 0 < doc["fit"]["cpu_memory"] <= 1 and 0 < doc["fit"]["cpu_compute"] <= 1 and doc["fit"]["cpu_sync_s"] >= 0
    assert doc["append_bytes_per_s"] > 0
    assert doc["host_append"] == pytest.approx(min(1, doc["append_bytes_per_s"] / doc["dram"]["triad_bytes_per_s"]))
    assert ("bytes_per_s" in doc["host_to_device"]) != ("skipped" in doc["host_to_device"])


def test_quick_run_times_the_engines_kernel_per_shape(quick_run):
    from moetide.engine import native

    doc, out = quick_run
    for a in doc["attention"]:
        decode_fp32 = a["num_queries"] == 1 and a["kv_dtype"] == "fp32"
        assert a["kernel"] == ("native" if decode_fp32 and native.available() else "flash"), a
    used = {a["kernel"] for a in doc["attention"]}
    assert doc["attention_kernel"] == {k: KERNELS[k] for k in KERNELS if k in used}
    mla = {a["kernel"] + "-mla" for a in doc["attention"] if a["mla_value_dim"]}
    assert mla == {"flash-mla", "native-mla" if native.available() else "flash-mla"}
    assert set(doc["fit_by_kernel"]) == used | mla
    assert 0 < doc["fit"]["cpu_compute_mla"] <= 1
    assert calibration_kernels(str(out)) == doc["attention_kernel"]


def test_quick_run_file_loads_back(quick_run):
    doc, out = quick_run
    host = get_host(str(out))
    assert host.dram_bandwidth_bytes_per_s == pytest.approx(doc["dram"]["triad_bytes_per_s"], rel=1e-4)
    assert host.fp32_flops_per_s == pytest.approx(doc["gemm_flops_per_s"], rel=1e-4)
    assert host.num_cores == 1
    eff = offload_efficiency_for_host(str(out))
    assert eff.cpu_memory == pytest.approx(doc["fit"]["cpu_memory"], rel=1e-4)
    assert eff.cpu_sync_s == pytest.approx(doc["fit"]["cpu_sync_s"], rel=1e-4, abs=1e-9)
    assert eff.host_append == pytest.approx(doc["host_append"], rel=1e-4)
    assert get_host_calibration(str(out))["measured"]["num_threads"] == 1
    assert "MEASURED" in out.read_text() and doc["measured_at"] in out.read_text()


def test_plan_split_accepts_the_quick_file(quick_run, capsys):
    _, out = quick_run  # --vram-gib 80 and one sequence: the file's dram_bytes is this (maybe small) machine's
    rc, stdout, err = run_cli(capsys, "plan-split", "--model", "qwen3-30b-a3b", "--gpu", "a100-80gb", "--cpu",
                              str(out), "--gpu-memory", "80GiB", "--batch", "1", "--context", "8k,64k", "--json", "-")
    assert rc == 0 and err == ""
    assert json.loads(stdout)["cpu"] == get_host(str(out)).name


# ---- the file, from a synthetic calibration -----------------------------------------------------------------


def test_file_round_trips(tmp_path):
    cal = synthetic()
    path = tmp_path / "h.toml"
    path.write_text(host_file_text(cal, name="box"))
    host = get_host(str(path))
    assert (host.name, host.cpu_model, host.num_cores, host.dram_bytes) == ("box", 'AMD "EPYC"', 1, 24 * 2**30)
    assert host.num_memory_channels == 1 and host.dram_mega_transfers_per_s == math.ceil(D / 8e6)
    assert host.dram_bandwidth_bytes_per_s == pytest.approx(D, rel=1e-5) and host.fp32_flops_per_s == C
    eff = offload_efficiency_for_host(str(path))
    assert (eff.cpu_memory, eff.cpu_compute, eff.cpu_sync_s, eff.host_append) == (0.25, 0.6, 1.5e-4, 0.25)
    assert (eff.link, eff.transfer_latency_s) == (OffloadEfficiency().link, OffloadEfficiency().transfer_latency_s)
    tables = get_host_calibration(str(path))
    assert tables["measured"]["dram_copy_bytes_per_s"] == 20e9
    assert tables["measured"]["append_bytes_per_s"] == 0.25 * D
    assert tables["measured"]["host_to_device_skipped"] == "no CUDA device (test)"
    assert tables["measured"]["attention_kernel_native"] == NATIVE_KERNEL
    assert tables["measured"]["attention_kernel_flash"] == FLASH_KERNEL
    assert "attention_decode_fp32_native_kv_bytes_per_s" in tables["measured"]
    assert "attention_decode_bf16_flash_kv_bytes_per_s" in tables["measured"]
    assert calibration_kernels(str(path)) == {"flash": FLASH_KERNEL, "native": NATIVE_KERNEL}
    again = tmp_path / "again.toml"  # same calibration, same spec
    again.write_text(host_file_text(cal, name=host.name))
    assert get_host(str(again)) == host


def test_file_with_real_dram_configuration_and_a_gpu(tmp_path):
    cal = synthetic(h2d={"bytes_per_s": 53e9, "latency_s": 9e-6, "device": "GPU", "copy_bytes": 256 * 2**20})
    path = tmp_path / "h.toml"
    path.write_text(host_file_text(cal, name="box", dram_channels=2, dram_mega_transfers=4800))
    host = get_host(str(path))
    assert (host.num_memory_channels, host.dram_mega_transfers_per_s) == (2, 4800)
    assert host.dram_efficiency == pytest.approx(D / (2 * 4800 * 8e6), rel=1e-5)
    assert offload_efficiency_for_host(str(path)).transfer_latency_s == 9e-6
    assert tomllib.loads(path.read_text())["measured"]["host_to_device_bytes_per_s"] == 53e9


def test_thread_clock_is_recorded(tmp_path):
    cal = synthetic()
    path = tmp_path / "h.toml"
    path.write_text(host_file_text(Calibration(**{**cal.__dict__, "clock": "thread"}), name="box"))
    assert get_host_calibration(str(path))["measured"]["clock"] == "thread"
    assert "--clock thread" in get_host(str(path)).source


def test_cli_text_output_and_file(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(calibrate_cmd, "calibrate", lambda **kw: synthetic())
    out = tmp_path / "h.toml"
    rc, stdout, err = run_cli(capsys, "calibrate", "--out", str(out), "--name", "mine")
    assert rc == 0 and err == ""
    assert stdout.startswith('MEASURED on AMD "EPYC": 1 torch thread(s) of 2 logical CPUs, wall clock')
    assert "append 6.2 GB/s (host_append 0.250)" in stdout
    assert "triad 25.0 GB/s" in stdout and "fp32 GEMM 1024^3: 90.0 GFLOP/s" in stdout
    assert "cpu_memory 0.250, cpu_compute 0.600, cpu_sync_s 150.0 us" in stdout
    assert "host-to-device: skipped: no CUDA device (test)" in stdout and f"wrote {out}" in stdout
    assert get_host(str(out)).name == "mine"
    rows = [line.split() for line in stdout.splitlines() if line.startswith("16/")]
    assert len(rows) == len(synthetic().attention)
    for row in rows:  # heads seqs queries tokens dtype kernel ...: each row names the kernel its shape was timed with
        assert row[5] == ("native" if row[2] == "1" and row[4] == "fp32" else "flash"), row
    assert f"native: {NATIVE_KERNEL}" in stdout and f"flash: {FLASH_KERNEL}" in stdout
    assert "by kernel: flash (18 shapes) median 0.0%" in stdout and "native (6 shapes)" in stdout


def test_cli_json_names_each_samples_kernel(monkeypatch, capsys):
    monkeypatch.setattr(calibrate_cmd, "calibrate", lambda **kw: synthetic())
    rc, stdout, err = run_cli(capsys, "calibrate", "--json", "-")
    assert rc == 0 and err == ""
    doc = json.loads(stdout)
    assert doc["attention_kernel"] == {"flash": FLASH_KERNEL, "native": NATIVE_KERNEL}
    assert [a["kernel"] for a in doc["attention"]] == [s.kernel for s in synthetic().attention]
    assert doc["fit_by_kernel"]["native"]["shapes"] == 6 and doc["fit_by_kernel"]["flash"]["shapes"] == 18


# ---- the model and the fit --------------------------------------------------------------------------------


@pytest.mark.parametrize("kv_dtype,num_queries", [("bf16", 1), ("fp32", 1), ("bf16", 32)])
def test_model_formula_is_perf_attention(tmp_path, kv_dtype, num_queries):
    path = tmp_path / "h.toml"
    path.write_text(host_file_text(synthetic(), name="box"))
    host, eff = get_host(str(path)), offload_efficiency_for_host(str(path))
    spec = get_model("qwen3-30b-a3b")
    shape = AttentionShape(spec.num_attention_heads, spec.num_kv_heads, spec.head_dim, num_queries, 4096, kv_dtype, 3)
    a = AttentionCostModel(spec, get_gpu("h200"), host, kv_dtype_bytes=KV_DTYPE_BYTES[kv_dtype], offload=eff)
    assert shape.kv_bytes == 3 * 4096 * a.layer_kv_bytes_per_token
    assert shape.flops_per_kv_byte == pytest.approx(a.flops_per_kv_byte(num_queries))
    expected = a.cpu_attention_s(shape.kv_bytes, num_queries) + eff.cpu_sync_s
    got = model_cpu_s(shape, host.dram_bandwidth_bytes_per_s, host.fp32_flops_per_s, cpu_memory=eff.cpu_memory,
                      cpu_compute=eff.cpu_compute, cpu_sync_s=eff.cpu_sync_s)
    assert got == pytest.approx(expected, rel=1e-12)


def test_fit_recovers_the_factors_it_was_generated_with():
    cal = synthetic()  # samples are exactly the model with 0.25, 0.6, 150 us
    fit = fit_cpu_efficiency(cal.attention, D, C)
    assert fit.cpu_memory == pytest.approx(0.25, rel=0.03) and fit.cpu_compute == pytest.approx(0.6, rel=0.03)
    assert fit.cpu_sync_s == pytest.approx(1.5e-4, rel=0.1)
    assert fit.median_abs_rel_error < 0.01
    with pytest.raises(ValueError):
        fit_cpu_efficiency([], D, C)


def test_fit_gives_mla_its_own_compute_share():
    """MLA samples made with a compute share of 0.2 (GQA's 0.6): the GQA factors are fitted as before and the MLA
    share apart; the file carries it and the cost model of an MLA model uses it."""
    fit = CpuFit(0.25, 0.6, 1.5e-4, 0.05, 0.2, cpu_compute_mla=0.2)
    samples = tuple(AttentionSample(s, t, t, engine_kernel(s)) for s in calibration_shapes(True, 1)
                    for t in [model_cpu_s(s, D, C, **fit.efficiency())])
    got = fit_cpu_efficiency(samples, D, C)
    assert got.cpu_compute == pytest.approx(0.6, rel=0.03) and got.cpu_compute_mla == pytest.approx(0.2, rel=0.03)
    assert got.median_abs_rel_error < 0.01
    lite = AttentionShape(num_queries=1, kv_tokens=4096, kv_dtype="bf16", num_seqs=1, **MLA_SHAPE)
    assert lite.is_mla and lite.kind == "mla_decode"
    a = AttentionCostModel(get_model("deepseek-v2-lite"), get_gpu("a100-40gb"), get_host("ddr4-3200-8ch"),
                           offload=OffloadEfficiency(cpu_compute_mla=0.2))
    assert lite.kv_bytes == 4096 * a.layer_kv_bytes_per_token  # one latent a token, stored once
    assert lite.flops_per_kv_byte == pytest.approx(a.flops_per_kv_byte(1))
    slower = AttentionCostModel(get_model("deepseek-v2-lite"), get_gpu("a100-40gb"), get_host("ddr4-3200-8ch"),
                                offload=OffloadEfficiency(cpu_compute_mla=0.1))
    assert slower.cpu_s_per_byte() == pytest.approx(2 * a.cpu_s_per_byte())  # compute-bound: twice the time
    gqa = AttentionCostModel(get_model("qwen3-30b-a3b"), get_gpu("a100-40gb"), get_host("ddr4-3200-8ch"),
                             offload=OffloadEfficiency(cpu_compute_mla=0.1))
    assert gqa.cpu_s_per_byte() == AttentionCostModel(get_model("qwen3-30b-a3b"), get_gpu("a100-40gb"),
                                                      get_host("ddr4-3200-8ch")).cpu_s_per_byte()


def test_errors_by_kernel_splits_the_fits_error():
    cal = synthetic()
    off = tuple(AttentionSample(s.shape, s.seconds * (2 if s.kernel == "native" else 1), s.seconds_min, s.kernel)
                for s in cal.attention)  # the native samples take twice the model's time
    errors = errors_by_kernel(off, D, C, cal.fit.efficiency())
    assert errors["flash"] == {"shapes": 18, "median_abs_rel_error": pytest.approx(0, abs=1e-12),
                               "max_abs_rel_error": pytest.approx(0, abs=1e-12)}
    assert errors["native"]["shapes"] == 6 and errors["native"]["median_abs_rel_error"] == pytest.approx(0.5)


def test_shape_validation():
    with pytest.raises(ValueError, match="multiple"):
        AttentionShape(32, 5, 128, 1, 10, "fp32")
    with pytest.raises(ValueError, match="kv_dtype"):
        AttentionShape(32, 4, 128, 1, 10, "fp8")


# ---- errors -------------------------------------------------------------------------------------------------


def _no_measuring(**kw):
    raise AssertionError("calibrate measured before checking its arguments")


@pytest.mark.parametrize("make_out,needle", [
    (lambda p: p / "missing" / "h.toml", "does not exist"),
    (lambda p: p, "is a directory"),
    (lambda p: p / "h.json", "must end in .toml"),
])
def test_bad_out_path_fails_before_measuring(monkeypatch, tmp_path, capsys, make_out, needle):
    monkeypatch.setattr(calibrate_cmd, "calibrate", _no_measuring)
    dir_named_toml = tmp_path / "d.toml"
    dir_named_toml.mkdir()
    out = make_out(dir_named_toml if needle == "is a directory" else tmp_path)
    rc, stdout, err = run_cli(capsys, "calibrate", "--quick", "--out", str(out))
    assert_one_line_error(rc, stdout, err, "calibrate", "--out", needle)


def test_unwritable_out(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(calibrate_cmd, "calibrate", lambda **kw: synthetic())

    def refuse(self, *a, **kw):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(Path, "write_text", refuse)
    rc, stdout, err = run_cli(capsys, "calibrate", "--out", str(tmp_path / "h.toml"))
    assert_one_line_error(rc, stdout, err, "calibrate", "cannot write", "Permission denied")


@pytest.mark.parametrize("argv,needle", [
    (["--threads", "0"], "--threads"),
    (["--dram-channels", "8"], "go together"),
    (["--clock", "thread", "--threads", "2"], "needs --threads 1"),
    (["--dram-channels", "1", "--dram-mts", "100"], "exceeds the peak"),  # 0.8 GB/s < the measured 25
    (["--costs-out", "costs.json"], "use it with --engine vllm"),
])
def test_bad_arguments(monkeypatch, capsys, argv, needle):
    monkeypatch.setattr(calibrate_cmd, "calibrate", lambda **kw: synthetic())
    rc, stdout, err = run_cli(capsys, "calibrate", *argv)
    assert_one_line_error(rc, stdout, err, "calibrate", needle)


def _host_file(tmp_path: Path, extra: str) -> Path:
    text = host_file_text(synthetic(), name="box")
    path = tmp_path / "bad.toml"
    path.write_text(text.replace("[offload_efficiency]\n", "[offload_efficiency]\n" + extra, 1))
    return path


@pytest.mark.parametrize("extra,needle", [
    ('cpu_memry = 0.5\n', "unknown field(s) ['cpu_memry']"),
    ('cpu_available = "half"\n', "expected a number"),
    ("cpu_available = 2.0\n", "fraction"),
])
def test_bad_offload_efficiency(tmp_path, extra, needle):
    path = _host_file(tmp_path, extra)
    get_host(str(path))  # the HostSpec part is fine
    with pytest.raises(UserError, match="bad.toml") as info:
        offload_efficiency_for_host(str(path))
    assert needle in str(info.value)


@pytest.mark.parametrize("text,needle", [
    ("offload_efficiency = 3\n", "must be a table"),
    ("[measured]\nshapes = [1, 2]\n", "measured.shapes"),
    ("not toml [", "not valid TOML"),
])
def test_plan_split_rejects_a_bad_host_file_in_one_line(tmp_path, capsys, text, needle):
    good = host_file_text(synthetic(), name="box")
    head = good.split("[offload_efficiency]")[0]
    path = tmp_path / "bad.toml"
    path.write_text(text if text.startswith("not") else
                    (text + head if not text.startswith("[") else head + text))
    rc, stdout, err = run_cli(capsys, "plan-split", "--model", "qwen3-30b-a3b", "--gpu", "a100-80gb", "--cpu",
                              str(path), "--context", "8k")
    assert_one_line_error(rc, stdout, err, "plan-split", "bad.toml", needle)


def test_presets_have_no_calibration():
    assert get_host_calibration("ddr4-3200-8ch") == {"offload_efficiency": {}, "measured": {}}
    assert offload_efficiency_for_host("ddr4-3200-8ch") == OffloadEfficiency()


def test_plan_split_models_cpu_attention_with_the_files_fitted_factors(tmp_path, capsys):
    """The file's [offload_efficiency] reaches the model: a host whose attention kernel reaches a tenth of the
    bandwidth makes cpu-all slower than the same host at the full share, everything else equal."""
    text = host_file_text(synthetic(), name="box").replace("dram_bytes = 25769803776", "dram_bytes = 549755813888")
    times = {}
    for share in ("0.9", "0.09"):
        path = tmp_path / f"h{share}.toml"
        path.write_text(text.replace("cpu_memory = 0.25", f"cpu_memory = {share}", 1))
        rc, stdout, err = run_cli(capsys, "plan-split", "--model", "qwen3-30b-a3b", "--gpu", "a100-80gb", "--cpu",
                                  str(path), "--gpu-memory", "80GiB", "--batch", "1", "--context", "64k", "--json", "-")
        assert rc == 0, err
        times[share] = json.loads(stdout)["rows"][0]["step_time_s"]["cpu-all"]
    assert times["0.09"] > 2 * times["0.9"]


# ---- which kernel is timed ----------------------------------------------------------------------------------

TINY_DECODE = AttentionShape(8, 2, 32, 1, 200, "fp32", 2)  # 200 tokens: the last block of each sequence part-full


@pytest.fixture
def native_calls(monkeypatch):
    """(engine.native, calls): its cached library dropped before and after the test (so a MOETIDE_NATIVE the test
    sets counts), and every ``paged_decode_attention`` call recorded as (args, kwargs) in ``calls``."""
    pytest.importorskip("torch")
    from moetide.engine import native

    native.load.cache_clear()
    calls, kernel = [], native.paged_decode_attention

    def counted(*args, **kwargs):
        calls.append((args, kwargs))
        return kernel(*args, **kwargs)

    monkeypatch.setattr(native, "paged_decode_attention", counted)
    yield native, calls
    monkeypatch.undo()
    native.load.cache_clear()


def needs_native(native) -> None:
    if not native.available():
        pytest.skip(f"native kernels: {native.unavailable_reason()}")


def test_fp32_decode_is_timed_with_the_native_kernel_over_scattered_host_blocks(native_calls):
    import torch

    from moetide.perf.calibrate import NATIVE_LAYOUT_LAYERS
    from moetide.engine.measure import engine_block_size, time_attention

    native, calls = native_calls
    needs_native(native)
    sample = time_attention(TINY_DECODE, 1, 4096)
    assert sample.kernel == "native" and sample.as_dict()["kernel"] == "native" and sample.seconds > 0
    assert len(calls) == 3  # the check of its output, the warm-up, one timed call
    (q, k_rows, v_rows, key_rows, lengths, scale), kwargs = calls[-1]
    b, hq, hkv, d = 2, 8, 2, 32
    assert q.shape == (b, hq, d) and lengths.tolist() == [200, 200] and scale == pytest.approx(d**-0.5)
    assert kwargs["lse"].shape == (b, hq)  # the log-sum-exp, as the split backend asks for it
    assert k_rows.stride() == v_rows.stride() == (hkv * d, d, 1)  # read in place: one row per token slot
    bs = engine_block_size()
    per_seq, rows_per_block = math.ceil(200 / bs), 2 * NATIVE_LAYOUT_LAYERS * bs  # a block: every layer's K and V
    blocks = key_rows.view(b, per_seq, bs)
    assert (blocks - blocks[..., :1] == torch.arange(bs)).all()  # a block's slots are consecutive rows
    starts = blocks[..., 0].flatten().tolist()
    assert all(r % rows_per_block == 0 for r in starts)
    ids = [r // rows_per_block for r in starts]
    assert sorted(ids) == list(range(b * per_seq)) and ids != sorted(ids)  # every block once, scattered


def test_with_moetide_native_0_the_same_shape_is_timed_with_flash(native_calls, monkeypatch):
    from moetide.engine.measure import kernel_for, time_attention

    native, calls = native_calls
    monkeypatch.setenv("MOETIDE_NATIVE", "0")
    native.load.cache_clear()
    assert kernel_for(TINY_DECODE) == "flash"
    sample = time_attention(TINY_DECODE, 1, 4096)
    assert sample.kernel == "flash" and sample.as_dict()["kernel"] == "flash" and calls == []


@pytest.mark.parametrize("shape", [AttentionShape(8, 2, 32, 4, 200, "fp32"), AttentionShape(8, 2, 32, 1, 200, "bf16")],
                         ids=["prefill-fp32", "decode-bf16"])
def test_other_shapes_are_timed_with_flash(native_calls, shape):
    from moetide.engine.measure import time_attention

    _, calls = native_calls
    assert time_attention(shape, 1, 4096).kernel == "flash" and calls == []
    with pytest.raises(UserError, match="one fp32 query"):
        time_attention(shape, 1, 4096, kernel="native")


def test_native_only_where_the_engine_would_take_it_on_this_many_threads(native_calls):
    """The kernel is single-threaded: with several torch threads the engine keeps large decodes on torch's."""
    import torch

    from moetide.engine.measure import kernel_for

    native, _ = native_calls
    needs_native(native)
    large = AttentionShape(32, 8, 128, 1, 1024, "fp32")  # 8.4M multiply-adds
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert kernel_for(large) == "native"
        torch.set_num_threads(2)
        assert kernel_for(large) == "flash" and kernel_for(TINY_DECODE) == "native"
    finally:
        torch.set_num_threads(previous)


# What `moetide calibrate --out` wrote before it timed the native kernel: one attention_kernel, no kernel per sample.
OLD_HOST_FILE = """\
name = "calibrated-old"
cpu_model = "AMD EPYC"
num_cores = 1
num_memory_channels = 1
dram_mega_transfers_per_s = 3438
dram_efficiency = 0.999
fp32_flops_per_s = 9.59e+10
dram_bytes = 25769803776
source = "moetide calibrate, 2026-11-29T10:00:00+00:00, 1 torch thread(s), wall clock, torch 2.13.0+cpu"

[offload_efficiency]
cpu_memory = 0.168
cpu_compute = 0.594
cpu_sync_s = 8.4e-05

[measured]
measured_at = "2026-11-29T10:00:00+00:00"
num_threads = 1
clock = "wall"
fp32_gemm_flops_per_s = 9.59e+10
attention_kernel = "aten::_scaled_dot_product_flash_attention_for_cpu"
attention_decode_fp32_kv_bytes_per_s = 5.5e+09
attention_prefill_bf16_flops_per_s = 6.15e+10
host_to_device_skipped = "no CUDA device"
"""


def test_a_host_file_written_before_kernels_were_recorded_still_loads(tmp_path, capsys):
    path = tmp_path / "old.toml"
    path.write_text(OLD_HOST_FILE)
    assert get_host(str(path)).name == "calibrated-old"
    eff = offload_efficiency_for_host(str(path))
    assert (eff.cpu_memory, eff.cpu_compute, eff.cpu_sync_s) == (0.168, 0.594, 8.4e-05)
    assert calibration_kernels(str(path)) == {"flash": FLASH_KERNEL}
    rc, stdout, err = run_cli(capsys, "plan-split", "--model", "qwen3-30b-a3b", "--gpu", "a100-80gb", "--cpu",
                              str(path), "--gpu-memory", "80GiB", "--batch", "1", "--context", "8k", "--json", "-")
    assert rc == 0 and err == ""
    bare = tmp_path / "bare.toml"  # a hand-written host file: no [measured] at all
    bare.write_text(OLD_HOST_FILE.split("[offload_efficiency]")[0])
    assert calibration_kernels(str(bare)) == {} and calibration_kernels("ddr4-3200-8ch") == {}


def test_an_out_path_that_cannot_be_written_is_refused_before_measuring():
    """A read-only place (sysfs here, where not even root creates files) is one error line at once, not after the
    seconds of measuring whose results it would then lose."""
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-c", "import sys; from moetide.cli import main; sys.exit(main())",
                             "calibrate", "--out", "/sys/host.toml"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.strip() == "moetide calibrate: error: --out /sys/host.toml: cannot write there: " \
                                    "Permission denied"
