"""Staging cost of offloaded experts: what a step pays for experts served from host memory. MODELED.

For each MoE layer with ``n`` offloaded experts (of ``E``, top-``k`` routing, uniform routing unless routing
probabilities are given), a step of ``T`` tokens stages

* ``touched`` mode (default): the offloaded experts the step's routing touches, ``n·(1 − (1 − k/E)^T)`` of them
  in expectation under uniform routing, ``Σ over the n coldest experts of 1 − (1 − p_e)^T`` when expert popularity
  follows a Zipf law of exponent ``routing_zipf_s`` (p_e = k·w_e/Σw, w_e = 1/rank^s) — the router's choice is known only once the layer runs, so this transfer overlaps nothing
  unless ``overlap_layers`` says the choice is predicted that many layers ahead;
* ``segment`` mode (as the VAMP paper does): the whole offloaded segment of every layer, every step, fetched
  ``overlap_layers`` (default 1) layers ahead so it overlaps the preceding layers' compute.

Per layer: transfer_s = bytes / (host-link bandwidth × efficiency) + per-transfer latency × experts moved;
exposed_s = max(0, transfer_s − overlap_layers × compute_s_per_layer). A step's staging cost is the sum of the
exposed times over MoE layers. Bytes per expert are per GPU (an expert's shard at tensor parallelism ``tp``).
"""

from __future__ import annotations

from dataclasses import dataclass

from moetide.perf.budget import weights_per_gpu
from moetide.specs import HardwareSpec, ModelSpec

TOUCHED, SEGMENT = "touched", "segment"


@dataclass(frozen=True)
class StagingConfig:
    mode: str = TOUCHED
    link_efficiency: float = 0.9  # of the measured pinned H2D figure in the GPU preset (already a measured rate)
    transfer_latency_s: float = 10e-6  # per expert copy (cudaMemcpyAsync launch + DMA setup, typical)
    overlap_layers: float | None = None  # None: 0 for touched, 1 for segment
    # Expert popularity within a layer: Zipf with this exponent (0 = uniform routing, the pessimistic default).
    # Offloaded experts are the coldest ones (what core.experts picks from routing statistics).
    routing_zipf_s: float = 0.0

    def __post_init__(self) -> None:
        if self.mode not in (TOUCHED, SEGMENT):
            raise ValueError(f"staging mode must be {TOUCHED!r} or {SEGMENT!r}, got {self.mode!r}")
        if not 0 < self.link_efficiency <= 1:
            raise ValueError(f"link_efficiency must be in (0, 1], got {self.link_efficiency}")
        if self.transfer_latency_s < 0 or (self.overlap_layers is not None and self.overlap_layers < 0):
            raise ValueError("transfer_latency_s and overlap_layers must be >= 0")
        if self.routing_zipf_s < 0:
            raise ValueError(f"routing_zipf_s must be >= 0, got {self.routing_zipf_s}")

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
        self.link_bytes_per_s = gpu.host_link_bandwidth_bytes_per_s * config.link_efficiency
        self.num_moe_layers = model.num_moe_layers
        weights = [1.0 / (rank + 1) ** config.routing_zipf_s for rank in range(self.num_experts)]
        total = sum(weights)
        # per-token probability that expert of popularity rank r is among the top-k, coldest first
        self._p_coldest = [min(1.0, self.top_k * w / total) for w in reversed(weights)]
        self._moved: dict[tuple[int, int], float] = {}

    def touched_share(self, num_tokens: int) -> float:
        """Expected share of any one expert's being routed by at least one of the step's tokens (uniform)."""
        if self.config.mode == SEGMENT:
            return 1.0
        return 1.0 - (1.0 - self.top_k / self.num_experts) ** num_tokens

    def experts_moved(self, num_tokens: int, num_offloaded: int) -> float:
        """Expected offloaded experts (the ``num_offloaded`` coldest of a layer) a step of T tokens stages."""
        if self.config.mode == SEGMENT:
            return float(num_offloaded)
        key = (num_tokens, num_offloaded)
        moved = self._moved.get(key)
        if moved is None:
            moved = sum(1.0 - (1.0 - p) ** num_tokens for p in self._p_coldest[:num_offloaded])
            if len(self._moved) < 100_000:
                self._moved[key] = moved
        return moved

    def step(self, num_tokens: int, offloaded_per_layer: list[int] | tuple[int, ...],
             compute_s_per_layer: float) -> tuple[float, float]:
        """(staged bytes, exposed seconds) for one step."""
        if num_tokens <= 0:
            return 0.0, 0.0
        overlap_s = self.config.effective_overlap_layers * compute_s_per_layer
        staged = exposed = 0.0
        for n in offloaded_per_layer:
            if not n:
                continue
            moved = self.experts_moved(num_tokens, n)
            nbytes = moved * self.expert_bytes
            transfer_s = nbytes / self.link_bytes_per_s + self.config.transfer_latency_s * moved
            staged += nbytes
            if transfer_s > overlap_s:
                exposed += transfer_s - overlap_s
        return staged, exposed
