"""The host as a shared resource: where the host-resident experts run, and what that leaves the host's cores and
its link for the KV around them. MODELED, like ``perf.offload``.

A decode step alternates, per layer, an attention phase and a non-attention (MoE) phase; within one batch they are
data-dependent, so they never overlap: the host's cores and its link are shared between the two phases in time.
Where the experts that do not fit in VRAM run decides which resource the MoE phase occupies:

  stage   (the default: what the replay and the engine do) each layer's routed host experts are copied over the link and run on the GPU:
          the link is busy for the staging, the CPU idles the whole phase. Phase = max(expert roofline, staging).
  cpu     (KTransformers' placement) the CPU computes them where their weights lie while the GPU computes the
          resident ones: the CPU is busy for max(weight bytes / DRAM, FLOPs / fp32) plus one hand-off per layer,
          the link idles the whole phase. Phase = max(resident experts on the GPU, CPU experts).

What idles in the MoE phase is what the attention phase around it can borrow, and the split planner sees it:
  - an idle link prefetches the next layer's streamed KV (KV does not depend on the query), up to half the
    staging ring per layer (the other half serves the layer being attended): ``prefetch_bytes`` in
    ``core.splits.SplitCosts``, which every streaming policy gets;
  - an idle CPU can start the next layer's attention only with a predicted query (a layer-ahead policy, lossy):
    ``cpu_idle_s``, which only ``core.splits.ScoutAttention`` uses.
The routed set per layer is the expected distinct experts under uniform routing (``perf.step``), as in
``perf.offload``; the bytes DMA and CPU attention both draw from host DRAM in the same phase are not charged
(the link's 12-25 GB/s against 150 GB/s of DRAM).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from moetide.perf.offload import OffloadStepModel
from moetide.perf.step import StepShape

HOST_EXPERT_PLACES = ("stage", "cpu")


@dataclass(frozen=True, slots=True)
class HostPhase:
    """One step's non-attention phase, summed over layers: its time beyond the all-resident roofline, and how long
    the link and the CPU are busy and idle in it."""

    extra_s: float
    link_busy_s: float
    cpu_busy_s: float
    link_idle_s: float
    cpu_idle_s: float


def host_phase(model: OffloadStepModel, num_tokens: int, place: str = "stage") -> HostPhase:
    """The MoE phase with the layout's host experts placed by ``place`` (module docstring)."""
    if place not in HOST_EXPERT_PLACES:
        raise ValueError(f"host experts run by 'stage' or 'cpu', got {place!r}")
    a, lay, step = model.attention, model.layout, model.step
    spec = step.model
    shape = StepShape(num_tokens, 1, 0, 0, 0)
    bd = step.breakdown(shape)
    layers = spec.num_layers
    base_layer_s = (bd["total_s"] - bd["attention_s"]) / layers  # one layer's all-resident non-attention time
    f_off = lay.offloaded_expert_fraction
    per_layer_compute = bd["experts_s"] / spec.num_moe_layers if spec.num_moe_layers else 0.0
    extra = link_busy = cpu_busy = link_idle = cpu_idle = 0.0
    distinct = step.distinct_experts_per_layer(num_tokens) if f_off > 0 and num_tokens > 0 else []
    for d in distinct:
        host_experts = f_off * d
        if place == "stage":
            busy = a.transfer_s(host_experts * lay.expert_bytes, math.ceil(host_experts))
            layer_extra = max(0.0, busy - per_layer_compute)
            link_busy += busy
        else:
            busy = cpu_expert_s(model, host_experts, num_tokens * spec.num_experts_per_tok * f_off)
            layer_extra = max(0.0, max((1 - f_off) * per_layer_compute, busy) - per_layer_compute)
            cpu_busy += busy
        extra += layer_extra
        phase = base_layer_s + layer_extra
        link_idle += phase - (busy if place == "stage" else 0.0)
        cpu_idle += phase - (busy if place == "cpu" else 0.0)
    idle_layers = layers - len(distinct)  # dense layers (and every layer when nothing is offloaded)
    link_idle += idle_layers * base_layer_s
    cpu_idle += idle_layers * base_layer_s
    return HostPhase(extra, link_busy, cpu_busy, max(0.0, link_idle), max(0.0, cpu_idle))


def cpu_expert_s(model: OffloadStepModel, num_experts: float, num_pairs: float) -> float:
    """The CPU computing ``num_experts`` of one layer for ``num_pairs`` (token, expert) pairs: its weights read
    once from DRAM, 2 FLOPs per weight per pair (so FLOPs = pairs x expert bytes at 2 B per weight), one hand-off."""
    a, lay = model.attention, model.layout
    o, h = a.offload, a.host
    memory = num_experts * lay.expert_bytes / (h.dram_bandwidth_bytes_per_s * o.cpu_memory)
    compute = num_pairs * lay.expert_bytes / (h.fp32_flops_per_s * o.cpu_compute)
    return o.cpu_sync_s + max(memory, compute) / o.cpu_available


def prefetch_bytes(model: OffloadStepModel, phase: HostPhase) -> float:
    """Streamed KV bytes the idle link moves in the previous phase: its idle seconds at the link's rate, at most
    half the ring per layer."""
    a = model.attention
    return min(phase.link_idle_s / a.link_s_per_byte(), a.num_layers * a.layout.ring_bytes / 2)
