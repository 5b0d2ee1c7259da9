"""Expert weights for the engine: resident experts from their arena pages, offloaded ones staged from host copies;
the ``core.expert_line.WeightMover`` of the engine's line (``ExpertLine`` over ``ArenaLayout``).

Who decides what: ``core.experts.ExpertResidency`` decides which experts are offloaded (a policy's
``OffloadExperts`` action, or the engine's static offload at start, both through ``ExpertLine.offload``)
and ``core.arena.Arena`` decides which pages become which KV blocks. This module only serves weights accordingly
and records the router's choices into the residency (``record_routing``, once per step in ``end_step``), so
its cold-first choice sees real routing. It makes no memory decision.

Staging (``ExpertStager``): when the model announces a layer's routing (``route``), every routed expert that is
offloaded is copied from its host copy (packed exactly like its home pages, ``engine.storage.pack_experts``)
into a device staging buffer, and ``expert_weights`` returns views of that buffer. On CUDA the host copy is
pinned and the copies run on a side stream: the compute stream waits on an event before it first reads a staged
expert, and two buffers alternate between consecutive MoE layers so layer n's copies never overwrite what layer
n-1 is still reading (the copy for layer n waits on an event recorded when layer n-1 was routed, which covers
layer n-2's reads of the same buffer). On the CPU the same code runs with synchronous copies and no events.
Staging buffers live outside the arena: they are the working set of one layer, not a tenant of HBM pages.

Or computed where they lie (``host_max_rows`` > 0, the engine's ``cold_experts="cpu"``): an offloaded expert that
the step routes at most ``host_max_rows`` rows to is not staged; ``expert_weights`` returns views of its host copy
and the MoE block's looped path sends those rows to the host, runs the expert there and brings the result back
(Fiddler/KTransformers style: a few rows cross the link instead of the expert's weights). On the CPU this computes
straight from the host copy, with no staging copy. Experts routed more rows than that are staged as above.

Resident experts are also served all at once (``stacked_weights``: the arena's strided [E, ...] views), which
lets the MoE block run its grouped GEMMs; a layer whose routing just staged an expert gets ``None`` there and
fetches expert by expert, so a staged expert is always read from the staging buffer, never from its old pages.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from moetide.core.expert_line import WeightMover
from moetide.core.experts import ExpertKey, ExpertResidency
from moetide.engine.models import ExpertProvider, ExpertWeights
from moetide.engine.storage import ArenaStorage, ExpertLayout


class ExpertStager:
    """Two alternating device buffers of ``num_slots`` experts each, filled from the host copy."""

    def __init__(self, host: Tensor, layout: ExpertLayout, device: torch.device) -> None:
        self.host, self.layout, self.device = host, layout, device
        self.is_cuda = device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(device) if self.is_cuda else None
        self.num_slots = 0
        self._buffers: list[Tensor] = []
        self._turn = 0
        self._last_route_event = None
        self._ready_event = None
        self._staged: dict[int, ExpertWeights] = {}
        self.num_staged = 0  # experts copied, lifetime (a statistic)

    def ensure_slots(self, num_slots: int) -> None:
        """Grow the buffers to hold ``num_slots`` experts (between steps; waits for in-flight work on CUDA)."""
        if num_slots <= self.num_slots:
            return
        if self.is_cuda:
            torch.cuda.synchronize(self.device)
        shape = (num_slots, self.layout.numel)
        self._buffers = [torch.empty(shape, dtype=self.layout.dtype, device=self.device) for _ in range(2)]
        self.num_slots = num_slots

    def stage(self, moe_index: int, expert_ids: Sequence[int]) -> None:
        """Start copying the experts' host copies into the next buffer; ``weights`` then serves them."""
        buffer = self._buffers[self._turn]
        self._turn ^= 1
        self._staged = {e: self.layout.weights(buffer[slot]) for slot, e in enumerate(expert_ids)}
        self.num_staged += len(expert_ids)
        if not self.is_cuda:
            for slot, e in enumerate(expert_ids):
                buffer[slot].copy_(self.host[moe_index, e])
            return
        compute = torch.cuda.current_stream(self.device)
        if self._last_route_event is not None:
            self.copy_stream.wait_event(self._last_route_event)  # layer n-2 is done reading this buffer
        self._last_route_event = compute.record_event()
        with torch.cuda.stream(self.copy_stream):
            for slot, e in enumerate(expert_ids):
                buffer[slot].copy_(self.host[moe_index, e], non_blocking=True)
            self._ready_event = self.copy_stream.record_event()

    def weights(self, expert_id: int) -> ExpertWeights:
        if self._ready_event is not None:
            torch.cuda.current_stream(self.device).wait_event(self._ready_event)
            self._ready_event = None
        try:
            return self._staged[expert_id]
        except KeyError:
            raise RuntimeError(f"expert {expert_id} was not staged: route() must announce it first") from None


