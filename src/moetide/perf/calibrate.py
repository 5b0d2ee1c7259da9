"""Calibration: measure this machine, and fit the CPU-attention factors of ``perf.attention`` to it.

MEASURED, on the machine that runs it (everything else in ``perf`` is modeled):

- sustained DRAM bandwidth, STREAM-like: triad (a = b + s c), copy and a read-only sum over fp32 buffers of at
  least 4x the last-level cache each, median of repeats. Triad is the figure the model uses, counted as STREAM
  counts it (two reads and one write per element; write-allocate traffic is not counted);
- the fp32 GEMM rate (``torch.mm`` on square matrices): the compute ceiling that ``cpu_compute`` is a share of.
  It is what a tuned kernel reaches on this machine, not the datasheet FMA peak;
- CPU attention, with the kernel the engine's split backend runs for that shape (``kernel_for``; each sample
  records it, ``KERNELS`` names them). Both return the log-sum-exp a split merge needs:

  * ``native``: decode (one query token per sequence) over fp32 KV, where ``engine.native`` is available and the
    engine would take it (``native.decode_worth_it`` on this thread count): ``engine.native.paged_decode_attention``
    reading K and V in place from a block cache in the engine's host layout (``engine.host_kv.HostKVStorage``,
    ``NATIVE_LAYOUT_LAYERS`` full-attention layers per block, the engine's default block size), each sequence's
    blocks scattered by a random permutation, with the ``lse`` output as the split backend asks for it;
  * ``flash``: everything else (prefill chunks, bf16 KV, ``MOETIDE_NATIVE=0``, no C compiler, or a decode too
    large for the single-threaded kernel on several threads), torch's CPU flash attention
    (``aten::_scaled_dot_product_flash_attention_for_cpu``). GQA runs as one problem per KV head: queries
    [B, H_kv, G x Q, d] (the G query heads that share a KV head, times Q query tokens, are rows) against
    contiguous keys and values [B, H_kv, N, d]. Host KV precedes a prefill chunk, so there is no mask.

  Before every timed call a buffer of twice the last-level cache is read, so the KV comes from DRAM, as host KV
  does in serving;
- a monolithic cache's append (``measure_append``: a concatenation into a fresh tensor past the allocator's mmap
  threshold, as a transformers ``DynamicCache`` appends), whose share of triad is ``host_append``;
- the pinned host-to-device copy rate and a small copy's latency, when a CUDA device exists.

Times are wall-clock by default. On a shared machine, ``clock="thread"`` (one torch thread only) times the calling
thread's CPU time instead, which leaves out the time other processes hold the core; it does not remove their
pressure on the shared cache and DRAM.

The fit. ``perf.attention`` charges one layer's CPU attention as

    t = cpu_sync_s + bytes x max(1 / (D x cpu_memory), f / (C x cpu_compute))

with D the triad bandwidth, C the GEMM rate and f the FLOPs per KV byte (``model_cpu_s`` is that formula for one
``AttentionShape``; a test pins it to ``AttentionCostModel``). ``fit_cpu_efficiency`` picks cpu_memory,
cpu_compute and cpu_sync_s that minimise the squared log error over the measured shapes, by a grid search that is
then refined. A roofline takes the slower of memory and compute; a kernel that pays for both (small GEMMs, the
softmax's exponentials) does not fit it exactly, and the fit's own error says by how much. The fit is one roofline
over the samples of both kernels, as ``perf.attention`` has one set of factors; ``errors_by_kernel`` says how well it
describes each. Judge the model on shapes it was not fitted to (``benchmarks/cpu_attention_model.py``).

The measuring functions, and ``calibrate`` that runs them, are in ``engine.measure`` (torch imported inside
them only); the fit and ``offload_efficiency_for_host`` are stdlib, so a core install can read and check a calibrated host file
(``moetide.commands.calibrate`` renders and writes it).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from moetide.errors import UserError
from moetide.perf.attention import OffloadEfficiency
from moetide.specs.loader import get_host_calibration

MiB = 2**20
KV_DTYPE_BYTES = {"fp32": 4, "bf16": 2}
DEFAULT_LLC_BYTES = 32 * MiB  # when sysfs does not say
FLASH_KERNEL = "aten::_scaled_dot_product_flash_attention_for_cpu"
NATIVE_KERNEL = "moetide.engine.native.paged_decode_attention"
KERNELS = {"flash": FLASH_KERNEL, "native": NATIVE_KERNEL}  # a sample's ``kernel`` -> what was timed
NATIVE_LAYOUT_LAYERS = 2  # full-attention layers per block of the timed cache: a layer's tiles are not adjacent
FITTED_FIELDS = ("cpu_memory", "cpu_compute", "cpu_sync_s")
MIN_EFFICIENCY = 1e-3
MAX_SYNC_S = 1e-3
# wall: elapsed time, what serving sees. thread: the calling thread's CPU time (1 torch thread only), which leaves
# out the time other processes hold the core: on a shared machine, closer to what the core alone would do.
CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "thread": time.thread_time}


# ---- shapes and the model ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AttentionShape:
    """One CPU attention call: ``num_seqs`` sequences of one layer, each ``num_queries`` new tokens attending
    ``kv_tokens`` host-resident tokens of ``kv_dtype`` KV (the queries have the same dtype).

    ``mla_value_dim``: multi-head latent attention in the absorbed form (``engine.models.deepseek_v2``): one KV
    head whose ``head_dim``-wide key is the latent plus the rope key, stored once, and whose value is its first
    ``mla_value_dim`` elements. Its bytes and FLOPs are counted as ``perf.attention`` counts them (one stored
    vector a token; QK^T over ``head_dim`` and PV over ``mla_value_dim``)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_queries: int
    kv_tokens: int
    kv_dtype: str
    num_seqs: int = 1
    mla_value_dim: int | None = None

    def __post_init__(self) -> None:
        for name in ("num_heads", "num_kv_heads", "head_dim", "num_queries", "kv_tokens", "num_seqs"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"AttentionShape.{name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"AttentionShape: {self.num_heads} query heads are not a multiple of "
                             f"{self.num_kv_heads} KV heads")
        if self.kv_dtype not in KV_DTYPE_BYTES:
            raise ValueError(f"AttentionShape.kv_dtype must be one of {list(KV_DTYPE_BYTES)}, got {self.kv_dtype!r}")
        if self.mla_value_dim is not None and (self.num_kv_heads != 1 or not 0 < self.mla_value_dim <= self.head_dim):
            raise ValueError(f"AttentionShape: MLA has one KV head and a value of at most head_dim "
                             f"({self.head_dim}) elements, got {self.num_kv_heads} and {self.mla_value_dim}")

    @property
    def is_mla(self) -> bool:
        return self.mla_value_dim is not None

    @property
    def kv_bytes(self) -> int:
        tiles = 1 if self.is_mla else 2  # MLA stores one vector a token, read as key and value
        return (self.num_seqs * tiles * self.num_kv_heads * self.kv_tokens * self.head_dim
                * KV_DTYPE_BYTES[self.kv_dtype])

    @property
    def flops(self) -> int:
        """QK^T and PV: 2 d each per query head, query token and key (MLA: 2 head_dim + 2 mla_value_dim)."""
        pair = 2 * (self.head_dim + self.mla_value_dim) if self.is_mla else 4 * self.head_dim
        return self.num_seqs * pair * self.num_heads * self.num_queries * self.kv_tokens

    @property
    def flops_per_kv_byte(self) -> float:
        return self.flops / self.kv_bytes

    @property
    def kind(self) -> str:
        """decode or prefill, prefixed ``mla_`` for latent attention (``attention_summary``'s groups)."""
        return ("mla_" if self.is_mla else "") + ("decode" if self.num_queries == 1 else "prefill")

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True, slots=True)
class AttentionSample:
    shape: AttentionShape
    seconds: float  # median over the timed calls
    seconds_min: float
    kernel: str = "flash"  # a key of KERNELS

    def as_dict(self) -> dict[str, Any]:
        return {**self.shape.as_dict(), "kernel": self.kernel, "kv_bytes": self.shape.kv_bytes,
                "flops": self.shape.flops, "seconds": self.seconds, "seconds_min": self.seconds_min,
                "kv_bytes_per_s": self.shape.kv_bytes / self.seconds, "flops_per_s": self.shape.flops / self.seconds}


