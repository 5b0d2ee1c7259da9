"""HardwareSpec / HostSpec: preset figures, their provenance, users' own files, and validation."""

from __future__ import annotations

import dataclasses
import json
import re
import tomllib
from importlib import resources

import pytest

from moetide.cli import main
from moetide.errors import UserError
from moetide.specs import HardwareSpec, HostSpec, get_gpu, get_host, preset_names

GiB = 2**30
# theoretical x16 rates per direction; a measured pinned H2D figure must sit below them
PCIE_THEORETICAL_BYTES_PER_S = {"Gen3": 15.75e9, "Gen4": 31.5e9, "Gen5": 63e9}


def preset_text(file_name: str) -> str:
    return resources.files("moetide.specs").joinpath("presets", file_name).read_text(encoding="utf-8")


# ---- presets ------------------------------------------------------------------------------------------------


def test_preset_names():
    assert preset_names("gpu") == ["h200", "h100-sxm", "a100-40gb", "a100-80gb", "v100-32gb", "h100-nvl",
                                   "h100-pcie", "a100-pcie-40gb", "a100-pcie-80gb", "v100-pcie-32gb"]
    assert preset_names("host") == ["ddr4-3200-8ch", "ddr5-4800-8ch", "ddr5-4800-12ch", "ddr4-2933-8ch"]


def test_h200_figures():
    gpu = get_gpu("h200")
    assert gpu.hbm_bytes == 141 * GiB
    assert gpu.hbm_bandwidth_bytes_per_s == 4.8e12
    assert gpu.matmul_flops_per_s == pytest.approx(1979e12 / 2, rel=1e-3)  # dense = sparse headline / 2
    assert (gpu.matmul_dtype, gpu.host_link) == ("bf16", "PCIe Gen5 x16")
    assert gpu.ridge_flops_per_byte == pytest.approx(206.1, abs=0.1)


def test_aliases_and_case():
    assert get_gpu("H100") == get_gpu("h100-sxm") == get_gpu("H100-SXM")
    assert get_host("DDR5-4800-12CH").cpu_model == "AMD EPYC 9654 (Genoa)"


@pytest.mark.parametrize("alias, name", [
    ("H100-PCIe-80GB", "h100-pcie"), ("a100-40gb-pcie", "a100-pcie-40gb"), ("A100-80GB-PCIE", "a100-pcie-80gb"),
    ("v100-32gb-pcie", "v100-pcie-32gb"), ("a100-sxm-40gb", "a100-40gb"), ("a100-sxm-80gb", "a100-80gb"),
    ("V100-SXM2-32GB", "v100-32gb")])
def test_form_factor_aliases(alias, name):
    gpu = get_gpu(alias)
    assert gpu.name == name and gpu == get_gpu(name)


def test_host_alias_names_the_cpu():
    host = get_host("Xeon-Gold-5318Y")
    assert host.name == "ddr4-2933-8ch" and host == get_host("ddr4-2933-8ch")


@pytest.mark.parametrize("file_name", ["gpus.toml", "hosts.toml"])
def test_names_and_aliases_never_clash(file_name):
    """The alias map keeps the last table that claims a key, so a clash would silently shadow a preset."""
    keys = [key.lower() for name, table in tomllib.loads(preset_text(file_name)).items()
            for key in (name, *table.get("aliases", ()))]
    assert len(keys) == len(set(keys))


def test_v100_uses_fp16_tensor_figure():
    sxm2, pcie = get_gpu("v100-32gb"), get_gpu("v100-pcie-32gb")
    assert (sxm2.matmul_dtype, sxm2.matmul_flops_per_s) == ("fp16", 125e12)
    assert (pcie.matmul_dtype, pcie.matmul_flops_per_s) == ("fp16", 112e12)  # lower boost clock at 250 W
    assert all(get_gpu(n).matmul_dtype == "bf16" for n in preset_names("gpu") if not n.startswith("v100"))


