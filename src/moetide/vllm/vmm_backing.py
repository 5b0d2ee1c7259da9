"""The KV backing on an accelerator: one reserved range for the whole line, the reserve mapped only while granted,
by the chunks the offloaded experts gave up (``vllm.vmm``).

``CpuBacking``'s interface (``vllm.backing``) over ``vllm.vmm.DeviceMemory``:

* at start the base blocks' granules are mapped in few large chunks (one create, map and access call per run of
  granules, not four calls per granule), and a small **spare** of granule chunks goes to the free list: a grant
  needs the granules its blocks touch, which can be one more per KV range than its experts' whole granules;
* then the memory is sealed (``DeviceMemory.seal``): the device never holds more than it holds now;
* a grant maps granule chunks from the free list, which the region's experts filled just before
  (``vllm.pager.apply_line_op`` orders the two), under the granules only the granted blocks use, and zeroes them
  (vLLM's ``torch.zeros`` gave zeros); what cannot be met raises ``OverBudget`` with nothing changed;
* a give-back unmaps the granules no block still backed touches (after the device is idle), exactly those its
  grant mapped, and puts their chunks in the free list, for the experts' rows to take home.
"""

from __future__ import annotations

import torch

from moetide.vllm.backing import BlockSpans, check_op
from moetide.vllm.line import LineOp
from moetide.vllm.vmm import DeviceMemory, OverBudget


class VmmBacking:
    """The KV buffer of one worker over ``memory``, the reserve past ``num_base_blocks`` mapped only as granted."""

    def __init__(self, size: int, tensors, memory: DeviceMemory, *, num_base_blocks: int, num_blocks: int,
                 spare_chunks: int | None = None) -> None:
        g, driver = memory.granule, memory.driver
        self.memory, self.size = memory, size
        self.reserved = max(-(-size // g) * g, g)
        self.address = driver.reserve(self.reserved)
        self.spans = BlockSpans(tensors, g, self.reserved, num_blocks)
        self.num_base_blocks, self.num_blocks = num_base_blocks, num_blocks
        self.granted: set[int] = set()
        self.applied: list[LineOp] = []
        self.history: list[tuple[bool, int]] = []  # per op: (grow, device bytes held after it)
        self._base: list[tuple[int, int, int]] = []  # (offset, size, chunk) of the base's runs
        self._granules: dict[int, int] = {}  # granule offset -> chunk, for the reserve's mapped granules
        for start, end in self.spans.units(range(num_base_blocks), inward=False):
            chunk = memory.create(end - start)
            driver.map(self.address + start, end - start, chunk)
            driver.set_access(self.address + start, end - start)
            driver.view(self.address + start, end - start).zero_()
            self._base.append((start, end - start, chunk))
        self._base_granules = {o for start, size, _ in self._base for o in range(start, start + size, g)}
        spare = spare_granules(tensors) if spare_chunks is None else spare_chunks
        for _ in range(spare):
            memory.put(memory.create(g))
        memory.seal()
        self.buffer = driver.view(self.address, size).view(torch.int8)

    @property
    def mapped_bytes(self) -> int:
        """Device memory under the KV range now: the base's runs and the granted granules."""
        return sum(size for _, size, _ in self._base) + len(self._granules) * self.memory.granule

    def apply(self, op: LineOp, lent=()) -> None:
        """Grant (map chunks from the free list) or give back (unmap them into it) the op's blocks."""
        check_op(op, self.granted, self.num_base_blocks, self.num_blocks)
        ids = set(op.block_ids)
        if op.grow:
            self._grant(ids)
        else:
            self.granted -= ids
            self._give_back(self.spans.untouched(ids, self._backed))
        self.applied.append(op)
        self.history.append((op.grow, self.memory.held_bytes))

    def _backed(self, block_id: int) -> bool:
        return block_id < self.num_base_blocks or block_id in self.granted

    def _grant(self, ids: set[int]) -> None:
        g = self.memory.granule
        needed = sorted({o for start, end in self.spans.units(ids, inward=False) for o in range(start, end, g)}
                        - self._base_granules - self._granules.keys())
        if len(needed) > self.memory.free_chunks:
            raise OverBudget(f"a grant of {len(ids)} blocks needs {len(needed)} granules; {self.memory.free_chunks} "
                             f"are free (the experts' and the spare)")
        handles = self.memory.map_granules(self.address, needed, zero=True)
        self._granules.update(zip(needed, handles))
        self.granted |= ids

    def _give_back(self, ranges: list[tuple[int, int]]) -> None:
        g = self.memory.granule
        offsets = sorted(o for start, end in ranges for o in range(start, end, g) if o in self._granules)
        if offsets:
            self.memory.driver.synchronize()
        self.memory.unmap_granules(self.address, offsets)
        for offset in offsets:
            self.memory.put(self._granules.pop(offset))

    def stats(self) -> dict:
        """Plain data for a worker RPC: the KV range's mapping, grants, and the device memory's ledger."""
        return {"mapped_bytes": self.mapped_bytes, "granted_blocks": len(self.granted),
                "applied_ops": len(self.applied), "history": list(self.history), **self.memory.stats()}

    def close(self) -> None:
        """Unmap everything and free the range (the buffer must not be used after); chunks go to the free list or,
        for the base's, are released."""
        self.memory.driver.synchronize()
        self._give_back([(0, self.reserved)])
        for start, size, chunk in self._base:
            self.memory.driver.unmap(self.address + start, size)
            self.memory.release(chunk, size)
        self._base = []
        self.memory.driver.free(self.address, self.reserved)


def spare_granules(tensors) -> int:
    """Granules a grant may need beyond its experts' whole granules, held from the start: at most one per
    contiguous KV range a block set cuts (each layer of a layer-outer tensor, one for a block-outer one), and one
    more for the ranges' common edge."""
    return sum(len(t.layers) if t.block_stride < t.layer_stride else 1 for t in tensors) + 1