def model_cpu_s(shape: AttentionShape, dram_bytes_per_s: float, flops_per_s: float, *, cpu_memory: float,
                cpu_compute: float, cpu_sync_s: float, cpu_compute_mla: float | None = None) -> float:
    """perf.attention's CPU time for one call of ``shape`` (module docstring), hand-off included; an MLA shape
    takes ``cpu_compute_mla`` as its compute share where given."""
    compute = cpu_compute_mla if shape.is_mla and cpu_compute_mla is not None else cpu_compute
    per_byte = max(1.0 / (dram_bytes_per_s * cpu_memory), shape.flops_per_kv_byte / (flops_per_s * compute))
    return cpu_sync_s + shape.kv_bytes * per_byte


@dataclass(frozen=True, slots=True)
class CpuFit:
    """Fitted factors and the fit's error on the shapes it was fitted to (relative: model / measured - 1).
    ``cpu_compute_mla``: the MLA shapes' own compute share (None: no MLA shape was timed)."""

    cpu_memory: float
    cpu_compute: float
    cpu_sync_s: float
    median_abs_rel_error: float
    max_abs_rel_error: float
    cpu_compute_mla: float | None = None

    def efficiency(self) -> dict[str, float]:
        fields = {name: getattr(self, name) for name in FITTED_FIELDS}
        return fields if self.cpu_compute_mla is None else {**fields, "cpu_compute_mla": self.cpu_compute_mla}