# name: HBM GiB, HBM bytes/s, sparse BF16/FP16 headline TFLOP/s (None: the datasheet quotes dense), PCIe generation,
# bidirectional GPU-to-GPU link GB/s (NVLink bridge, or PCIe where there is none)
PCIE_CARDS = {
    "h100-nvl": (94, 3.9e12, 1671, "Gen5", 600),
    "h100-pcie": (80, 2.0e12, 1513, "Gen5", 600),
    "a100-pcie-40gb": (40, 1.555e12, 624, "Gen4", 600),
    "a100-pcie-80gb": (80, 1.935e12, 624, "Gen4", 600),
    "v100-pcie-32gb": (32, 900e9, None, "Gen3", 32),
}


@pytest.mark.parametrize("name", PCIE_CARDS)
def test_pcie_card_figures(name):
    hbm_gib, hbm_bandwidth, sparse_tflops, generation, link_gb_s = PCIE_CARDS[name]
    gpu = get_gpu(name)
    assert gpu.hbm_bytes == hbm_gib * GiB
    assert gpu.hbm_bandwidth_bytes_per_s == hbm_bandwidth
    if sparse_tflops is not None:
        assert gpu.matmul_flops_per_s == sparse_tflops * 1e12 / 2  # dense = sparse headline / 2
    assert gpu.host_link == f"PCIe {generation} x16"
    assert gpu.gpu_link_bandwidth_bytes_per_s == link_gb_s * 1e9 / 2  # one direction
    assert gpu.source.startswith("https://")


def test_pcie_cards_differ_from_their_sxm_parts_only_where_the_datasheet_does():
    assert get_gpu("a100-pcie-40gb") == dataclasses.replace(get_gpu("a100-40gb"), name="a100-pcie-40gb")
    a100_sxm, a100_pcie = get_gpu("a100-80gb"), get_gpu("a100-pcie-80gb")
    assert a100_pcie.hbm_bandwidth_bytes_per_s < a100_sxm.hbm_bandwidth_bytes_per_s
    assert a100_pcie.matmul_flops_per_s == a100_sxm.matmul_flops_per_s
    sxm, nvl, pcie = get_gpu("h100-sxm"), get_gpu("h100-nvl"), get_gpu("h100-pcie")
    assert pcie.matmul_flops_per_s < nvl.matmul_flops_per_s < sxm.matmul_flops_per_s
    assert nvl.hbm_bytes > sxm.hbm_bytes == pcie.hbm_bytes
    assert nvl.gpu_link_bandwidth_bytes_per_s < sxm.gpu_link_bandwidth_bytes_per_s  # bridge, not NVSwitch


