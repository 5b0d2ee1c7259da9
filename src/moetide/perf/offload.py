"""One decode (or chunked-prefill) step with KV spilled to host memory, under a VRAM budget: the memory layout,
the non-attention time every KV placement shares, the attention phase of a given placement, and the linear
coefficients the split planner (``moetide.core.splits``) optimises.

MODELED, not measured. Same hardware, same memory, same weights for every placement; only where host KV is
attended differs. The rules (docs/writescope.md):

VRAM budget (``vram_layout``), in this order: non-expert weights (attention, norms, routers, shared experts, dense
MLPs, embedding, LM head), the activation reserve (``perf.budget``), the staging ring, a device KV pool of a fixed
size, then as many whole routed experts as fit. The other experts live on the host. KV beyond the device pool is
host-resident. ``UserError`` when the fixed parts do not fit.

Step = non-attention + attention phase.
  non-attention   perf.step's roofline for the same shape without its attention term, plus the time offloaded
                  experts add: per MoE layer the expected distinct experts D(T) x offloaded fraction are staged
                  over the host link (uniform routing), overlapping the resident experts' compute, so a layer's MLP
                  phase is max(expert roofline, staging). Identical for every placement: the link carries experts
                  in the MLP phase and KV in the attention phase; the phases do not overlap (conservative for every
                  placement alike). ``perf.host_share`` places the host experts on the CPU instead and says what the
                  MLP phase leaves idle; KV is prefetched across phases only when the caller passes
                  ``prefetch_bytes`` (plan-split does; the replay and the engine do not).
  attention phase max(CPU side, GPU side), summed over layers (identical layers, so one max of the totals):
                  CPU side = slowdown x (L sync + per CPU sequence: queries down, partial up + roofline over its
                  bytes); GPU side = device-resident attention (incl. the new tokens) + launches + merging CPU
                  partials (their bytes on the link) + [streaming] max(link: bytes + latency per DMA, device:
                  bytes + launch per ring slot) + pipeline fill (one slot's attention after its copy lands).
``coefficients`` linearises the attention phase for the planner: a sequence's ceil(x / U) DMAs per layer become
x / U + 1, ring slots become bytes / slot, and the pipeline fill is charged for a full slot, so the planner's
T(X) differs from this model's by about one DMA latency per sequence and layer (under 2% in the tests).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from moetide.errors import UserError
from moetide.perf.attention import AttentionCostModel
from moetide.perf.budget import GiB, default_activation_reserve_bytes, weights_per_gpu
from moetide.perf.step import StepShape, StepTimeModel
from moetide.specs import ModelSpec
from moetide.units import cdiv


@dataclass(frozen=True, slots=True)
class VramLayout:
    vram_bytes: int
    non_expert_bytes: int
    activation_reserve_bytes: int
    ring_bytes: int
    device_kv_bytes: int
    expert_bytes: int  # one routed expert in one layer
    num_experts_total: int  # over all MoE layers
    num_experts_resident: int

    @property
    def offloaded_expert_fraction(self) -> float:
        return 1.0 - self.num_experts_resident / self.num_experts_total

    def describe(self) -> list[tuple[str, str]]:
        def gib(n: float) -> str:
            return f"{n / GiB:.2f} GiB"

        resident = self.num_experts_resident * self.expert_bytes
        return [
            ("VRAM budget", gib(self.vram_bytes)),
            ("non-expert weights", gib(self.non_expert_bytes)),
            ("activation reserve", gib(self.activation_reserve_bytes)),
            ("staging ring", gib(self.ring_bytes)),
            ("device KV pool", gib(self.device_kv_bytes)),
            ("resident experts", f"{gib(resident)} ({self.num_experts_resident:,} of {self.num_experts_total:,}; "
                                 f"{self.offloaded_expert_fraction:.0%} on the host)"),
        ]


def vram_layout(model: ModelSpec, *, vram_bytes: int, device_kv_bytes: int, ring_bytes: int,
                max_num_batched_tokens: int = 8192, dtype_bytes: int = 2) -> VramLayout:
    """Fill the budget in the module docstring's order; ``UserError`` with the numbers when it cannot."""
    w = weights_per_gpu(model, tp=1, dtype_bytes=dtype_bytes)
    non_expert = w.total_bytes - w.routed_expert_bytes
    reserve = default_activation_reserve_bytes(model, max_num_batched_tokens=max_num_batched_tokens,
                                               dtype_bytes=dtype_bytes)
    fixed = non_expert + reserve + ring_bytes + device_kv_bytes
    if fixed > vram_bytes:
        raise UserError(f"{model.name}: the VRAM budget of {vram_bytes / GiB:.2f} GiB cannot hold the non-expert "
                        f"weights ({non_expert / GiB:.2f} GiB), the activation reserve ({reserve / GiB:.2f} GiB), "
                        f"the ring ({ring_bytes / GiB:.2f} GiB) and the device KV pool "
                        f"({device_kv_bytes / GiB:.2f} GiB); raise --gpu-memory or lower --kv-cache-memory")
    resident = min(w.num_routed_experts, (vram_bytes - fixed) // w.expert_shard_bytes)
    return VramLayout(vram_bytes, non_expert, reserve, ring_bytes, device_kv_bytes, w.expert_shard_bytes,
                      w.num_routed_experts, resident)


@dataclass(frozen=True, slots=True)
class SplitCoefficients:
    """Same fields, same meaning as ``moetide.core.splits.SplitCosts`` (the caller converts with asdict)."""

    cpu_s_per_byte: float
    cpu_fixed_s: float
    cpu_per_seq_s: float
    stream_s_per_byte: float
    stream_fixed_s: float
    stream_per_seq_s: float
    gpu_fixed_s: float
    merge_per_seq_s: float
    prefetch_bytes: float = 0.0


@dataclass(frozen=True, slots=True)
class SeqTokens:
    """One sequence's KV this step: device-resident tokens (new ones included), CPU-attended and streamed."""

    device_tokens: int
    cpu_tokens: int
    streamed_tokens: int


@dataclass(frozen=True, slots=True)
class PhaseTime:
    cpu_s: float
    gpu_s: float
    serial_s: float = 0.0  # before either side can start (a monolithic cache's rewrite)

    @property
    def total_s(self) -> float:
        return self.serial_s + max(self.cpu_s, self.gpu_s)


class OffloadStepModel:
    """A step under one VRAM layout (module docstring). ``step`` must be built for the same model and GPU."""

    def __init__(self, attention: AttentionCostModel, step: StepTimeModel, layout: VramLayout) -> None:
        if step.model is not attention.model or step.gpu is not attention.gpu or step.tp != 1:
            raise ValueError("OffloadStepModel: attention and step models must share the model and GPU, at tp=1")
        self.attention, self.step, self.layout = attention, step, layout

    def expert_offload_s(self, num_tokens: int) -> float:
        """Extra time the host-resident experts add over the all-resident roofline, summed over MoE layers."""
        a, lay = self.attention, self.layout
        f_off = lay.offloaded_expert_fraction
        if f_off <= 0 or num_tokens <= 0:
            return 0.0
        shape = StepShape(num_tokens, 1, 0, 0, 0)
        per_layer_compute = self.step.breakdown(shape)["experts_s"] / self.step.model.num_moe_layers
        extra = 0.0
        for distinct in self.step.distinct_experts_per_layer(num_tokens):
            staged = f_off * distinct
            staging = a.transfer_s(staged * lay.expert_bytes, math.ceil(staged))
            extra += max(0.0, staging - per_layer_compute)
        return extra

    def non_attention_s(self, shape: StepShape) -> float:
        bd = self.step.breakdown(shape)
        return bd["total_s"] - bd["attention_s"] + self.expert_offload_s(shape.num_tokens)

    def coefficients(self, device_tokens: int, num_queries: int = 1,
                     prefetch_bytes: float = 0.0) -> SplitCoefficients:
        """Linear attention-phase coefficients for a step whose device-resident tokens total ``device_tokens``."""
        return split_coefficients(self.attention, device_tokens, num_queries, prefetch_bytes)

    def attention_phase(self, seqs: Sequence[SeqTokens], num_queries: int = 1,
                        cpu_slowdown: float = 1.0, **host: float) -> PhaseTime:
        """The attention phase of a placement; ``cpu_slowdown`` scales the CPU side (a busier CPU than modeled);
        ``host``: the keywords of ``attention_phase``."""
        return attention_phase(self.attention, seqs, num_queries, cpu_slowdown, **host)

    def step_s(self, shape: StepShape, seqs: Sequence[SeqTokens], cpu_slowdown: float = 1.0) -> float:
        num_queries = max(1, shape.num_tokens // max(1, shape.num_seqs))
        return self.non_attention_s(shape) + self.attention_phase(seqs, num_queries, cpu_slowdown).total_s


def attention_phase(a: AttentionCostModel, seqs: Sequence[SeqTokens], num_queries: int = 1,
                    cpu_slowdown: float = 1.0, *, prefetch_bytes: float = 0.0, reuse_bytes: float = 0.0,
                    cpu_head_start_s: float = 0.0, relayout_bytes: float = 0.0) -> PhaseTime:
    """The attention phase of a placement (module docstring); it reads only the attention model, so a replay
    charges it per step without a VRAM layout. The keywords are the host's other work and a policy's mechanism
    (``perf.host_share`` and ``core.splits.Mechanism``), all zero for the replay and the engine:
    ``prefetch_bytes`` and ``reuse_bytes`` of the streamed KV do not cross the link in this phase (moved while
    the link idled in the previous one; still on the device from the previous step), ``cpu_head_start_s`` of CPU
    work ran in the previous phase (a layer-ahead CPU), and ``relayout_bytes`` are rewritten in host DRAM (read
    and write, at ``host_append`` of its bandwidth) before either side starts."""
    o, L = a.offload, a.num_layers
    kvb, lkvb = a.kv_bytes_per_token, a.layer_kv_bytes_per_token
    num_cpu_seqs = cpu_tokens = device_tokens = streamed = 0
    for s in seqs:  # one pass over the batch: a replay charges every step
        if s.cpu_tokens > 0:
            num_cpu_seqs += 1
            cpu_tokens += s.cpu_tokens
        device_tokens += s.device_tokens
        streamed += s.streamed_tokens
    cpu_s = 0.0
    if num_cpu_seqs:
        cpu_bytes = cpu_tokens * kvb
        cpu_s = cpu_slowdown * (a.cpu_step_overhead_s() + num_cpu_seqs * a.cpu_seq_overhead_s(num_queries)
                                + a.cpu_attention_s(cpu_bytes, num_queries))
        cpu_s = max(0.0, cpu_s - cpu_head_start_s)
    gpu_s = (gpu_fixed_s(a, device_tokens, num_queries)
             + num_cpu_seqs * L * a.partial_output_bytes(num_queries) * a.link_s_per_byte())
    if streamed:
        num_dma = L * sum(a.num_transfers(s.streamed_tokens * lkvb) for s in seqs)
        layer_bytes = streamed * lkvb
        slots = L * cdiv(layer_bytes, a.layout.slot_bytes)
        moved = max(0.0, streamed * kvb - prefetch_bytes - reuse_bytes)
        link = a.transfer_s(moved, math.ceil(num_dma * moved / (streamed * kvb)))
        device = a.device_attention_s(streamed * kvb, num_queries) + slots * o.kernel_launch_s
        gpu_s += max(link, device) + fill_s(a, layer_bytes, num_queries)
    serial = 2 * relayout_bytes / (a.host.dram_bandwidth_bytes_per_s * o.host_append)  # read + write
    return PhaseTime(cpu_s, gpu_s, serial)


def gpu_fixed_s(a: AttentionCostModel, device_tokens: float, num_queries: int) -> float:
    """The device's attention over its own KV plus one launch per layer."""
    return (a.device_attention_s(device_tokens * a.kv_bytes_per_token, num_queries)
            + a.num_layers * a.offload.kernel_launch_s)


def fill_s(a: AttentionCostModel, layer_bytes: float, num_queries: int) -> float:
    """Filling the pipeline: the first staging slot's attention on every layer, plus its launches."""
    slot = min(layer_bytes, a.layout.slot_bytes) * a.num_layers
    return a.device_attention_s(slot, num_queries) + a.num_layers * a.offload.kernel_launch_s


def split_coefficients(a: AttentionCostModel, device_tokens: int, num_queries: int = 1,
                       prefetch_bytes: float = 0.0) -> SplitCoefficients:
    """Linear attention-phase coefficients for a step whose device-resident tokens total ``device_tokens`` (they
    read only the attention model); ``prefetch_bytes`` as in ``attention_phase``."""
    o, L = a.offload, a.num_layers
    link = a.link_s_per_byte() + o.transfer_latency_s / a.transfer_unit_bytes
    device = a.device_s_per_byte(num_queries) + o.kernel_launch_s / a.layout.slot_bytes
    return SplitCoefficients(
        cpu_s_per_byte=a.cpu_s_per_byte(num_queries), cpu_fixed_s=a.cpu_step_overhead_s(),
        cpu_per_seq_s=a.cpu_seq_overhead_s(num_queries), stream_s_per_byte=max(link, device),
        stream_fixed_s=fill_s(a, a.layout.slot_bytes, num_queries), stream_per_seq_s=L * o.transfer_latency_s,
        gpu_fixed_s=gpu_fixed_s(a, device_tokens, num_queries),
        merge_per_seq_s=L * a.partial_output_bytes(num_queries) * a.link_s_per_byte(), prefetch_bytes=prefetch_bytes)