def _log_grid(low: float, high: float, num: int) -> list[float]:
    return [math.exp(math.log(low) + (math.log(high) - math.log(low)) * i / (num - 1)) for i in range(num)]


def _refined(loss: Callable[..., float], best: tuple[float, ...], axes: tuple[str, ...]) -> tuple[float, ...]:
    """Two finer grids around ``best`` (loss, *point): each axis "eff" (a share in [1e-3, 1]) or "sync"."""
    step = 10 ** (1 / 8)  # the coarse grid's spacing
    for _ in range(2):
        grids = []
        for axis, value in zip(axes, best[1:]):
            if axis == "eff":
                grids.append([min(1.0, max(MIN_EFFICIENCY, value * step ** (i / 4))) for i in range(-4, 5)])
            else:
                grids.append(sorted({0.0, *(min(MAX_SYNC_S, value * step ** (i / 2)) for i in range(-4, 5))}))
        best = min(best, *((loss(*point), *point) for point in itertools.product(*grids)))
        step = step ** 0.25
    return best


def fit_cpu_efficiency(samples: Sequence[AttentionSample], dram_bytes_per_s: float,
                       flops_per_s: float) -> CpuFit:
    """cpu_memory, cpu_compute in [1e-3, 1] and cpu_sync_s in [0, 1 ms] minimising sum (log model - log measured)^2
    over the GQA samples (module docstring): a coarse grid, then two finer grids around the best point; then, where
    there are MLA decode samples, their own ``cpu_compute_mla`` the same way with the other two held (the absorbed
    form's 16 query heads over one latent run another loop than GQA's, and are compute-bound). Decode only: the
    split is a decode decision (a prefill chunk's CPU share falls to zero, docs/writescope/model.md), and MLA's
    prefill chunks run torch's flash kernel (bf16 through AMX where the CPU has it) at shares of the fp32 GEMM rate
    several times its decode's: more spread than one factor can carry. Deterministic."""
    gqa = [s for s in samples if not s.shape.is_mla]
    mla = [s for s in samples if s.shape.is_mla and s.shape.num_queries == 1]
    if not gqa:
        raise ValueError("fit_cpu_efficiency needs at least one GQA sample")

    def loss_over(group: Sequence[AttentionSample]) -> Callable[..., float]:
        rows = [(s.shape.kv_bytes, s.shape.flops_per_kv_byte, math.log(s.seconds)) for s in group]

        def loss(e_m: float, e_c: float, sync: float) -> float:
            mem, comp = 1.0 / (dram_bytes_per_s * e_m), 1.0 / (flops_per_s * e_c)
            return sum((math.log(sync + b * max(mem, f * comp)) - lt) ** 2 for b, f, lt in rows)

        return loss

    loss, effs = loss_over(gqa), _log_grid(MIN_EFFICIENCY, 1.0, 25)
    syncs = [0.0, *_log_grid(1e-6, MAX_SYNC_S, 13)]
    best = min(((loss(m, c, s), m, c, s) for m in effs for c in effs for s in syncs))
    _, e_m, e_c, sync = _refined(loss, best, ("eff", "eff", "sync"))
    e_mla = None
    if mla:
        mla_loss = loss_over(mla)
        _, e_mla = _refined(lambda c: mla_loss(e_m, c, sync), min((mla_loss(e_m, c, sync), c) for c in effs),
                            ("eff",))
    fit = dict(cpu_memory=e_m, cpu_compute=e_c, cpu_sync_s=sync, cpu_compute_mla=e_mla)
    errors = [abs(model_cpu_s(s.shape, dram_bytes_per_s, flops_per_s, **fit) / s.seconds - 1) for s in samples]
    return CpuFit(e_m, e_c, sync, statistics.median(errors), max(errors), e_mla)