def test_specs_cli_prints_h100_nvl(capsys):
    assert main(["specs", "--gpu", "h100-nvl"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("h100-nvl"))
    assert row.split() == ["h100-nvl", "94", "3,900", "835.5", "bf16", "PCIe", "Gen5", "x16", "55", "300"]
    assert "h100-sxm" not in out and "Host CPUs" not in out


@pytest.mark.parametrize("name", preset_names("gpu"))
def test_host_link_is_measured_not_theoretical(name):
    gpu = get_gpu(name)
    generation = re.search(r"Gen(\d)", gpu.host_link).group(0)
    theoretical = PCIE_THEORETICAL_BYTES_PER_S[generation]
    assert 0.6 * theoretical < gpu.host_link_bandwidth_bytes_per_s < 0.9 * theoretical
    assert gpu.gpu_link_bandwidth_bytes_per_s > gpu.host_link_bandwidth_bytes_per_s


@pytest.mark.parametrize("name, peak, cores, ghz", [
    ("ddr4-3200-8ch", 204.8e9, 40, 2.3), ("ddr5-4800-8ch", 307.2e9, 56, 2.0), ("ddr5-4800-12ch", 460.8e9, 96, 2.4),
    ("ddr4-2933-8ch", 187.712e9, 24, 2.1)])
def test_host_bandwidth_and_flops(name, peak, cores, ghz):
    host = get_host(name)
    assert host.peak_dram_bandwidth_bytes_per_s == peak  # channels x MT/s x 8 B
    assert host.dram_bandwidth_bytes_per_s == pytest.approx(peak * host.dram_efficiency)
    assert 0.6 <= host.dram_efficiency <= 0.9
    assert host.num_cores == cores
    assert host.fp32_flops_per_s == pytest.approx(cores * ghz * 1e9 * 32)


@pytest.mark.parametrize("file_name", ["gpus.toml", "hosts.toml", "models.toml"])
def test_every_preset_has_a_source(file_name):
    for name, table in tomllib.loads(preset_text(file_name)).items():
        assert table["source"].startswith("https://"), name


@pytest.mark.parametrize("file_name", ["gpus.toml", "hosts.toml"])
def test_every_hardware_number_has_a_comment(file_name):
    numeric = re.compile(r"^\w+\s*=\s*[-+]?[\d.][\d_.e+]*\s*(#.*)?$")
    numeric_lines = [line for line in preset_text(file_name).splitlines() if numeric.match(line)]
    assert len(numeric_lines) >= 15  # the pattern does see the figures
    for line in numeric_lines:
        assert "#" in line, f"{file_name}: no source comment on {line!r}"


# ---- users' own files ---------------------------------------------------------------------------------------

GPU_FIELDS = dict(hbm_bytes=24 * GiB, hbm_bandwidth_bytes_per_s=1.0e12, matmul_flops_per_s=165e12,
                  matmul_dtype="bf16", host_link_bandwidth_bytes_per_s=26e9, gpu_link_bandwidth_bytes_per_s=32e9)


def test_gpu_from_toml_file(tmp_path):
    path = tmp_path / "l4-ish.toml"
    path.write_text("\n".join(f"{k} = {json.dumps(v)}" for k, v in GPU_FIELDS.items()))
    gpu = get_gpu(str(path))
    assert gpu == HardwareSpec(name="l4-ish", source=str(path), **GPU_FIELDS)


def test_host_from_json_file(tmp_path):
    fields = dict(name="my-box", cpu_model="Xeon w9-3495X", num_cores=56, num_memory_channels=8,
                  dram_mega_transfers_per_s=4800, dram_efficiency=0.7, fp32_flops_per_s=3.4e12, dram_bytes=256 * GiB)
    path = tmp_path / "host.json"
    path.write_text(json.dumps(fields))
    host = get_host(str(path))
    assert host.name == "my-box" and host.peak_dram_bandwidth_bytes_per_s == 307.2e9


@pytest.mark.parametrize("change, pattern", [
    (dict(hbm_gb=80), r"unknown field\(s\) \['hbm_gb'\]; valid fields"),
    (dict(hbm_bytes=None), r"missing field\(s\) \['hbm_bytes'\]"),
    (dict(hbm_bytes=1.5e9), "field 'hbm_bytes': expected an integer"),
    (dict(matmul_dtype="tf32"), "matmul_dtype must be one of"),
    (dict(host_link_bandwidth_bytes_per_s=-1), "host_link_bandwidth_bytes_per_s must be a positive number"),
])
def test_bad_gpu_file_is_a_user_error_naming_file(tmp_path, change, pattern):
    fields = {k: v for k, v in {**GPU_FIELDS, **change}.items() if v is not None}
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps(fields))
    with pytest.raises(UserError, match=pattern) as info:
        get_gpu(str(path))
    assert str(path) in str(info.value)


def test_malformed_hardware_files(tmp_path):
    toml_path, json_path = tmp_path / "gpu.toml", tmp_path / "gpu.json"
    toml_path.write_text("hbm_bytes = = 3")
    json_path.write_text("[1, 2]")
    with pytest.raises(UserError, match=f"{toml_path}: not valid TOML"):
        get_gpu(str(toml_path))
    with pytest.raises(UserError, match="expected a table of fields"):
        get_gpu(str(json_path))
    with pytest.raises(UserError, match="cannot read hardware file"):
        get_host(str(tmp_path / "missing.toml"))


def test_unknown_names_list_valid_ones():
    with pytest.raises(UserError, match="unknown gpu 'b200'; valid names: h200, h100-sxm, a100-40gb"):
        get_gpu("b200")
    with pytest.raises(UserError, match="unknown host 'ddr3'; valid names: ddr4-3200-8ch"):
        get_host("ddr3")


