"""The movable line between expert weights and the KV pool, as one ledger both drivers use: what
``OffloadExperts`` carries out.

Offloading a region marks its experts offloaded (``core.experts``: they are now served from a host copy) and hands
the device memory they occupied to the KV pool as new block ids; no resident KV block moves or changes id. Reclaim
goes the other way, last region first, and only when every block the region produced is free (a free block holding
a cached prefix is dropped from the cache; a block in use blocks the reclaim).

``ExpertLine`` keeps the books every driver needs — the residency, the regions in conversion order, the per-layer
offload counts the staging models read, the counters — and asks a ``LineLayout`` how experts become blocks. Two
views of the same ledger:

* ``ByteLayout`` (the replay): region bytes accumulate and every whole ``block_bytes`` becomes one block, the
  remainder carrying to the next region — what vLLM's per-layer KV layout gets from 2 MiB pages (whole
  layer-blocks per page). Block ids are ``first_block_id, first_block_id + 1, …`` in conversion order.
* ``ArenaLayout`` (the engine): exact page books over ``core.arena``; a region's home pages become KV pages.

What a driver does besides the books (the engine switches its expert provider to the host copies and writes the
weights back on reclaim) is a ``WeightMover``, a no-op by default.

An offloaded expert yields its whole bytes to the pool (``kv_bytes_per_expert``), as the engine's arena gives its
whole pages. Staging needs device room of its own — ``STAGING_BUFFER_LAYERS`` layers' worth of offloaded experts
(the layer computing and the next one filling) — which both drivers keep outside the KV budget, as they keep
activations: the engine's staging buffers are tensors of their own, and the replay reserves
``staging_room_bytes`` at the cap beside the activation reserve (``sim.setup``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from moetide.core.arena import Arena
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


class LineLayout(Protocol):
    """How offloaded experts' device memory becomes KV blocks: one view of the ledger."""

    block_bytes: int  # one KV block's device bytes (what vamp prices a block at)
    kv_bytes_per_expert: int  # device bytes one offloaded expert yields to KV

    def blocks_gained(self, num_experts: int) -> int:
        """Blocks ``num_experts`` more offloaded experts would add to the pool."""
        ...

    def convert(self, region: tuple[ExpertKey, ...]) -> list[int]:
        """Give the region's memory to the pool; return the new block ids (may raise, having changed nothing)."""
        ...

    def reclaim(self, region: tuple[ExpertKey, ...], block_ids: Sequence[int]) -> bool:
        """Take the region's blocks out of the pool if all are free; else change nothing and return False."""
        ...

    def region_blocks(self, region: tuple[ExpertKey, ...], block_ids: Sequence[int]) -> list[int]:
        """The blocks a reclaim of the region would take (``block_ids``: those its conversion gave)."""
        ...

    def kv_room(self, pool: BlockPool) -> tuple[int, int]:
        """(uncached free, all) device KV blocks: the room a reclaim watermark reads."""
        ...


class WeightMover:
    """What a driver does with the weights when the line moves; the replay has none to move."""

    def mark_offloaded(self, keys: Sequence[ExpertKey]) -> None:
        """The experts are now served from their host copies."""

    def mark_resident(self, keys: Sequence[ExpertKey]) -> None:
        """The experts' device copies are back (written into their home memory)."""


class ByteLayout:
    """The replay's view: byte-granular conversion, the remainder carried to the next region (module docstring)."""

    def __init__(self, pool: BlockPool, *, block_bytes: int, kv_bytes_per_expert: int, first_block_id: int) -> None:
        if block_bytes <= 0:
            raise ValueError(f"block_bytes must be positive, got {block_bytes}")
        self.pool, self.block_bytes, self.kv_bytes_per_expert = pool, block_bytes, kv_bytes_per_expert
        self.first_block_id = first_block_id
        self._converted_bytes = 0

    @property
    def num_converted_blocks(self) -> int:
        return self._converted_bytes // self.block_bytes

    def blocks_gained(self, num_experts: int) -> int:
        converted = self._converted_bytes + num_experts * self.kv_bytes_per_expert
        return converted // self.block_bytes - self.num_converted_blocks

    def convert(self, region: tuple[ExpertKey, ...]) -> list[int]:
        start = self.first_block_id + self.num_converted_blocks
        new_ids = range(start, start + self.blocks_gained(len(region)))
        self.pool.add_blocks(new_ids)
        self._converted_bytes += len(region) * self.kv_bytes_per_expert
        return list(new_ids)

    def reclaim(self, region: tuple[ExpertKey, ...], block_ids: Sequence[int]) -> bool:
        if not self.pool.remove_blocks(block_ids):
            return False
        self._converted_bytes -= len(region) * self.kv_bytes_per_expert
        return True

    def region_blocks(self, region: tuple[ExpertKey, ...], block_ids: Sequence[int]) -> list[int]:
        return list(block_ids)

    def kv_room(self, pool: BlockPool) -> tuple[int, int]:
        """The pool's device blocks: all of them, or those outside its host tier."""
        tier = pool.host_tier
        if tier is None:
            return pool.num_uncached_free_blocks, pool.num_blocks
        return pool.num_device_uncached(pool.num_blocks), pool.num_blocks - tier.num_blocks