def errors_by_kernel(samples: Sequence[AttentionSample], dram_bytes_per_s: float, flops_per_s: float,
                     efficiency: dict[str, float]) -> dict[str, dict[str, float | int]]:
    """Per kernel of ``samples`` (its MLA samples apart, ``KERNEL-mla``): {"shapes", "median_abs_rel_error",
    "max_abs_rel_error"} of the model with
    ``efficiency`` (``CpuFit.efficiency()``) against the measured times."""
    errors: dict[str, list[float]] = {}
    for s in samples:
        model = model_cpu_s(s.shape, dram_bytes_per_s, flops_per_s, **efficiency)
        errors.setdefault(s.kernel + ("-mla" if s.shape.is_mla else ""), []).append(abs(model / s.seconds - 1))
    return {kernel: {"shapes": len(errs), "median_abs_rel_error": statistics.median(errs),
                     "max_abs_rel_error": max(errs)} for kernel, errs in sorted(errors.items())}


# ---- the machine ------------------------------------------------------------------------------------------


def llc_bytes() -> int:
    """The largest CPU cache sysfs reports (the last-level cache), or DEFAULT_LLC_BYTES."""
    sizes = []
    for size_file in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            text = size_file.read_text().strip().upper()
        except OSError:
            continue
        unit = {"K": 1024, "M": MiB}.get(text[-1:], 1)
        digits = text.rstrip("KMB")
        if digits.isdigit():
            sizes.append(int(digits) * unit)
    return max(sizes, default=DEFAULT_LLC_BYTES)


def cpu_model_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and ":" in line:
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def installed_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 1


@dataclass(frozen=True, slots=True)
class DramResult:
    buffer_bytes: int  # each of the three buffers
    triad_bytes_per_s: float
    copy_bytes_per_s: float
    read_bytes_per_s: float


# ---- the whole calibration --------------------------------------------------------------------------------

# Fit shapes: head_dim 128 (as the evaluated models), GQA groups 8 and 4, but 16 query heads — not the 32 of the
# models benchmarks/cpu_attention_model.py evaluates — and KV lengths it does not use.
CALIBRATION_HEADS = ((16, 2), (16, 4))
CALIBRATION_QUERIES = (1, 16)
# by --quick; the short 256 pins cpu_sync_s
CALIBRATION_KV_TOKENS = {True: (256, 2048, 8192), False: (256, 2048, 8192, 24576)}
HEAD_DIM = 128
# DeepSeek-V2-Lite's absorbed MLA (16 query heads over a 512 latent + 64 rope key): the shape whose CPU rate
# plan-split's DeepSeek-V2-Lite figures rest on; by --quick, the KV lengths timed
MLA_SHAPE = dict(num_heads=16, num_kv_heads=1, head_dim=576, mla_value_dim=512)
MLA_KV_TOKENS = {True: (2048, 8192), False: (2048, 8192, 24576)}


def seqs_for_threads(num_kv_heads: int, num_threads: int) -> int:
    """Sequences per call so the kernel has at least two (sequence, KV head) work items per thread."""
    return max(1, math.ceil(2 * num_threads / num_kv_heads))


def calibration_shapes(quick: bool, num_threads: int) -> list[AttentionShape]:
    """The GQA shapes of the fit, then DeepSeek-V2-Lite's MLA (``MLA_SHAPE``) at decode and a prefill chunk."""
    gqa = [AttentionShape(h, hkv, HEAD_DIM, q, n, dtype, seqs_for_threads(hkv, num_threads))
           for h, hkv in CALIBRATION_HEADS for q in CALIBRATION_QUERIES for n in CALIBRATION_KV_TOKENS[quick]
           for dtype in KV_DTYPE_BYTES]
    mla = [AttentionShape(num_queries=q, kv_tokens=n, kv_dtype=dtype, num_seqs=seqs_for_threads(1, num_threads),
                          **MLA_SHAPE)
           for q in CALIBRATION_QUERIES for n in MLA_KV_TOKENS[quick] for dtype in KV_DTYPE_BYTES]
    return gqa + mla


