"""``moetide calibrate``: the host file it writes (round trip, plan-split accepts it), its fit, and its errors.

One real ``--quick`` run (module fixture, needs torch); everything else uses a synthetic ``Calibration`` so it is
fast and exact. No timing is asserted: the measured figures only have to be positive and finite.
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
    AttentionSample,
    AttentionShape,
    Calibration,
    CpuFit,
    KV_DTYPE_BYTES,
    DramResult,
    calibration_shapes,
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


def synthetic(*, h2d: dict | None = None) -> Calibration:
    fit = CpuFit(0.25, 0.6, 1.5e-4, 0.05, 0.2)
    shapes = calibration_shapes(True, 1)
    samples = tuple(AttentionSample(s, t, t * 0.9) for s in shapes
                    for t in [model_cpu_s(s, D, C, **fit.efficiency())])
    return Calibration(measured_at="2026-01-02T03:04:05+00:00", quick=True, clock="wall", torch_version="2.13.0+cpu",
                       num_threads=1, logical_cpus=2, cpu_model='AMD "EPYC"', dram_bytes=24 * 2**30,
                       llc_bytes=32 * 2**20, dram=DramResult(128 * 2**20, D, 20e9, 28e9), gemm_n=1024,
                       gemm_flops_per_s=C, attention=samples, fit=fit,
                       host_to_device=h2d or {"skipped": "no CUDA device (test)"})


# ---- one real quick run -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    pytest.importorskip("torch")
    out = tmp_path_factory.mktemp("calibrate") / "host.toml"
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        rc = main(["calibrate", "--quick", "--threads", "1", "--json", "--out", str(out)])
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
    assert ("bytes_per_s" in doc["host_to_device"]) != ("skipped" in doc["host_to_device"])


def test_quick_run_file_loads_back(quick_run):
    doc, out = quick_run
    host = get_host(str(out))
    assert host.dram_bandwidth_bytes_per_s == pytest.approx(doc["dram"]["triad_bytes_per_s"], rel=1e-4)
    assert host.fp32_flops_per_s == pytest.approx(doc["gemm_flops_per_s"], rel=1e-4)
    assert host.num_cores == 1
    eff = offload_efficiency_for_host(str(out))
    assert eff.cpu_memory == pytest.approx(doc["fit"]["cpu_memory"], rel=1e-4)
    assert eff.cpu_sync_s == pytest.approx(doc["fit"]["cpu_sync_s"], rel=1e-4, abs=1e-9)
    assert get_host_calibration(str(out))["measured"]["num_threads"] == 1
    assert "MEASURED" in out.read_text() and doc["measured_at"] in out.read_text()


def test_plan_split_accepts_the_quick_file(quick_run, capsys):
    _, out = quick_run  # --vram-gib 80 and one sequence: the file's dram_bytes is this (maybe small) machine's
    rc, stdout, err = run_cli(capsys, "plan-split", "--model", "qwen3-30b-a3b", "--gpu", "a100-80gb", "--cpu",
                              str(out), "--vram-gib", "80", "--batch", "1", "--context", "8k,64k", "--json")
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
    assert (eff.cpu_memory, eff.cpu_compute, eff.cpu_sync_s) == (0.25, 0.6, 1.5e-4)
    assert (eff.link, eff.transfer_latency_s) == (OffloadEfficiency().link, OffloadEfficiency().transfer_latency_s)
    tables = get_host_calibration(str(path))
    assert tables["measured"]["dram_copy_bytes_per_s"] == 20e9
    assert tables["measured"]["host_to_device_skipped"] == "no CUDA device (test)"
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
    assert "triad 25.0 GB/s" in stdout and "fp32 GEMM 1024^3: 90.0 GFLOP/s" in stdout
    assert "cpu_memory 0.250, cpu_compute 0.600, cpu_sync_s 150.0 us" in stdout
    assert "host-to-device: skipped: no CUDA device (test)" in stdout and f"wrote {out}" in stdout
    assert get_host(str(out)).name == "mine"


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
                                  str(path), "--vram-gib", "80", "--batch", "1", "--context", "64k", "--json")
        assert rc == 0, err
        times[share] = json.loads(stdout)["rows"][0]["step_time_s"]["cpu-all"]
    assert times["0.09"] > 2 * times["0.9"]