class ExpertLine:
    """Residency plus the pool's growth from offloaded experts, LIFO reclaim, in the layout's terms."""

    def __init__(self, residency: ExpertResidency, layout: LineLayout, weights: WeightMover | None = None) -> None:
        self.residency, self.layout = residency, layout
        self.weights = weights if weights is not None else WeightMover()
        self._regions: list[tuple[tuple[ExpertKey, ...], list[int]]] = []  # conversion order, for LIFO reclaim
        self.num_offloads = 0
        self.num_reclaims = 0
        self.num_new_blocks = 0  # blocks conversions have given the pool (reclaims do not subtract)
        self.offloaded_per_layer = [0] * residency.config.num_layers  # read by staging models every step

    @property
    def block_bytes(self) -> int:
        return self.layout.block_bytes

    @property
    def kv_bytes_per_expert(self) -> int:
        return self.layout.kv_bytes_per_expert

    def blocks_gained(self, num_experts: int) -> int:
        """Blocks the pool would gain from offloading ``num_experts`` more experts."""
        return self.layout.blocks_gained(num_experts)

    def kv_room(self, pool: BlockPool) -> tuple[int, int]:
        return self.layout.kv_room(pool)

    def offload(self, region: Sequence[ExpertKey]) -> list[int]:
        """Offload the region and give its memory to the pool; the new block ids. The residency validates the
        region and enforces the cap before anything changes; a layout that raises leaves the books as they were."""
        keys = tuple((layer, expert) for layer, expert in region)
        self.residency.mark_offloaded(keys)
        try:
            new_ids = self.layout.convert(keys)
        except Exception:
            self.residency.mark_resident(keys)
            raise
        self.weights.mark_offloaded(keys)
        if keys:
            self._regions.append((keys, new_ids))
        for layer, _ in keys:
            self.offloaded_per_layer[layer] += 1
        self.num_offloads += 1
        self.num_new_blocks += len(new_ids)
        return new_ids

    @property
    def num_granted_blocks(self) -> int:
        """Blocks the offloaded regions have given the pool and not taken back."""
        return sum(len(ids) for _, ids in self._regions)

    def last_region(self) -> tuple[tuple[ExpertKey, ...], list[int]] | None:
        if not self._regions:
            return None
        region, ids = self._regions[-1]
        return region, self.layout.region_blocks(region, ids)

    def reclaim_last(self) -> bool:
        """Give the last offloaded region back to its experts if all its blocks are free; else change nothing."""
        if not self._regions:
            return False
        region, ids = self._regions[-1]
        if not self.layout.reclaim(region, ids):
            return False
        self._regions.pop()
        self.residency.mark_resident(region)
        self.weights.mark_resident(region)
        for layer, _ in region:
            self.offloaded_per_layer[layer] -= 1
        self.num_reclaims += 1
        return True

    def check_invariants(self) -> None:
        self.residency.check_invariants()
        assert sum(len(r) for r, _ in self._regions) == self.residency.num_offloaded, "regions and residency differ"
        counts = [0] * len(self.offloaded_per_layer)
        for layer, _ in self.residency.all_offloaded():
            counts[layer] += 1
        assert counts == self.offloaded_per_layer, "per-layer offload counts differ from residency"


class ArenaLayout:
    """The engine's view of the expert line (``core.expert_line.LineLayout``): exact page books. A region's home
    pages become KV pages and the blocks they complete join the pool; a reclaim gives the pages back when every
    block in them is free. Only relabelling: no resident KV byte moves."""

    def __init__(self, arena: Arena) -> None:
        self.arena = arena
        self.block_bytes = arena.config.kv_block_bytes
        self.kv_bytes_per_expert = arena.config.pages_per_expert * arena.config.page_bytes  # home pages, padding in

    def blocks_gained(self, num_experts: int) -> int:
        """Exact when a block fits in a page (every converted page is a group of its own); when a block spans
        pages, the whole groups their pages make (a group straddling two experts appears only once both are
        converted, so this can be off by one)."""
        config = self.arena.config
        pages = num_experts * config.pages_per_expert
        return pages * config.blocks_per_group if config.pages_per_block == 1 else pages // config.pages_per_block

    def convert(self, region: tuple[ExpertKey, ...]) -> list[int]:
        return self.arena.convert_experts_to_kv(region)

    def reclaim(self, region: tuple[ExpertKey, ...], block_ids: Sequence[int]) -> bool:
        return self.arena.reclaim(region)

    def region_blocks(self, region: tuple[ExpertKey, ...], block_ids: Sequence[int]) -> list[int]:
        """The blocks in the region's pages now (a block straddling pages may have come with a later region)."""
        return self.arena.blocks_of_region(region)

    def kv_room(self, pool) -> tuple[int, int]:
        """(uncached free, all) KV blocks of the arena: host KV blocks in the same pool are not device room."""
        ids = self.arena.kv_block_ids()
        room = sum(1 for b in ids if pool.is_free(b) and pool.block_hash(b) is None and not pool.is_draining(b))
        return room, len(ids)
