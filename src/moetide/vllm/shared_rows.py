"""Expert weights in shared memory on the CPU, so that their pages can be lent to the KV cache as they are.

The line gives a region of expert memory to the KV cache. On the CPU the expert pager (``vllm.pager``) keeps each
MoE layer's paged weights (``w13_weight``, ``w2_weight``, an FP8 layer's scales) in a ``SharedRows``: a ``memfd``
mapped shared, sized for the layer's experts and its staging rows (a file's pages are allocated only when first
written, so the staging rows cost nothing until used, and the weights never move when they are added). When experts go out, the pager returns
the ``PageRun``s of their home rows, and the KV backing (``vllm.backing.CpuBacking``) maps those very pages over
the granted blocks (``mmap(MAP_FIXED | MAP_SHARED)``): the KV cache grows into the experts' memory, nothing is
copied and nothing new is allocated. When the region comes back, the backing maps fresh inaccessible memory over
the blocks again, and the pager writes the experts home from their host copies into their own pages.

Staging rows are one memory for every layer (``StagingArea``): a layer's staging rows are written just before its
kernel reads them, and layers run one after another, so each layer's staging rows are mapped onto the same pages
(where rows are whole pages). What the line lends is then worth its bytes: staging costs as many rows as the most
one layer ever had out, once, not once per layer.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from dataclasses import dataclass

import torch

PAGE = mmap.PAGESIZE
_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE = 1, 2
_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_MAP_FAILED = ctypes.c_void_p(-1).value
_MAP_FIXED = 0x10


@dataclass(frozen=True)
class PageRun:
    """Whole pages of a shared file: ``nbytes`` from ``offset`` of ``fd`` (both multiples of the page size)."""

    fd: int
    offset: int
    nbytes: int


class SharedRows:
    """A tensor of ``capacity`` rows kept in a ``memfd`` (module docstring); ``view(n)`` is its first ``n`` rows."""

    def __init__(self, like: torch.Tensor, capacity: int, name: str = "moetide-experts") -> None:
        self.row_shape, self.dtype = tuple(like.shape[1:]), like.dtype
        self.row_bytes = like[0].nbytes if like.shape[0] else like.element_size() * like[0].numel()
        self.capacity = capacity
        size = max(-(-(self.row_bytes * capacity) // PAGE) * PAGE, PAGE)
        self.fd = os.memfd_create(name, os.MFD_CLOEXEC)
        os.ftruncate(self.fd, size)
        self._mmap = mmap.mmap(self.fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self._storage = torch.frombuffer(self._mmap, dtype=torch.uint8, count=size)
        self.address = self._storage.data_ptr()
        self.view(like.shape[0]).copy_(like)

    def view(self, num_rows: int) -> torch.Tensor:
        if num_rows > self.capacity:
            raise ValueError(f"{num_rows} rows asked of a SharedRows of {self.capacity}")
        return self._storage[:num_rows * self.row_bytes].view(self.dtype).view(num_rows, *self.row_shape)

    def row_pages(self, row: int) -> PageRun | None:
        """The whole pages inside ``row`` (None where the row holds no whole page)."""
        start = -(-(row * self.row_bytes) // PAGE) * PAGE
        end = (row + 1) * self.row_bytes // PAGE * PAGE
        return PageRun(self.fd, start, end - start) if end > start else None

    def file_bytes(self) -> int:
        """Bytes of the file the system holds now (its allocated pages)."""
        return os.fstat(self.fd).st_blocks * 512

    def share_rows(self, first: int, count: int, area: StagingArea) -> bool:
        """Map rows ``[first, first + count)`` onto ``area``'s pages (grown to hold them); False, changing
        nothing, where the rows are not whole pages."""
        if self.row_bytes % PAGE or not 0 <= first <= first + count <= self.capacity:
            return False
        nbytes = count * self.row_bytes
        area.grow(nbytes)
        map_fixed(self.address + first * self.row_bytes, nbytes, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED,
                  area.fd)
        return True

    def __del__(self) -> None:
        os.close(self.fd)  # a KV mapping of its pages keeps them alive on its own


class StagingArea:
    """The shared pages every layer's staging rows of one weight map onto (module docstring)."""

    def __init__(self, name: str = "moetide-staging") -> None:
        self.fd = os.memfd_create(name, os.MFD_CLOEXEC)
        self.size = 0

    def grow(self, nbytes: int) -> None:
        if nbytes > self.size:
            os.ftruncate(self.fd, nbytes)
            self.size = nbytes

    def file_bytes(self) -> int:
        return os.fstat(self.fd).st_blocks * 512


def map_fixed(address: int, length: int, prot: int, flags: int, fd: int = -1, offset: int = 0) -> None:
    """``mmap(MAP_FIXED)``: map over whatever is at ``[address, address + length)``."""
    if _libc.mmap(address, length, prot, flags | _MAP_FIXED, fd, offset) in (None, _MAP_FAILED):
        err = ctypes.get_errno()
        raise OSError(err, f"mmap(MAP_FIXED, {address:#x}, {length}): {os.strerror(err)}")


def punch(fd: int, offset: int, nbytes: int) -> None:
    """Give ``nbytes`` of a shared file from ``offset`` back to the system (they read zeros until written again)."""
    if nbytes and _libc.fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, offset, nbytes) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"fallocate(PUNCH_HOLE, {offset}, {nbytes}): {os.strerror(err)}")