# ---- dataclass validation -----------------------------------------------------------------------------------


def test_hardware_spec_validation():
    with pytest.raises(ValueError, match="name must be a non-empty string"):
        HardwareSpec(name="", **GPU_FIELDS)
    with pytest.raises(ValueError, match="hbm_bandwidth_bytes_per_s must be a positive number"):
        dataclasses.replace(get_gpu("h200"), hbm_bandwidth_bytes_per_s=float("nan"))
    with pytest.raises(ValueError, match="hbm_bytes must be a positive integer"):
        dataclasses.replace(get_gpu("h200"), hbm_bytes=True)


@pytest.mark.parametrize("change, pattern", [
    (dict(dram_efficiency=1.2), "dram_efficiency is sustained/peak and must be in \\(0, 1\\]"),
    (dict(dram_efficiency=0), "dram_efficiency must be a positive number"),
    (dict(num_memory_channels=0), "num_memory_channels must be a positive integer"),
    (dict(cpu_model=""), "cpu_model must be a non-empty string"),
])
def test_host_spec_validation(change, pattern):
    with pytest.raises(ValueError, match=pattern):
        dataclasses.replace(get_host("ddr5-4800-12ch"), **change)


def test_specs_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        get_host("ddr4-3200-8ch").num_cores = 1  # type: ignore[misc]
    assert isinstance(get_host("ddr4-3200-8ch"), HostSpec)


def test_each_gpu_preset_names_its_host_and_serving_defaults_as_data():
    """--cpu's default is the GPU's own host (a field of its entry), and vLLM's A100 exception to its batch rule is
    data of the A100 entries, not a test of the name."""
    from moetide.sim.vllm_defaults import vllm_serving_defaults
    from moetide.specs import get_gpu, get_host, host_for

    assert host_for(None, get_gpu("h100")) == "ddr5-4800-8ch"
    assert host_for(None, get_gpu("a100-80gb")) == "ddr4-3200-8ch"
    assert host_for("ddr5-4800-12ch", get_gpu("a100-80gb")) == "ddr5-4800-12ch"
    for name in preset_names("gpu"):
        gpu = get_gpu(name)
        assert get_host(gpu.host).name == gpu.host  # every preset's host is a host preset
    assert vllm_serving_defaults(get_gpu("a100-80gb")) == (2048, 256)  # 80 GiB, but an A100
    assert vllm_serving_defaults(get_gpu("h100")) == vllm_serving_defaults(get_gpu("h200")) == (8192, 1024)


def test_a_gpu_file_without_a_host_needs_cpu_only_where_a_host_is_used(tmp_path):
    from moetide.errors import UserError
    from moetide.specs import get_gpu, host_for

    path = tmp_path / "gpu.toml"
    path.write_text('hbm_bytes = 85899345920\nhbm_bandwidth_bytes_per_s = 3.35e12\nmatmul_flops_per_s = 9.9e14\n'
                    'matmul_dtype = "bf16"\nhost_link_bandwidth_bytes_per_s = 5.5e10\n'
                    'gpu_link_bandwidth_bytes_per_s = 4.5e11\n')
    gpu = get_gpu(str(path))
    assert gpu.host == "" and gpu.max_num_batched_tokens == 0
    with pytest.raises(UserError, match="names no host CPU"):
        host_for(None, gpu)
    from moetide.sim.setup import ReplayConfig, resolve_config
    from moetide.specs import get_model

    model = get_model("qwen3-30b-a3b")
    assert resolve_config(ReplayConfig(gpu=str(path)), model, gpu).cpu is None  # no host is used: none is asked for
    with pytest.raises(UserError, match="give --cpu"):
        resolve_config(ReplayConfig(gpu=str(path), kv_host_memory=2**30), model, gpu)
    assert resolve_config(ReplayConfig(gpu=str(path), kv_host_memory=2**30, cpu="ddr4-3200-8ch"), model,
                          gpu).cpu == "ddr4-3200-8ch"
