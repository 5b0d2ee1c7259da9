"""The host as a shared resource: where the host-resident experts run, and what that leaves the host's cores and
its link for the KV around them. MODELED, like ``perf.offload``.

A decode step alternates, per layer, an attention phase and a non-attention (MoE) phase; within one batch they are
data-dependent, so they never overlap: the host's cores and its link are shared between the two phases in time.
Where the experts that do not fit in VRAM run decides which resource the MoE phase occupies:

  stage   (the default: what the replay and the engine do) each layer's routed host experts are copied over the
          link and run on the GPU: the link is busy for the staging, the CPU idles the whole phase.
          Phase = max(expert roofline, staging).
  cpu     (KTransformers' placement) the CPU computes them where their weights lie while the GPU computes the
          resident ones: the CPU is busy for max(weight bytes / DRAM, FLOPs / fp32) plus one hand-off per layer,
          the link idles the whole phase. Phase = max(resident experts on the GPU, CPU experts).
  split   each layer's routed host experts divided: a share c on the CPU, the rest staged, c the one of 0, 1/64,
          ..., 1 that makes the layer's phase shortest. Phase = max(staging, CPU experts, resident and staged
          experts on the GPU); at the best c the link and the CPU are both busy for most of it. Fiddler (arXiv
          2402.07033) makes the same choice per expert, from its latency model of both. It minimizes the MoE phase
          alone: what it leaves idle is borrowed as below.

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

HOST_EXPERT_PLACES = ("stage", "cpu", "split")
SPLIT_GRID = 64  # ``split`` tries CPU shares 0, 1/64, ..., 1 of a layer's routed host experts
# the CPU shares of a layer's routed host experts each place tries
CPU_SHARES = {"stage": (0.0,), "cpu": (1.0,), "split": tuple(i / SPLIT_GRID for i in range(SPLIT_GRID + 1))}


@dataclass(frozen=True, slots=True)
class HostPhase:
    """One step's non-attention phase, summed over layers: its time beyond the all-resident roofline, and how long
    the link and the CPU are busy and idle in it; ``cpu_expert_share``: the mean share of the routed host experts
    the CPU computed (0 staged, 1 all on the CPU)."""

    extra_s: float
    link_busy_s: float
    cpu_busy_s: float
    link_idle_s: float
    cpu_idle_s: float
    cpu_expert_share: float = 0.0


@dataclass(frozen=True, slots=True)
class _Layer:
    phase_s: float  # the layer's MoE phase beyond its all-resident expert compute
    link_busy_s: float
    cpu_busy_s: float


def _layer(model: OffloadStepModel, host_experts: float, num_pairs: float, compute_s: float, f_off: float,
           cpu_share: float) -> _Layer:
    """One layer with ``cpu_share`` of its routed host experts computed on the CPU and the rest staged: the GPU
    computes the resident and the staged ones while the staging streams in behind it, and the CPU its share at
    the same time, so the phase is the longest of the three."""
    a, lay = model.attention, model.layout
    staged = (1 - cpu_share) * host_experts
    link = a.transfer_s(staged * lay.expert_bytes, math.ceil(staged)) if staged > 0 else 0.0
    cpu = cpu_expert_s(model, cpu_share * host_experts, cpu_share * num_pairs) if cpu_share > 0 else 0.0
    gpu = (1 - cpu_share * f_off) * compute_s
    return _Layer(max(0.0, max(link, gpu, cpu) - compute_s), link, cpu)


def host_phase(model: OffloadStepModel, num_tokens: int, place: str = "stage") -> HostPhase:
    """The MoE phase with the layout's host experts placed by ``place`` (module docstring)."""
    if place not in HOST_EXPERT_PLACES:
        raise ValueError(f"host experts run by {', '.join(map(repr, HOST_EXPERT_PLACES))}, got {place!r}")
    step = model.step
    spec = step.model
    bd = step.breakdown(StepShape(num_tokens, 1, 0, 0, 0))
    base_layer_s = (bd["total_s"] - bd["attention_s"]) / spec.num_layers  # one layer's all-resident MoE phase
    f_off = model.layout.offloaded_expert_fraction
    compute = bd["experts_s"] / spec.num_moe_layers if spec.num_moe_layers else 0.0
    pairs = num_tokens * spec.num_experts_per_tok * f_off
    shares = CPU_SHARES[place]
    extra = link_busy = cpu_busy = link_idle = cpu_idle = share_sum = 0.0
    distinct = step.distinct_experts_per_layer(num_tokens) if f_off > 0 and num_tokens > 0 else []
    best: dict[float, tuple[float, _Layer]] = {}  # layers routing as many experts place them alike
    for d in distinct:
        if d not in best:
            best[d] = min(((c, _layer(model, f_off * d, pairs, compute, f_off, c)) for c in shares),
                          key=lambda pair: (pair[1].phase_s, pair[0]))
        share, layer = best[d]
        phase = base_layer_s + layer.phase_s
        extra += layer.phase_s
        link_busy += layer.link_busy_s
        cpu_busy += layer.cpu_busy_s
        link_idle += phase - layer.link_busy_s
        cpu_idle += phase - layer.cpu_busy_s
        share_sum += share
    idle_layers = spec.num_layers - len(distinct)  # dense layers (and every layer when nothing is offloaded)
    link_idle += idle_layers * base_layer_s
    cpu_idle += idle_layers * base_layer_s
    return HostPhase(extra, link_busy, cpu_busy, max(0.0, link_idle), max(0.0, cpu_idle),
                     share_sum / len(distinct) if distinct else 0.0)


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