class StagedExpertProvider(WeightMover, ExpertProvider):
    """``ExpertProvider``: routing statistics into ``ExpertResidency``; weights from home pages or staging."""

    def __init__(self, storage: ArenaStorage, residency: ExpertResidency, host: Tensor, *,
                 host_max_rows: int = 0) -> None:
        layout = storage.expert_layout
        self.host_max_rows = host_max_rows  # offloaded experts routed at most this many rows run on the host
        self._host_views = {(m, e): layout.weights(host[m, e]) for m in range(len(layout.moe_layer_ids))
                            for e in range(layout.num_experts)} if host_max_rows else {}
        self._on_host: dict[int, ExpertWeights] = {}  # this layer's experts computed from their host copies
        self.num_host_computed = 0  # experts computed on the host, lifetime (a statistic)
        self.num_host_rows = 0  # rows those experts computed, lifetime (what ``engine.vamp`` prices them by)
        self.storage, self.residency, self.layout = storage, residency, layout
        self.moe_index = {layer_id: m for m, layer_id in enumerate(layout.moe_layer_ids)}
        self.stager = ExpertStager(host, layout, storage.device)
        self._resident: dict[tuple[int, int], ExpertWeights] = {
            (m, e): storage.expert_weights(m, e)
            for m in range(len(layout.moe_layer_ids)) for e in range(layout.num_experts)
        }
        self._offloaded: list[list[int]] = [[] for _ in layout.moe_layer_ids]
        self._step_counts: list[tuple[int, Tensor]] = []  # this step's routing, recorded by end_step()
        self._looped_layer: int | None = None  # MoE layer whose routing (last route()) staged or left experts on host
        self.touches: TouchRates | None = None  # per-step touch rates, kept when a policy reads them (vamp)
        self.totals: Tensor | None = None  # [M, E] tokens routed per expert since enabled (``--routing-out``)

    def route(self, layer_id: int, expert_ids: Tensor) -> None:
        m = self.moe_index[layer_id]
        counts = torch.bincount(expert_ids.flatten(), minlength=self.layout.num_experts)  # [E]
        self._step_counts.append((m, counts))
        self._looped_layer = None
        self._on_host = {}
        if self._offloaded[m]:  # only then read the routing back before the layer runs (a sync on CUDA)
            routed = counts.tolist()
            needed = [e for e in self._offloaded[m] if routed[e]]
            if self.host_max_rows:
                self._on_host = {e: self._host_views[m, e] for e in needed if routed[e] <= self.host_max_rows}
                self.num_host_computed += len(self._on_host)
                self.num_host_rows += sum(routed[e] for e in self._on_host)
                needed = [e for e in needed if e not in self._on_host]
            if needed:
                self.stager.stage(m, needed)
            if needed or self._on_host:
                self._looped_layer = m

    def stacked_weights(self, layer_id: int) -> tuple[Tensor, Tensor] | None:
        """All experts of the layer as the arena's strided views, unless the last ``route`` staged some of them or
        left some on the host (then the MoE block fetches expert by expert: ``expert_weights``). An offloaded expert
        that nobody chose keeps KV bytes in its rows; the grouped path never reads the rows of an unchosen expert."""
        m = self.moe_index[layer_id]
        return None if self._looped_layer == m else self.storage.stacked_experts(m)

    def resident_weights(self, layer_id: int) -> tuple[Tensor, Tensor] | None:
        """The arena's views of the layer's experts while none of them is offloaded (no routing can need staging)."""
        m = self.moe_index[layer_id]
        return None if self._offloaded[m] else self.storage.stacked_experts(m)

    def end_step(self) -> None:
        """Record the step's routing into the residency (one read-back per step, after the forward)."""
        if not self._step_counts:
            return
        stacked = torch.stack([counts for _, counts in self._step_counts]).cpu()  # the one read-back
        if self.totals is not None or self.touches is not None:
            layers = torch.tensor([m for m, _ in self._step_counts])
            if self.totals is not None:
                self.totals.index_add_(0, layers, stacked)
            if self.touches is not None:
                self.touches.record(layers, stacked)
        rows = stacked.tolist()
        for (m, _), row in zip(self._step_counts, rows):
            self.residency.record_counts(m, row)
        self._step_counts = []

    def expert_weights(self, layer_id: int, expert_id: int) -> ExpertWeights:
        """Where the expert is computed: its home pages, its staging slot, or (``host_max_rows``) its host copy —
        on another device than the activations, which the MoE block then sends there and back."""
        weights = self._resident.get((self.moe_index[layer_id], expert_id))
        if weights is not None:
            return weights
        on_host = self._on_host.get(expert_id)
        return on_host if on_host is not None else self.stager.weights(expert_id)

    def host_weights(self, moe_index: int, expert_id: int) -> ExpertWeights:
        """Views of an expert's host copy (where ``host_max_rows`` computes it)."""
        return self.layout.weights(self.stager.host[moe_index, expert_id])

    def mark_offloaded(self, region: Sequence[ExpertKey]) -> None:
        """Serve the region's experts from their host copies from now on (their pages are about to hold KV)."""
        for m, e in region:
            del self._resident[(m, e)]
            self._offloaded[m].append(e)
            self._offloaded[m].sort()
        self.stager.ensure_slots(max(len(experts) for experts in self._offloaded))

    def record_totals(self) -> None:
        """Count tokens routed per expert from now on (``totals``; a measured routing profile)."""
        if self.totals is None:
            self.totals = torch.zeros(len(self.layout.moe_layer_ids), self.layout.num_experts, dtype=torch.int64)

    def mark_resident(self, region: Sequence[ExpertKey]) -> None:
        """Serve the region's experts from their home pages again, rewritten from their host copies (the pages
        held KV blocks until now; the caller made sure those blocks were free)."""
        for m, e in region:
            self.storage.store_expert(m, e, self.stager.host[m, e])
            self._resident[(m, e)] = self.storage.expert_weights(m, e)
            self._offloaded[m].remove(e)


