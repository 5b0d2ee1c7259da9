"""Hardware facts: one accelerator (``HardwareSpec``) and the host CPU socket beside it (``HostSpec``).

Invariant: each field is a single measured or datasheet figure in base SI units (bytes, bytes/s, FLOP/s), and
the figure that moves data between host and device is the *measured* pinned host-to-device bandwidth of the
platform's PCIe generation, never the bus's theoretical rate: staging experts or KV over PCIe is where this
project lives, and the theoretical number overstates it by ~25-60%. DRAM bandwidth is derived from channels x
MT/s x 8 B and scaled by a named, sourced efficiency (a STREAM-Triad-like ratio) so the peak and the expected
figure are both visible. Calibration on a real machine replaces any of these by building a new spec.

No I/O here; presets and user files are read in ``moetide.specs.loader``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MATMUL_DTYPES = ("bf16", "fp16", "fp32")


def _require_positive_number(owner: str, **values: float) -> None:
    for field_name, value in values.items():
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
        if not ok:
            raise ValueError(f"{owner}: {field_name} must be a positive number, got {value!r}")


def _require_positive_int(owner: str, **values: int) -> None:
    for field_name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{owner}: {field_name} must be a positive integer, got {value!r}")


def _require_name(kind: str, name: object) -> None:
    if not isinstance(name, str) or not name:
        raise ValueError(f"{kind}: name must be a non-empty string, got {name!r}")


@dataclass(frozen=True)
class HardwareSpec:
    """One GPU (or a CPU described as the device, ``moetide calibrate --device-out``). ``matmul_flops_per_s`` is
    the dense (no sparsity) tensor-core rate at ``matmul_dtype``;
    ``gpu_link_bandwidth_bytes_per_s`` is one direction of the GPU's NVLink, what a ring all-reduce uses."""

    name: str
    hbm_bytes: int
    hbm_bandwidth_bytes_per_s: float
    matmul_flops_per_s: float
    matmul_dtype: str  # "bf16"; "fp16" where the GPU has no bf16 tensor cores (V100); "fp32" for a CPU as device
    host_link_bandwidth_bytes_per_s: float  # measured pinned host-to-device copy rate
    gpu_link_bandwidth_bytes_per_s: float
    host_link: str = ""  # e.g. "PCIe Gen5 x16"
    # the host CPU (a preset name or file) of the platform the GPU usually sits in: --cpu's default ("": none known)
    host: str = ""
    # vLLM's server batch defaults on this GPU where they depart from its rule by memory (0: the rule)
    max_num_batched_tokens: int = 0
    max_num_seqs: int = 0
    source: str = ""

    def __post_init__(self) -> None:
        _require_name("HardwareSpec", self.name)
        owner = f"HardwareSpec {self.name!r}"
        _require_positive_int(owner, hbm_bytes=self.hbm_bytes)
        _require_positive_number(owner, hbm_bandwidth_bytes_per_s=self.hbm_bandwidth_bytes_per_s,
                                 matmul_flops_per_s=self.matmul_flops_per_s,
                                 host_link_bandwidth_bytes_per_s=self.host_link_bandwidth_bytes_per_s,
                                 gpu_link_bandwidth_bytes_per_s=self.gpu_link_bandwidth_bytes_per_s)
        if self.matmul_dtype not in MATMUL_DTYPES:
            raise ValueError(f"{owner}: matmul_dtype must be one of {list(MATMUL_DTYPES)}, got {self.matmul_dtype!r}")
        if (self.max_num_batched_tokens < 0 or self.max_num_seqs < 0
                or (self.max_num_batched_tokens == 0) != (self.max_num_seqs == 0)):
            raise ValueError(f"{owner}: max_num_batched_tokens and max_num_seqs are both given (> 0) or both absent")

    @property
    def ridge_flops_per_byte(self) -> float:
        """Arithmetic intensity above which a kernel is compute-bound on this GPU (roofline ridge point)."""
        return self.matmul_flops_per_s / self.hbm_bandwidth_bytes_per_s


@dataclass(frozen=True)
class HostSpec:
    """One CPU socket and its DRAM (the NUMA node the GPU hangs off). ``fp32_flops_per_s`` is the vector FMA
    peak at base clock (cores x GHz x FLOP/cycle) of the representative ``cpu_model``."""

    name: str
    cpu_model: str
    num_cores: int
    num_memory_channels: int
    dram_mega_transfers_per_s: int  # DDR speed grade, MT/s
    dram_efficiency: float  # sustained (STREAM-Triad-like) / peak, in (0, 1]
    fp32_flops_per_s: float
    dram_bytes: int  # installed capacity
    channel_width_bytes: int = 8  # one 64-bit DDR channel (ECC bits excluded)
    source: str = ""

    def __post_init__(self) -> None:
        _require_name("HostSpec", self.name)
        owner = f"HostSpec {self.name!r}"
        if not isinstance(self.cpu_model, str) or not self.cpu_model:
            raise ValueError(f"{owner}: cpu_model must be a non-empty string, got {self.cpu_model!r}")
        _require_positive_int(owner, num_cores=self.num_cores, num_memory_channels=self.num_memory_channels,
                              dram_mega_transfers_per_s=self.dram_mega_transfers_per_s, dram_bytes=self.dram_bytes,
                              channel_width_bytes=self.channel_width_bytes)
        _require_positive_number(owner, fp32_flops_per_s=self.fp32_flops_per_s,
                                 dram_efficiency=self.dram_efficiency)
        if self.dram_efficiency > 1:
            raise ValueError(f"{owner}: dram_efficiency is sustained/peak and must be in (0, 1], "
                             f"got {self.dram_efficiency!r}")

    @property
    def peak_dram_bandwidth_bytes_per_s(self) -> float:
        """channels x MT/s x bytes per transfer."""
        return float(self.num_memory_channels * self.dram_mega_transfers_per_s * 1_000_000
                     * self.channel_width_bytes)

    @property
    def dram_bandwidth_bytes_per_s(self) -> float:
        """Sustained bandwidth the perf model should use: peak x dram_efficiency."""
        return self.peak_dram_bandwidth_bytes_per_s * self.dram_efficiency
