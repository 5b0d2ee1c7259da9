"""The KV backing on the CPU: one allocation for the whole line, its reserve backed by the experts' own pages.

vLLM allocates the KV cache as one ``torch.zeros`` buffer every layer views (``v1/worker/utils.py``,
``allocate_kv_cache``). The plugin's patch (``vllm.plugin``) builds that buffer from an anonymous private ``mmap``
instead: the kernel backs a page only when it is first written, and gives zeros until then, as ``torch.zeros``
does. The blocks past the base (the line's reserve, ``vllm.pool``) are then made inaccessible (``PROT_NONE``), so:

* pages of a region never granted are never touched: resident memory does not include them;
* granting a region (a ``LineOp`` with ``grow``) maps the pages of the region's experts, which the expert pager
  lends (``vllm.shared_rows``), over the pages only the granted blocks use (``mmap(MAP_FIXED | MAP_SHARED)``): the KV
  cache grows into the experts' memory, with no copy and no new memory. What the lent pages do not cover (the
  pages a granted block shares with another, or a region whose experts have no whole pages, as on another
  device) is made readable and writable and counts once written;
* giving one back maps fresh inaccessible anonymous memory over the blocks' pages: lent pages go back to the
  experts (the pager then writes them home), anonymous ones to the system;
* reading or writing an ungranted block faults at once (``SIGSEGV``): a bug that would read unbacked KV cannot
  pass silently.

A block's bytes in one layer are ``[offset + l*layer_stride + b*block_stride, + min(layer_stride, block_stride))``
for each ``KVCacheTensor`` (groups overlay the same bytes). Pages shared by a granted and an ungranted block stay
accessible (grants round out to pages, releases round in), so protection is exact when a block's bytes are whole
pages and off by less than a page per layer at each region edge otherwise.

One backing per process: the worker's connector finds it with ``registered_backing``. CUDA's counterpart (driver
virtual memory: reserve, create, map, unmap) is ``vllm.vmm_backing``.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from collections.abc import Iterable, Sequence

import torch

from moetide.vllm.shared_rows import PageRun, map_fixed, punch
from moetide.vllm.line import LineOp

PAGE = mmap.PAGESIZE
_PROT_NONE, _PROT_RW = 0, mmap.PROT_READ | mmap.PROT_WRITE
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]

_BACKING: CpuBacking | None = None


def rss_bytes() -> int:
    """This process's resident memory (``VmRSS``)."""
    with open(f"/proc/{os.getpid()}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("VmRSS not found in /proc/self/status")


def _call(fn, address: int, length: int, arg: int) -> None:
    if length > 0 and fn(address, length, arg) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{fn.__name__}({address:#x}, {length}, {arg}): {os.strerror(err)}")


def _merge(intervals: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


class BlockSpans:
    """Where each block's bytes lie in a backing laid out by vLLM's ``KVCacheTensor``s, in units of ``granule``
    (the CPU's page; the CUDA driver's mapping granularity): the units fully inside some blocks, or touching them."""

    def __init__(self, tensors, granule: int, size: int, num_blocks: int) -> None:
        self.granule, self.size, self.num_blocks = granule, size, num_blocks
        self._layout = [(t.offset, t.layer_stride, t.block_stride, len(t.layers),
                         min(t.layer_stride, t.block_stride) if len(t.layers) > 1 else t.block_stride)
                        for t in tensors]

    def intervals(self, block_ids: Iterable[int]) -> list[tuple[int, int]]:
        spans = []
        for block_id in block_ids:
            for offset, layer_stride, block_stride, num_layers, extent in self._layout:
                start = offset + block_id * block_stride
                spans.extend((start + i * layer_stride, start + i * layer_stride + extent) for i in range(num_layers))
        return _merge(spans)

    def units(self, block_ids: Iterable[int], *, inward: bool) -> list[tuple[int, int]]:
        """Granule-aligned byte ranges: those fully inside the blocks (``inward``) or touching them."""
        g, out = self.granule, []
        for start, end in self.intervals(block_ids):
            if inward:
                start, end = -(-start // g) * g, end // g * g
            else:
                start, end = start // g * g, min(-(-end // g) * g, -(-self.size // g) * g)
            if end > start:
                out.append((start, end))
        return _merge(out)

    def released(self, block_ids: Iterable[int], is_kept) -> list[tuple[int, int]]:
        """Units wholly inside ``block_ids`` that no kept block (``is_kept(id)``) touches: what giving them back
        frees. Only blocks a unit's width away can share a unit, so only those neighbours are looked at (modulo the
        pool: a layer's last block lies next to the following layer's first)."""
        return self._free_of_kept(block_ids, is_kept, inward=True)

    def untouched(self, block_ids: Iterable[int], is_kept) -> list[tuple[int, int]]:
        """Units that ``block_ids`` touch and no kept block (``is_kept(id)``) touches: everything a backing that maps
        what blocks touch may give back once the blocks are gone."""
        return self._free_of_kept(block_ids, is_kept, inward=False)

    def _free_of_kept(self, block_ids: Iterable[int], is_kept, *, inward: bool) -> list[tuple[int, int]]:
        ids = set(block_ids)
        extent = min(layout[4] for layout in self._layout)
        radius = -(-self.granule // max(extent, 1)) + 1
        near = {(b + d) % self.num_blocks for b in ids for d in range(-radius, radius + 1)} - ids
        holes = self.units((b for b in near if is_kept(b)), inward=False)
        return [piece for span in self.units(ids, inward=inward) for piece in _subtract(span, holes)]


class CpuBacking:
    """The KV buffer of one worker, with the reserve past ``num_base_blocks`` committed only as granted."""

    def __init__(self, size: int, tensors, *, num_base_blocks: int, num_blocks: int) -> None:
        self._mmap = mmap.mmap(-1, max(size, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.buffer = torch.frombuffer(self._mmap, dtype=torch.int8, count=size)
        self.address = self.buffer.data_ptr()
        self.num_base_blocks, self.num_blocks = num_base_blocks, num_blocks
        self.spans = BlockSpans(tensors, PAGE, len(self._mmap), num_blocks)
        self.granted: set[int] = set()
        self.applied: list[LineOp] = []
        # per op applied: (grow, the reserve's anonymous resident bytes before it, after it, the bytes of lent expert
        # pages it held after it): what the memory did
        self.history: list[tuple[bool, int, int, int]] = []
        self._lent_pages: set[int] = set()  # buffer offsets of the pages mapped onto lent expert pages
        reserve = range(num_base_blocks, num_blocks)
        self._reserve_pages = self.spans.released(reserve, lambda b: b < num_base_blocks)
        self._protect(self._reserve_pages, _PROT_NONE)

    @property
    def reserve_bytes(self) -> int:
        """Bytes of the pages only the reserve's blocks use (what granting all of it would commit at most)."""
        return sum(e - s for s, e in self._reserve_pages)

    def resident_reserve_bytes(self) -> int:
        """Bytes of the reserve's pages the kernel holds in memory now (``mincore``), lent expert pages included."""
        total = 0
        for start, end in self._reserve_pages:
            pages = (end - start) // PAGE
            vec = ctypes.create_string_buffer(pages)
            _call(_libc.mincore, self.address + start, end - start, vec)
            total += sum(b & 1 for b in vec.raw) * PAGE
        return total

    def _backed(self, block_id: int) -> bool:
        return block_id < self.num_base_blocks or block_id in self.granted

    def _protect(self, ranges: list[tuple[int, int]], prot: int) -> None:
        for start, end in ranges:
            _call(_libc.mprotect, self.address + start, end - start, prot)

    def apply(self, op: LineOp, lent: Sequence[PageRun] = ()) -> None:
        """Grant the op's blocks over the ``lent`` expert pages, or give them back (module docstring)."""
        before = self.anonymous_reserve_bytes()
        self._apply(op, lent)
        self.history.append((op.grow, before, self.anonymous_reserve_bytes(), self.lent_bytes))

    def _apply(self, op: LineOp, lent: Sequence[PageRun]) -> None:
        ids = set(op.block_ids)
        check_op(op, self.granted, self.num_base_blocks, self.num_blocks)
        if op.grow:
            whole = self.spans.released(ids, self._backed)  # pages only these blocks use
            self.granted |= ids
            self._protect(self.spans.units(ids, inward=False), _PROT_RW)
            self._lend(whole, lent)
        else:
            self.granted -= ids
            # pages wholly inside the released blocks that no granted or base block touches: fresh inaccessible
            # memory over them (what was lent goes back to its file, anonymous pages to the system)
            for start, end in self.spans.released(ids, self._backed):
                map_fixed(self.address + start, end - start, _PROT_NONE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
                self._lent_pages.difference_update(range(start, end, PAGE))
        self.applied.append(op)

    def _lend(self, ranges: list[tuple[int, int]], lent: Sequence[PageRun]) -> None:
        """Map the lent expert pages over ``ranges`` of the buffer, in order, as far as they go; expert pages
        left over (the blocks took less than the region's bytes) are given back to the system."""
        runs = [(run.fd, run.offset, run.nbytes) for run in lent]
        for start, end in ranges:
            while start < end and runs:
                fd, offset, nbytes = runs[0]
                length = min(end - start, nbytes)
                map_fixed(self.address + start, length, _PROT_RW, mmap.MAP_SHARED, fd, offset)
                self._lent_pages.update(range(start, start + length, PAGE))
                start += length
                runs[0] = (fd, offset + length, nbytes - length)
                if runs[0][2] == 0:
                    runs.pop(0)
        for fd, offset, nbytes in runs:
            punch(fd, offset, nbytes)

    @property
    def lent_bytes(self) -> int:
        """Bytes of granted blocks held in pages lent by the experts now."""
        return len(self._lent_pages) * PAGE

    def anonymous_reserve_bytes(self) -> int:
        """Bytes of the reserve's resident pages that are not lent expert pages: memory the KV cache took beyond
        the experts' (what granted, written blocks cost where no expert page backs them, and what giving them
        back returns)."""
        return self.resident_reserve_bytes() - self.lent_bytes

    def stats(self) -> dict:
        """Plain data for a worker RPC: process RSS, the reserve's size and resident bytes, grants, history."""
        return {"rss_bytes": rss_bytes(), "reserve_bytes": self.reserve_bytes,
                "resident_reserve_bytes": self.resident_reserve_bytes(), "lent_bytes": self.lent_bytes,
                "anonymous_reserve_bytes": self.anonymous_reserve_bytes(), "granted_blocks": len(self.granted),
                "applied_ops": len(self.applied), "history": list(self.history)}


def check_op(op: LineOp, granted: set[int], num_base_blocks: int, num_blocks: int) -> None:
    """A line op a backing can apply: inside the reserve, granting only ungranted blocks, giving back granted ones."""
    ids = set(op.block_ids)
    if any(not num_base_blocks <= b < num_blocks for b in ids):
        raise ValueError(f"line op outside the reserve [{num_base_blocks}, {num_blocks}): {op}")
    if op.grow and ids & granted:
        raise ValueError(f"blocks granted twice: {sorted(ids & granted)[:8]}")
    if not op.grow and not ids <= granted:
        raise ValueError(f"blocks given back that were not granted: {sorted(ids - granted)[:8]}")


def _subtract(span: tuple[int, int], holes: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``span`` less the (sorted, merged) ``holes``."""
    out, (start, end) = [], span
    for s, e in holes:
        if e <= start or s >= end:
            continue
        if s > start:
            out.append((start, s))
        start = max(start, e)
    if start < end:
        out.append((start, end))
    return out


def install(backing) -> None:
    """Make ``backing`` (a ``CpuBacking`` or a ``vmm_backing.VmmBacking``) this process's."""
    global _BACKING
    _BACKING = backing


def registered_backing():
    """This process's backing (None where the plugin's allocation did not run: another device, or no reserve)."""
    return _BACKING