class TouchRates:
    """How often each routed expert is touched (routed to by at least one token) per step, as an exponentially
    weighted mean over the last ~``1 / (1 - decay)`` steps: what staging an offloaded expert would cost per step
    is its touch rate times one copy (``engine.vamp``). With ``host_max_rows`` (cold experts computed on the
    host) it also keeps the touches of at most that many rows and the rows they brought: those would be computed
    from the host copy instead of staged."""

    def __init__(self, num_layers: int, num_experts: int, decay: float = 0.98, host_max_rows: int = 0) -> None:
        self.decay, self.host_max_rows = decay, host_max_rows
        self._sum = torch.zeros(num_layers, num_experts, dtype=torch.float64)
        self._host = torch.zeros_like(self._sum)  # touches of at most host_max_rows rows
        self._host_rows = torch.zeros_like(self._sum)  # the rows of those touches
        self._weight = 0.0  # Σ decay^age over recorded steps

    def record(self, moe_indices: Tensor, counts: Tensor) -> None:
        """One step's routing counts [n, E] (on the CPU) of the MoE layers ``moe_indices`` [n]."""
        for acc in (self._sum, self._host, self._host_rows):
            acc.mul_(self.decay)
        self._sum.index_add_(0, moe_indices, (counts > 0).to(torch.float64))
        if self.host_max_rows:
            small = (counts > 0) & (counts <= self.host_max_rows)
            self._host.index_add_(0, moe_indices, small.to(torch.float64))
            self._host_rows.index_add_(0, moe_indices, torch.where(small, counts, 0).to(torch.float64))
        self._weight = self._weight * self.decay + 1.0

    def rates(self) -> list[list[float]]:
        """[M][E] touches per step (0 before any step)."""
        return (self._sum / self._weight).tolist() if self._weight else self._sum.tolist()

    def host_rates(self) -> tuple[list[list[float]], list[list[float]]]:
        """([M][E] touches per step of at most ``host_max_rows`` rows, [M][E] rows per step they brought)."""
        weight = self._weight or 1.0
        return (self._host / weight).tolist(), (self._host_rows / weight).tolist()