@dataclass(frozen=True)
class Calibration:
    measured_at: str  # ISO 8601, UTC
    quick: bool
    clock: str
    torch_version: str
    num_threads: int
    logical_cpus: int
    cpu_model: str
    dram_bytes: int
    llc_bytes: int
    dram: DramResult
    append_bytes_per_s: float  # ``engine.measure.measure_append``: a DynamicCache-style append, read + write
    gemm_n: int
    gemm_flops_per_s: float
    attention: tuple[AttentionSample, ...]
    fit: CpuFit
    host_to_device: dict[str, Any]

    @property
    def host_append(self) -> float:
        """``OffloadEfficiency.host_append``: the append's rate as a share of triad, at most 1 (a streaming copy)."""
        return min(1.0, self.append_bytes_per_s / self.dram.triad_bytes_per_s)

    def as_dict(self) -> dict[str, Any]:
        nested = ("attention", "dram", "fit")
        doc = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in nested}
        doc.update(measured=True, dram=dataclasses.asdict(self.dram), host_append=self.host_append,
                   attention_kernel=kernels_used(self.attention), attention=[s.as_dict() for s in self.attention],
                   fit=dataclasses.asdict(self.fit),
                   fit_by_kernel=errors_by_kernel(self.attention, self.dram.triad_bytes_per_s,
                                                  self.gemm_flops_per_s, self.fit.efficiency()))
        return doc


# ---- summaries, and reading a calibrated host file ---------------------------------------------------------


def kernels_used(samples: Sequence[AttentionSample]) -> dict[str, str]:
    """{kernel: what it is} (``KERNELS``) for each kernel that timed some of ``samples``."""
    return {k: KERNELS[k] for k in KERNELS if any(s.kernel == k for s in samples)}


def attention_summary(samples: Sequence[AttentionSample]) -> dict[str, float]:
    """Median achieved KV bytes/s and FLOP/s per (decode or prefill, dtype, kernel) group of samples."""
    groups: dict[str, list[AttentionSample]] = {}
    for s in samples:
        kind = s.shape.kind
        groups.setdefault(f"attention_{kind}_{s.shape.kv_dtype}_{s.kernel}", []).append(s)
    out: dict[str, float] = {}
    for key, group in groups.items():
        out[f"{key}_kv_bytes_per_s"] = statistics.median(s.shape.kv_bytes / s.seconds for s in group)
        out[f"{key}_flops_per_s"] = statistics.median(s.shape.flops / s.seconds for s in group)
    return out


def offload_efficiency_for_host(name_or_path: str) -> OffloadEfficiency:
    """``OffloadEfficiency`` with a host file's ``[offload_efficiency]`` values over the defaults (the defaults
    alone for a preset or a file without that table); ``UserError`` naming the file and field when it is bad."""
    return factors_from_table(OffloadEfficiency, get_host_calibration(name_or_path)["offload_efficiency"],
                              name_or_path, "offload_efficiency")


FactorsT = TypeVar("FactorsT")


def factors_from_table(cls: type[FactorsT], values: dict[str, Any], origin: str, table: str) -> FactorsT:
    """``cls`` (a dataclass of numeric factors) with a calibration table's values over its defaults;
    ``UserError`` naming the file, table and field when one is unknown, not a number, or out of range."""
    valid = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
    unknown = sorted(set(values) - set(valid))
    if unknown:
        raise UserError(f"{origin}: [{table}]: unknown field(s) {unknown}; valid fields: {valid}")
    for key, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise UserError(f"{origin}: field '{table}.{key}': expected a number, got {value!r}")
    try:
        return cls(**values)
    except ValueError as exc:
        raise UserError(f"{origin}: [{table}]: {exc}") from None


def calibration_kernels(name_or_path: str) -> dict[str, str]:
    """{kernel: what it is} that a host file's calibration timed: its ``[measured]`` ``attention_kernel_<kernel>``
    fields; a file written before calibrate timed the native kernel has one ``attention_kernel`` (flash); a preset
    or a file without ``[measured]``, none."""
    measured = get_host_calibration(name_or_path)["measured"]
    found = {k.removeprefix("attention_kernel_"): str(v) for k, v in measured.items()
             if k.startswith("attention_kernel_")}
    if not found and "attention_kernel" in measured:
        found = {"flash": str(measured["attention_kernel"])}
    return found
