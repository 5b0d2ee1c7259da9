"""The movable line between expert weights and the KV pool, as books: what ``OffloadExperts`` carries out.

Offloading a region marks its experts offloaded (``core.experts``: they are now served from a host copy) and hands
the bytes they occupied to the KV pool as new block ids; no resident KV block moves or changes id. Reclaim goes
the other way, last region first, and only when every block the region produced is free (a free block holding a
cached prefix is dropped from the cache; a block in use blocks the reclaim).

This ledger converts at byte granularity: region bytes accumulate and every whole ``block_bytes`` becomes one block,
the remainder carrying to the next region. That is what vLLM's per-layer KV layout gets from 2 MiB pages (whole
layer-blocks per page); the engine keeps exact page books with ``core.arena`` instead. Block ids given out are
``first_block_id, first_block_id + 1, …`` in conversion order.

An offloaded expert yields its whole bytes to the pool (``kv_bytes_per_expert``), as the engine's arena gives its
whole pages. Staging needs device room of its own — ``STAGING_BUFFER_LAYERS`` layers' worth of offloaded experts
(the layer computing and the next one filling) — which both drivers keep outside the KV budget, as they keep
activations: the engine's staging buffers are tensors of their own, and the replay reserves
``staging_room_bytes`` at the cap beside the activation reserve (``sim.setup``).
"""

from __future__ import annotations

from collections.abc import Sequence

from moetide.core.blocks import BlockPool
from moetide.core.experts import ExpertKey, ExpertResidency, ExpertResidencyConfig
from moetide.units import cdiv

STAGING_BUFFER_LAYERS = 2  # the layer computing and the next one being filled


def staging_room_bytes(config: ExpertResidencyConfig, max_num_offloaded: int) -> int:
    """Device bytes the staging buffers need at the cap: ``STAGING_BUFFER_LAYERS`` buffers of the most experts
    one layer can have offloaded (offloads are spread evenly over the layers, so that is the cap's share of a
    layer, rounded up)."""
    per_layer = cdiv(max_num_offloaded, config.num_layers)
    return STAGING_BUFFER_LAYERS * per_layer * config.expert_bytes


class ExpertLine:
    """Residency plus the pool's growth from offloaded experts (LIFO reclaim)."""

    def __init__(self, residency: ExpertResidency, pool: BlockPool, *, block_bytes: int, first_block_id: int) -> None:
        if block_bytes <= 0:
            raise ValueError(f"block_bytes must be positive, got {block_bytes}")
        self.residency = residency
        self.pool = pool
        self.block_bytes = block_bytes
        self.kv_bytes_per_expert = residency.config.expert_bytes
        self.first_block_id = first_block_id
        self._converted_bytes = 0
        self._regions: list[tuple[tuple[ExpertKey, ...], range]] = []  # conversion order, for LIFO reclaim
        self.num_offloads = 0
        self.num_reclaims = 0
        self.offloaded_per_layer = [0] * residency.config.num_layers  # read by staging models every step

    @property
    def num_converted_blocks(self) -> int:
        return self._converted_bytes // self.block_bytes

    def blocks_gained(self, num_experts: int) -> int:
        """Blocks the pool would gain from offloading ``num_experts`` more experts."""
        converted = self._converted_bytes + num_experts * self.kv_bytes_per_expert
        return converted // self.block_bytes - self.num_converted_blocks

    def offload(self, region: Sequence[ExpertKey]) -> list[int]:
        region = tuple(region)
        self.residency.mark_offloaded(region)  # validates and enforces the cap before anything changes
        start = self.first_block_id + self.num_converted_blocks
        self._converted_bytes += len(region) * self.kv_bytes_per_expert
        new_ids = range(start, self.first_block_id + self.num_converted_blocks)
        self.pool.add_blocks(new_ids)
        self._regions.append((region, new_ids))
        for layer, _ in region:
            self.offloaded_per_layer[layer] += 1
        self.num_offloads += 1
        return list(new_ids)

    def kv_room(self, pool: BlockPool) -> tuple[int, int]:
        """(uncached free, all) blocks of the pool: the device room a reclaim watermark reads (the whole pool is
        device KV here; the engine's line counts its arena's blocks only)."""
        return pool.num_uncached_free_blocks, pool.num_blocks

    def last_region(self) -> tuple[tuple[ExpertKey, ...], range] | None:
        return self._regions[-1] if self._regions else None

    def reclaim_last(self) -> bool:
        """Give the last offloaded region back to its experts if all its blocks are free; else change nothing."""
        if not self._regions:
            return False
        region, ids = self._regions[-1]
        if not self.pool.remove_blocks(ids):
            return False
        self._regions.pop()
        self._converted_bytes -= len(region) * self.kv_bytes_per_expert
        self.residency.mark_resident(region)
        for layer, _ in region:
            self.offloaded_per_layer[layer] -= 1
        self.num_reclaims += 1
        return True

    def check_invariants(self) -> None:
        self.residency.check_invariants()
        assert sum(len(r) for r, _ in self._regions) == self.residency.num_offloaded, "regions and residency differ"
        given = [b for _, ids in self._regions for b in ids]
        assert len(given) == self.num_converted_blocks, "converted bytes and blocks given differ"
        assert set(given) <= set(self.pool.block_ids()), "a converted block left the pool"
        counts = [0] * len(self.offloaded_per_layer)
        for layer, _ in self.residency.all_offloaded():
            counts[layer] += 1
        assert counts == self.offloaded_per_layer, "per-layer offload counts differ from residency"
