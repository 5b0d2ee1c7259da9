"""Staging cost of offloaded experts: what a step pays for experts served from host memory. MODELED.

For each MoE layer with ``n`` offloaded experts (of ``E``, top-``k`` routing), a step of ``T`` tokens touches
offloaded expert ``e`` with probability ``q_e = 1 − (1 − p_e)^T``, where ``p_e`` is the chance that one token routes
to it: ``k/E`` under uniform routing, or ``k·w_e/Σw`` with ``w_e = 1/rank^s`` when expert popularity follows a
Zipf law of exponent ``routing_zipf_s``, or with ``w_e`` a measured profile's share of rank e (``routing_shares``,
from a file the engine writes: ``perf.routing_profile``). The offloaded experts are the layer's ``n`` coldest
(what ``core.experts`` picks from routing statistics), so skew makes them rarer. Three ways to stage them:

* ``auto`` (default): what an engine that knows its batch before the step can do. While layer l−1 computes, the
  host link is idle, so the offloaded experts of layer l most likely to be touched are prefetched into a staging
  buffer — as many as ``overlap_layers`` layers' compute carries, that is ``m = ⌊overlap_s / t⌋`` of them (``t``:
  one expert's transfer time), plus one more when its overrun is smaller than its expected on-demand cost; the rest
  are fetched on demand once layer l's router has chosen, overlapping nothing. Exposed time per layer:
  ``max(0, m·t − overlap_s) + t·Σ q_e`` over the experts not prefetched. A prefill chunk touches every expert
  (``q_e`` → 1), so this becomes ``segment`` with overlap; a small decode batch touches few, so it becomes
  ``touched`` less the few experts the window carries for free. Prefetched experts are moved whether used or not.
* ``touched``: only the experts the step's routing touches (expected ``Σ q_e``), fetched once the router has run,
  so the transfer overlaps nothing unless ``overlap_layers`` says the choice is predicted that many layers ahead.
  The pessimistic bound for small batches.
* ``segment`` (as the VAMP paper does): the whole offloaded segment of every layer, every step, fetched
  ``overlap_layers`` (default 1) layers ahead so it overlaps the preceding layers' compute.

Where the experts ``auto`` does not prefetch are served (``cold_experts``):

* ``fetch`` (default): copied over the host link on demand, as above.
* ``cpu``: the host CPU computes them where they lie (Fiddler, arXiv:2402.07033; KTransformers, SOSP 2025): the
  rows routed to them go to the host, the socket runs the experts' GEMMs over its shard of their weights (each GPU's
  socket computes the 1/tp shard its GPU would, so the partial sums join the same all-reduce), and the results come
  back. Per layer: ``max(touched × shard bytes / B, pairs × 2 × shard params / F) + 2 × (rows × hidden × 2 B / link
  + per-transfer latency) + cpu_dispatch_s``, with B and F the socket's sustained DRAM bandwidth and fp32 FMA peak
  (``HostSpec``) times ``cpu_memory_efficiency`` / ``cpu_compute_efficiency`` (or a given matmul rate,
  ``cpu_matmul_flops_per_s``: AMX), shared by ``gpus_per_socket`` GPUs; ``pairs`` = T × Σ p_e (expected routed
  token-expert pairs), ``rows`` = min(T, pairs); the fixed part is paid when a row goes there at all (at most
  min(1, Σ q) of the time). Nothing of it overlaps the GPU (the hot experts the GPU computes meanwhile are not
  counted: a pessimistic bound). The batch is known before the step, so per step and layer the cheaper of
  fetching and computing them is taken, and the prefetch count is chosen with it (all of the segment prefetched,
  with no host call, is one candidate). MODELED from the host preset's typical figures; nothing here was measured
  on a host CPU next to an H200.

Per layer: transfer_s = bytes / (host-link bandwidth × efficiency) + per-transfer latency × experts moved;
exposed_s = max(0, transfer_s − overlap_layers × compute_s_per_layer) for ``touched`` and ``segment``. A step's
staging cost is the sum of the exposed times over MoE layers (layers run one after another). Bytes per expert are
per GPU (an expert's shard at tensor parallelism ``tp``; each GPU stages its shard over its own host link).
``compute_s_per_layer`` is the step's modeled time over all layers (the caller's choice): a staging buffer a few
layers deep evens out the difference between Qwen3-Next's full- and linear-attention layers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from moetide.perf.budget import weights_per_gpu
from moetide.specs import HardwareSpec, HostSpec, ModelSpec

AUTO, TOUCHED, SEGMENT = "auto", "touched", "segment"
STAGING_MODES = (AUTO, TOUCHED, SEGMENT)
FETCH, CPU = "fetch", "cpu"
COLD_EXPERT_MODES = (FETCH, CPU)


@dataclass(frozen=True)
class StagingConfig:
    mode: str = AUTO
    link_efficiency: float = 0.9  # of the measured pinned H2D figure in the GPU preset (already a measured rate)
    transfer_latency_s: float = 10e-6  # per expert copy (cudaMemcpyAsync launch + DMA setup, typical)
    overlap_layers: float | None = None  # None: 0 for touched, 1 for segment and auto
    # Expert popularity within a layer: Zipf with this exponent (0 = uniform routing, the pessimistic default).
    # Offloaded experts are the coldest ones (what core.experts picks from routing statistics).
    routing_zipf_s: float = 0.0
    # Or measured: rank-wise routing shares, hottest first (``perf.routing_profile``); replaces the Zipf law.
    routing_shares: tuple[float, ...] | None = None
    # GPUs that stage at the same time through one host uplink (e.g. 2: tensor-parallel partners behind one PCIe
    # switch, which stage their shards of the same experts together); each gets 1/n of the link.
    host_link_shared_by: int = 1
    # Experts the prefetch does not carry: fetched on demand, or computed by the host CPU where they lie (``cpu``,
    # module docstring; needs ``host``, the socket next to the GPU, and mode ``auto``).
    cold_experts: str = FETCH
    host: HostSpec | None = None
    gpus_per_socket: int = 1  # GPUs whose cold experts one socket computes at once (DGX H200: 8 GPUs, 2 sockets)
    # ASSUMED kernel efficiencies (no host CPU next to an H200 was measured): a GEMV over bf16 expert weights streams
    # them at ~0.8 of STREAM Triad (llama.cpp-style CPU decode is memory-bound at 60-90% of it); a small-M GEMM over
    # bf16 weights converted to fp32 FMAs reaches ~half the FMA peak (AMX is not counted).
    cpu_memory_efficiency: float = 0.8
    cpu_compute_efficiency: float = 0.5
    # or a sustained matmul rate for the socket's expert GEMMs, replacing fp32 peak x cpu_compute_efficiency (e.g.
    # an AMX BF16 kernel: KTransformers reports 21 TFLOPS on a Xeon 4 machine, doc/en/AMX.md)
    cpu_matmul_flops_per_s: float | None = None
    cpu_dispatch_s: float = 10e-6  # per layer: waking the host worker and the GPU's wait on its result flag

    def __post_init__(self) -> None:
        if self.mode not in STAGING_MODES:
            raise ValueError(f"staging mode must be one of {', '.join(map(repr, STAGING_MODES))}, got {self.mode!r}")
        if self.cold_experts not in COLD_EXPERT_MODES:
            raise ValueError(f"cold_experts must be one of {', '.join(map(repr, COLD_EXPERT_MODES))}, "
                             f"got {self.cold_experts!r}")
        if self.cold_experts == CPU and (self.host is None or self.mode != AUTO):
            raise ValueError("cold_experts='cpu' needs a host CPU spec and staging mode 'auto'")
        if isinstance(self.gpus_per_socket, bool) or not isinstance(self.gpus_per_socket, int) \
                or self.gpus_per_socket < 1:
            raise ValueError(f"gpus_per_socket must be an integer >= 1, got {self.gpus_per_socket!r}")
        if not (0 < self.cpu_memory_efficiency <= 1 and 0 < self.cpu_compute_efficiency <= 1
                and self.cpu_dispatch_s >= 0):
            raise ValueError("cpu_memory_efficiency and cpu_compute_efficiency must be in (0, 1], cpu_dispatch_s >= 0")
        if self.cpu_matmul_flops_per_s is not None and not self.cpu_matmul_flops_per_s > 0:
            raise ValueError(f"cpu_matmul_flops_per_s must be positive, got {self.cpu_matmul_flops_per_s!r}")
        if not 0 < self.link_efficiency <= 1:
            raise ValueError(f"link_efficiency must be in (0, 1], got {self.link_efficiency}")
        if self.transfer_latency_s < 0 or (self.overlap_layers is not None and self.overlap_layers < 0):
            raise ValueError("transfer_latency_s and overlap_layers must be >= 0")
        if self.routing_zipf_s < 0:
            raise ValueError(f"routing_zipf_s must be >= 0, got {self.routing_zipf_s}")
        if isinstance(self.host_link_shared_by, bool) or not isinstance(self.host_link_shared_by, int) \
                or self.host_link_shared_by < 1:
            raise ValueError(f"host_link_shared_by must be an integer >= 1, got {self.host_link_shared_by!r}")
        if self.routing_shares is not None and (not self.routing_shares or min(self.routing_shares) < 0
                                                or not sum(self.routing_shares) > 0):
            raise ValueError("routing_shares must be non-empty, >= 0 and not all zero")

    @property
    def effective_overlap_layers(self) -> float:
        if self.overlap_layers is not None:
            return self.overlap_layers
        return 0.0 if self.mode == TOUCHED else 1.0


class StagingModel:
    """Staged bytes and exposed seconds per step, given how many experts each layer has offloaded."""

    def __init__(self, model: ModelSpec, gpu: HardwareSpec, *, tp: int = 1, dtype_bytes: int = 2,
                 config: StagingConfig = StagingConfig()) -> None:
        self.config = config
        self.num_experts = model.num_experts
        self.top_k = model.num_experts_per_tok
        self.expert_bytes = weights_per_gpu(model, tp=tp, dtype_bytes=dtype_bytes).expert_shard_bytes
        self.link_bytes_per_s = (gpu.host_link_bandwidth_bytes_per_s * config.link_efficiency
                                 / config.host_link_shared_by)
        self.num_moe_layers = model.num_moe_layers
        # one expert's transfer: its bytes over the link plus the per-copy latency
        self.expert_transfer_s = self.expert_bytes / self.link_bytes_per_s + config.transfer_latency_s
        self.on_cpu = config.cold_experts == CPU
        if self.on_cpu:
            host = config.host
            self.cpu_bytes_per_s = (host.dram_bandwidth_bytes_per_s * config.cpu_memory_efficiency
                                    / config.gpus_per_socket)
            flops = config.cpu_matmul_flops_per_s or host.fp32_flops_per_s * config.cpu_compute_efficiency
            self.cpu_flops_per_s = flops / config.gpus_per_socket
            self.cpu_flops_per_pair = 2.0 * self.expert_bytes / dtype_bytes  # one token through one expert shard
            self.row_transfer_s = 2 * model.hidden_size * dtype_bytes / self.link_bytes_per_s  # to the host and back
            self.cpu_call_s = 2 * config.transfer_latency_s + config.cpu_dispatch_s
        if config.routing_shares is not None:
            if len(config.routing_shares) != self.num_experts:
                raise ValueError(f"routing_shares lists {len(config.routing_shares)} experts; {model.name} routes "
                                 f"over {self.num_experts}")
            weights = sorted(config.routing_shares, reverse=True)
        else:
            weights = [1.0 / (rank + 1) ** config.routing_zipf_s for rank in range(self.num_experts)]
        total = sum(weights)
        # per-token probability that expert of popularity rank r is among the top-k, coldest first
        self._p_coldest = [min(1.0, self.top_k * w / total) for w in reversed(weights)]
        self._p_sum = [0.0]  # Σ p over the r coldest: expected routed pairs per token
        for p in self._p_coldest:
            self._p_sum.append(self._p_sum[-1] + p)
        self._moved: dict[tuple[int, int], float] = {}

    def expected_touched(self, num_tokens: int, num_offloaded: int) -> float:
        """Σ q_e over a layer's ``num_offloaded`` coldest experts: how many of them a step of T tokens touches."""
        key = (num_tokens, num_offloaded)
        moved = self._moved.get(key)
        if moved is None:
            moved = sum(1.0 - (1.0 - p) ** num_tokens for p in self._p_coldest[:num_offloaded])
            if len(self._moved) < 100_000:
                self._moved[key] = moved
        return moved

    def experts_moved(self, num_tokens: int, num_offloaded: int) -> float:
        """Expected offloaded experts (the ``num_offloaded`` coldest of a layer) a step of T tokens stages in
        ``touched`` and ``segment`` mode (``auto`` depends on the overlap window: see ``layer``)."""
        if self.config.mode == SEGMENT:
            return float(num_offloaded)
        return self.expected_touched(num_tokens, num_offloaded)

    def layer(self, num_tokens: int, num_offloaded: int, overlap_s: float) -> tuple[float, float]:
        """(experts moved, exposed seconds) of one layer with ``num_offloaded`` experts on the host."""
        if not num_offloaded or num_tokens <= 0:
            return 0.0, 0.0
        t = self.expert_transfer_s
        if self.config.mode != AUTO:
            moved = self.experts_moved(num_tokens, num_offloaded)
            return moved, max(0.0, moved * t - overlap_s)
        # prefetch the m likeliest (the hottest of the cold), fetch the rest on demand: Σ q over the coldest n − m
        # (or compute them on the host CPU when that is cheaper: ``cold_experts='cpu'``)
        best = None
        first = min(num_offloaded, math.floor(overlap_s / t) if t > 0 else num_offloaded)
        candidates = dict.fromkeys((first, min(first + 1, num_offloaded), num_offloaded) if self.on_cpu else
                                   (first, min(first + 1, num_offloaded)))  # each once: first may be the last
        for m in candidates:
            on_demand = self.expected_touched(num_tokens, num_offloaded - m)
            moved, rest_s = m + on_demand, on_demand * t
            if self.on_cpu and m < num_offloaded:
                cpu_s = self.cpu_layer_s(num_tokens, num_offloaded - m, on_demand)
                if cpu_s < rest_s:
                    moved, rest_s = m, cpu_s
            exposed = max(0.0, m * t - overlap_s) + rest_s
            if best is None or exposed < best[1]:
                best = (moved, exposed)
        return best

    def cpu_layer_s(self, num_tokens: int, num_coldest: int, touched: float | None = None) -> float:
        """Seconds the host CPU takes to compute a layer's ``num_coldest`` coldest experts for a step of T tokens,
        moving the routed rows both ways (module docstring); ``touched``: their Σ q when the caller has it."""
        if touched is None:
            touched = self.expected_touched(num_tokens, num_coldest)
        pairs = num_tokens * self._p_sum[num_coldest]
        work_s = max(touched * self.expert_bytes / self.cpu_bytes_per_s,
                     pairs * self.cpu_flops_per_pair / self.cpu_flops_per_s)
        # the host is called only when a row goes to one of them: P(any) <= min(1, Σ q)
        return work_s + min(num_tokens, pairs) * self.row_transfer_s + min(1.0, touched) * self.cpu_call_s

    def step(self, num_tokens: int, offloaded_per_layer: list[int] | tuple[int, ...],
             compute_s_per_layer: float) -> tuple[float, float]:
        """(staged bytes, exposed seconds) for one step."""
        if num_tokens <= 0:
            return 0.0, 0.0
        overlap_s = self.config.effective_overlap_layers * compute_s_per_layer
        moved = exposed = 0.0
        per_count: dict[int, tuple[float, float]] = {}  # offloads are spread: few distinct counts per step
        for n in offloaded_per_layer:
            if not n:
                continue
            cost = per_count.get(n)
            if cost is None:
                cost = per_count[n] = self.layer(num_tokens, n, overlap_s)
            moved += cost[0]
            exposed += cost[1]
        return moved * self.expert_bytes, exposed
