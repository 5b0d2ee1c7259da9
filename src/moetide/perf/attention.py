"""Costs of attending host-resident KV: on the CPU where it lies, or streamed over the host link to the GPU.

MODELED times from first principles (bytes and FLOPs against derated datasheet or measured rates), not
measurements; ``OffloadEfficiency`` names every factor, and calibration on a real machine replaces them.
Single GPU (tp = 1): one host socket serves one GPU.

Per byte of KV (summed over the full-attention layers; the unit the split planner works in), for Q query tokens
per sequence (1 in decode, the chunk length in chunked prefill):

  FLOPs per KV byte   f(Q) = Q x F_pair / b_pair, per layer: F_pair = FLOPs of one query-key pair over all query
                      heads, b_pair = KV bytes of one token. GQA: F_pair = 4 H d (QK^T and PV, 2 d each per head),
                      b_pair = 2 H_kv d x bytes, so f = 2 (H / H_kv) / bytes per element: 8 for Qwen3-30B-A3B
                      (32 / 4 heads), 4 for Mixtral-8x7B (32 / 8). MLA in the absorbed form (W_UK folded into the
                      query, W_UV applied after; scores against the latent + rope key, values over the latent):
                      F_pair = H (2 (r + r_rope) + 2 r), b_pair = (r + r_rope) x bytes; for DeepSeek-V2-Lite
                      (H = 16, r = 512, r_rope = 64, bf16) 16 x 2176 / 1152 = 30.2, the "~30 FLOP per KV byte"
                      that makes MLA compute-bound on a CPU (ridge ~ 3 TFLOP/s / 164 GB/s ~ 18).
  CPU in place        a(Q) = max(1 / (D e_dram), f(Q) / (C e_cpu)) / cpu_available
                      D = the host's sustained DRAM bandwidth (HostSpec: peak x STREAM-like efficiency), C = its
                      fp32 vector FMA peak (bf16 KV is widened to fp32). Per layer the CPU also needs the
                      queries (Q H d_q x 2 B, device to host) and returns a partial output with its log-sum-exp
                      (Q H (d_v + 1) x 4 B, fp32); per layer and step, one DMA each way for the whole batch and
                      one hand-off/sync.
  transfer            bytes / (N e_link) + num_transfers x latency. N = measured pinned host-to-device bandwidth.
                      A transfer moves one contiguous run: ``blocks_per_transfer`` blocks (the host pool allocates
                      a sequence's blocks in extents of that many, per layer), never more than one ring slot. Small
                      blocks with no coalescing (blocks_per_transfer = 1) make the latency term dominate.
  device attention    max(f(Q) bytes / (F e_att), bytes / (M e_hbm)) + one kernel launch per ring slot per layer
                      (a partial attention per slot, merged by log-sum-exp). F, M, e_att, e_hbm: perf.step.

``AttentionCostModel`` holds these per-model, per-machine constants; ``perf.offload`` assembles a step from them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from moetide.perf.budget import kv_bytes_per_token_per_gpu
from moetide.perf.efficiency import Efficiency
from moetide.specs import HardwareSpec, HostSpec, ModelSpec

MiB = 2**20
PARTIAL_DTYPE_BYTES = 4  # CPU partial outputs and their log-sum-exp travel as fp32 for an exact merge
QUERY_DTYPE_BYTES = 2  # queries leave the GPU in bf16/fp16


def _fraction(owner: str, **values: float) -> None:
    for name, value in values.items():
        if not (isinstance(value, (int, float)) and 0 < value <= 1):
            raise ValueError(f"{owner}.{name} is a fraction and must be in (0, 1], got {value!r}")


def _seconds(owner: str, **values: float) -> None:
    for name, value in values.items():
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
            raise ValueError(f"{owner}.{name} must be a finite number of seconds >= 0, got {value!r}")


@dataclass(frozen=True, slots=True)
class OffloadEfficiency:
    """Factors of the host side. ASSUMED defaults (no machine of this kind was at hand); calibrate them.

    cpu_memory:         attention kernel's share of the host's sustained (STREAM-like) DRAM bandwidth; an
                        in-place scan of large contiguous blocks is a streaming read, so close to 1
    cpu_compute:        share of the fp32 FMA peak a vectorised attention kernel reaches, bf16 widening included
    cpu_compute_mla:    the same for multi-head latent attention in the absorbed form (many query heads over one
                        latent: another loop, compute-bound); None = cpu_compute. ``moetide calibrate`` fits it
    cpu_available:      share of the socket free for attention (1 = idle CPU; a busy CPU is what the online
                        correction learns, this is the static knob)
    link:               share of the measured pinned host-to-device rate (already a measurement: 1.0)
    transfer_latency_s: per DMA (cudaMemcpyAsync issue + PCIe round trip), a few microseconds
    cpu_sync_s:         per layer, handing the queries to the CPU threads and waiting for them
    kernel_launch_s:    per device attention kernel (one per ring slot, one for the device-resident part)
    host_append:        share of that DRAM bandwidth a monolithic cache's per-step rewrite reaches (a transformers
                        DynamicCache appends by concatenation into a fresh tensor, faulted in page by page); 1 = a
                        streaming copy into memory already mapped. Only the monolithic ablation reads it
    """

    cpu_memory: float = 0.9
    cpu_compute: float = 0.5
    cpu_compute_mla: float | None = None
    cpu_available: float = 1.0
    link: float = 1.0
    transfer_latency_s: float = 5e-6
    cpu_sync_s: float = 20e-6
    kernel_launch_s: float = 5e-6
    host_append: float = 1.0

    def __post_init__(self) -> None:
        _fraction("OffloadEfficiency", cpu_memory=self.cpu_memory, cpu_compute=self.cpu_compute,
                  cpu_available=self.cpu_available, link=self.link, host_append=self.host_append,
                  **({} if self.cpu_compute_mla is None else {"cpu_compute_mla": self.cpu_compute_mla}))
        _seconds("OffloadEfficiency", transfer_latency_s=self.transfer_latency_s, cpu_sync_s=self.cpu_sync_s,
                 kernel_launch_s=self.kernel_launch_s)


@dataclass(frozen=True, slots=True)
class HostKVLayout:
    """How host KV is laid out and streamed: block size in tokens, blocks per contiguous host extent (one DMA),
    and the device staging ring (``ring_slots`` slots of ``ring_bytes / ring_slots``)."""

    block_size: int = 16
    blocks_per_transfer: int = 64
    ring_bytes: int = 256 * MiB
    ring_slots: int = 4

    def __post_init__(self) -> None:
        for name in ("block_size", "blocks_per_transfer", "ring_bytes", "ring_slots"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"HostKVLayout.{name} must be a positive integer, got {value!r}")

    @property
    def slot_bytes(self) -> int:
        return self.ring_bytes // self.ring_slots


class AttentionCostModel:
    """Per-model, per-machine constants of CPU attention, transfer and device attention (module docstring).
    Bytes are KV bytes summed over full-attention layers unless a name says per layer."""

    def __init__(self, model: ModelSpec, gpu: HardwareSpec, host: HostSpec, *, kv_dtype_bytes: int = 2,
                 layout: HostKVLayout = HostKVLayout(), efficiency: Efficiency = Efficiency(),
                 offload: OffloadEfficiency = OffloadEfficiency()) -> None:
        self.model, self.gpu, self.host = model, gpu, host
        self.layout, self.efficiency, self.offload = layout, efficiency, offload
        self.num_layers = len(model.full_attention_layer_ids)
        if self.num_layers == 0:
            raise ValueError(f"{model.name} has no full-attention layer: it keeps no growing KV cache to place")
        self.kv_bytes_per_token = kv_bytes_per_token_per_gpu(model, tp=1, kv_dtype_bytes=kv_dtype_bytes)
        self.layer_kv_bytes_per_token = self.kv_bytes_per_token // self.num_layers
        self.block_bytes = layout.block_size * self.kv_bytes_per_token
        self.flops_per_pair_per_layer = model.num_attention_heads * self._pair_flops_per_head()
        unit = min(layout.blocks_per_transfer * layout.block_size * self.layer_kv_bytes_per_token, layout.slot_bytes)
        self.transfer_unit_bytes = max(1, unit)  # per layer: one DMA moves at most this much
        self._device_s_per_byte: dict[int, float] = {}  # by query count: a replay asks several times a step

    def _pair_flops_per_head(self) -> int:
        mla = self.model.mla
        if mla is not None:
            return 2 * (mla.kv_lora_rank + mla.qk_rope_head_dim) + 2 * mla.kv_lora_rank
        return 4 * self.model.head_dim

    def _query_and_output_dims(self) -> tuple[int, int]:
        mla = self.model.mla
        if mla is not None:  # absorbed: the query lives in latent + rope space, the output in latent space
            return mla.kv_lora_rank + mla.qk_rope_head_dim, mla.kv_lora_rank
        return self.model.head_dim, self.model.head_dim

    # ---- per byte -----------------------------------------------------------------------------------------

    def flops_per_kv_byte(self, num_queries: int = 1) -> float:
        return num_queries * self.flops_per_pair_per_layer / self.layer_kv_bytes_per_token

    def _cpu_memory_and_compute_s_per_byte(self, num_queries: int) -> tuple[float, float]:
        o, h = self.offload, self.host
        share = o.cpu_compute if self.model.mla is None or o.cpu_compute_mla is None else o.cpu_compute_mla
        return (1.0 / (h.dram_bandwidth_bytes_per_s * o.cpu_memory),
                self.flops_per_kv_byte(num_queries) / (h.fp32_flops_per_s * share))

    def cpu_s_per_byte(self, num_queries: int = 1) -> float:
        return max(self._cpu_memory_and_compute_s_per_byte(num_queries)) / self.offload.cpu_available

    def cpu_compute_bound(self, num_queries: int = 1) -> bool:
        """Whether the CPU's roofline time is its compute's, not its memory's."""
        memory, compute = self._cpu_memory_and_compute_s_per_byte(num_queries)
        return compute > memory

    def link_s_per_byte(self) -> float:
        return 1.0 / (self.gpu.host_link_bandwidth_bytes_per_s * self.offload.link)

    def device_s_per_byte(self, num_queries: int = 1) -> float:
        cached = self._device_s_per_byte.get(num_queries)
        if cached is None:
            e, g = self.efficiency, self.gpu
            cached = self._device_s_per_byte[num_queries] = max(
                self.flops_per_kv_byte(num_queries) / (g.matmul_flops_per_s * e.attention),
                1.0 / (g.hbm_bandwidth_bytes_per_s * e.hbm))
        return cached

    # ---- whole operations ---------------------------------------------------------------------------------

    def cpu_attention_s(self, kv_bytes: float, num_queries: int = 1) -> float:
        """CPU roofline time to attend ``kv_bytes`` in place (no hand-off or query traffic)."""
        return kv_bytes * self.cpu_s_per_byte(num_queries)

    def num_transfers(self, layer_bytes: float) -> int:
        """DMAs to stream one sequence's ``layer_bytes`` of one layer (contiguous extents, ring-slot bounded)."""
        return math.ceil(layer_bytes / self.transfer_unit_bytes) if layer_bytes > 0 else 0

    def transfer_s(self, num_bytes: float, num_transfers: int) -> float:
        return num_bytes * self.link_s_per_byte() + num_transfers * self.offload.transfer_latency_s

    def device_attention_s(self, kv_bytes: float, num_queries: int = 1) -> float:
        """GPU roofline time over ``kv_bytes`` already in HBM (launches not included)."""
        return kv_bytes * self.device_s_per_byte(num_queries)

    def query_bytes(self, num_queries: int = 1) -> int:
        """One sequence, one layer: the queries the CPU needs."""
        return num_queries * self.model.num_attention_heads * self._query_and_output_dims()[0] * QUERY_DTYPE_BYTES

    def partial_output_bytes(self, num_queries: int = 1) -> int:
        """One sequence, one layer: the CPU's partial output and log-sum-exp per query head (fp32)."""
        d_v = self._query_and_output_dims()[1]
        return num_queries * self.model.num_attention_heads * (d_v + 1) * PARTIAL_DTYPE_BYTES

    def cpu_seq_overhead_s(self, num_queries: int = 1) -> float:
        """All layers, one sequence with CPU work: its queries down and its partial output up. The batch's
        queries (and partials) are one tensor per layer, so the DMA latency is per step (``cpu_step_overhead_s``)."""
        per_layer = self.query_bytes(num_queries) + self.partial_output_bytes(num_queries)
        return self.num_layers * per_layer * self.link_s_per_byte()

    def cpu_step_overhead_s(self) -> float:
        """All layers, per step with any CPU work: hand-off/sync plus one query DMA and one partial DMA."""
        o = self.offload
        return self.num_layers * (o.cpu_sync_s + 2 * o.transfer_latency_s)
