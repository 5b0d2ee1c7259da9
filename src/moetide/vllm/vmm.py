"""The line's one memory on an accelerator: physical chunks the plugin holds, moved between experts and KV cache.

The CUDA driver separates an address from the memory behind it: a range of virtual addresses is reserved once
(``cuMemAddressReserve``), physical chunks are created (``cuMemCreate``) and mapped into it and out of it
(``cuMemMap``, ``cuMemUnmap``), and a chunk unmapped from one address can be mapped at another. The plugin uses
that to move memory without copying it:

* each offloadable MoE layer's expert weights live in a reserved range, one physical chunk per granule of the
  home rows (``VmmRows``), so that the granules an offloaded expert's rows wholly cover can be taken out;
* the KV cache lives in a reserved range too, the base in a few large chunks, the reserve past it unmapped;
* a grant unmaps the offloaded experts' granules from the expert range, after their rows were copied to host
  memory, and maps those very chunks under the granted KV blocks; a give-back unmaps them from the KV range and
  maps them home before the experts are written back from their host copies.

``DeviceMemory`` is the ledger: every chunk created is counted, the chunks in neither range wait in its free list,
and once the start-up is done (``seal``) no chunk is created again. The device then never holds more than it held
at start-up, staging rows included: a move that cannot be met from the free list raises ``OverBudget`` and
changes nothing. The granules a grant needs beyond what its experts wholly cover (a block's bytes cut at a granule
edge) come from a small spare the KV backing holds from the start.

The driver is a small interface (``VmmDriver``) with two implementations: ``CudaDriver`` (``libcuda`` through
ctypes; torch alone needs no vLLM) and ``HostDriver``, which does the same calls on the CPU with shared memory
(``memfd``) and ``mmap``: an unmapped address faults, a chunk mapped at two addresses is one memory. The CPU's
tests run the whole design on ``HostDriver``; a lent GPU runs the same tests on ``CudaDriver``
(``benchmarks/gpu_checks.sh``).
"""

from __future__ import annotations

import abc
import ctypes
import mmap
import os
from collections.abc import Iterable, Sequence

import torch

from moetide.vllm.shared_rows import map_fixed
from moetide.vllm.staging import ExpertSlots

_PROT_NONE, _PROT_RW = 0, mmap.PROT_READ | mmap.PROT_WRITE


class OverBudget(RuntimeError):
    """A move would need device memory past what the plugin held at start-up."""


class VmmDriver(abc.ABC):
    """The driver's virtual-memory calls, at ``granule`` (the mapping granularity: sizes and addresses are
    multiples of it)."""

    granule: int

    @abc.abstractmethod
    def reserve(self, size: int) -> int:
        """A range of ``size`` bytes of addresses, granule-aligned, nothing behind it."""

    @abc.abstractmethod
    def free(self, address: int, size: int) -> None:
        """Give a reserved range back (nothing may be mapped in it)."""

    @abc.abstractmethod
    def create(self, size: int) -> int:
        """A physical chunk of ``size`` bytes; returns its handle."""

    @abc.abstractmethod
    def release(self, handle: int) -> None:
        """Destroy a chunk that is mapped nowhere."""

    @abc.abstractmethod
    def map(self, address: int, size: int, handle: int) -> None:
        """Put chunk ``handle`` (of ``size`` bytes) behind ``[address, address + size)``, not yet accessible."""

    @abc.abstractmethod
    def unmap(self, address: int, size: int) -> None:
        """Take the chunk mapped at exactly ``[address, address + size)`` away (one ``map``'s range, never part of
        one or several: CUDA's ``cuMemUnmap`` takes the whole range one mapping made); the addresses fault again."""

    @abc.abstractmethod
    def set_access(self, address: int, size: int) -> None:
        """Make a mapped range readable and writable by the device (one call for the whole range)."""

    @abc.abstractmethod
    def view(self, address: int, size: int) -> torch.Tensor:
        """A ``uint8`` tensor over ``[address, address + size)`` on the device, not owning it."""

    def synchronize(self) -> None:
        """Wait for the device's queued work (before memory under it is unmapped)."""


class HostDriver(VmmDriver):
    """``VmmDriver`` on the CPU: a chunk is a ``memfd``, a reserved range an inaccessible anonymous mapping, a map an
    ``mmap(MAP_FIXED | MAP_SHARED)`` of the chunk's file. Checks what the CUDA driver checks (alignment, mapping
    over a mapping, releasing a mapped chunk)."""

    def __init__(self, granule: int = 2 << 20) -> None:
        if granule % mmap.PAGESIZE:
            raise ValueError(f"granule {granule} is not a multiple of the page size {mmap.PAGESIZE}")
        self.granule = granule
        self._reserved: dict[int, tuple[int, int]] = {}  # aligned address -> (mapping's start, size)
        self._chunks: dict[int, tuple[int, int]] = {}  # handle -> (fd, size)
        self._mapped: dict[int, tuple[int, int]] = {}  # address -> (size, handle)
        self._next = 1

    def _check(self, address: int, size: int) -> None:
        if address % self.granule or size % self.granule or size <= 0:
            raise ValueError(f"range {address:#x}+{size} is not granule-aligned ({self.granule})")
        if not any(a <= address and address + size <= a + s for a, (_, s) in self._reserved.items()):
            raise ValueError(f"range {address:#x}+{size} is outside every reserved range")

    def reserve(self, size: int) -> int:
        size = -(-size // self.granule) * self.granule
        start = _libc.mmap(None, size + self.granule, _PROT_NONE, _MAP_RESERVE, -1, 0)
        if start in (None, _MAP_FAILED):
            raise OSError(ctypes.get_errno(), f"mmap of {size} reserved bytes")
        address = -(-start // self.granule) * self.granule
        self._reserved[address] = (start, size)
        return address

    def free(self, address: int, size: int) -> None:
        if any(address <= a < address + size for a in self._mapped):
            raise ValueError(f"range {address:#x} freed with chunks still mapped in it")
        start, reserved = self._reserved.pop(address)
        _libc.munmap(start, reserved + self.granule)

    def create(self, size: int) -> int:
        if size % self.granule or size <= 0:
            raise ValueError(f"chunk of {size} bytes is not a multiple of the granule {self.granule}")
        fd = os.memfd_create("moetide-vmm", os.MFD_CLOEXEC)
        os.ftruncate(fd, size)
        handle, self._next = self._next, self._next + 1
        self._chunks[handle] = (fd, size)
        return handle

    def release(self, handle: int) -> None:
        if any(h == handle for _, h in self._mapped.values()):
            raise ValueError(f"chunk {handle} released while mapped")
        fd, _ = self._chunks.pop(handle)
        os.close(fd)

    def map(self, address: int, size: int, handle: int) -> None:
        self._check(address, size)
        fd, chunk_size = self._chunks[handle]
        if chunk_size != size:
            raise ValueError(f"chunk {handle} of {chunk_size} bytes mapped over {size}")
        if any(a < address + size and address < a + s for a, (s, _) in self._mapped.items()):
            raise ValueError(f"range {address:#x}+{size} is already mapped")
        map_fixed(address, size, _PROT_NONE, mmap.MAP_SHARED, fd)
        self._mapped[address] = (size, handle)

    def unmap(self, address: int, size: int) -> None:
        self._check(address, size)
        if self._mapped.get(address, (None,))[0] != size:
            raise ValueError(f"range {address:#x}+{size} is not the range of one mapping")
        map_fixed(address, size, _PROT_NONE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        del self._mapped[address]

    def set_access(self, address: int, size: int) -> None:
        self._check(address, size)
        if _libc.mprotect(address, size, _PROT_RW) != 0:
            raise OSError(ctypes.get_errno(), f"mprotect({address:#x}, {size})")

    def view(self, address: int, size: int) -> torch.Tensor:
        return torch.frombuffer((ctypes.c_char * size).from_address(address), dtype=torch.uint8)

    @property
    def chunk_bytes(self) -> int:
        """Bytes of the chunks that exist now: the device memory the driver gave out, counted by the driver."""
        return sum(size for _, size in self._chunks.values())


class DeviceMemory:
    """Every physical chunk the plugin holds on one device (module docstring): the ledger, the free list of
    granule chunks no range holds now, and, after ``seal``, the budget no move may pass."""

    def __init__(self, driver: VmmDriver) -> None:
        self.driver = driver
        self.granule = driver.granule
        self.held_bytes = 0  # chunks created and not released
        self.peak_bytes = 0
        self.budget_bytes: int | None = None  # held at the end of start-up (``seal``)
        self._free: list[int] = []  # granule chunks mapped nowhere

    def create(self, size: int) -> int:
        """A new chunk, counted; ``OverBudget`` once sealed, if it would pass the budget."""
        if self.budget_bytes is not None and self.held_bytes + size > self.budget_bytes:
            raise OverBudget(f"{size} bytes more would pass the start-up budget of {self.budget_bytes} bytes "
                             f"({self.held_bytes} held)")
        handle = self.driver.create(size)
        self.held_bytes += size
        self.peak_bytes = max(self.peak_bytes, self.held_bytes)
        return handle

    def release(self, handle: int, size: int) -> None:
        self.driver.release(handle)
        self.held_bytes -= size

    def seal(self) -> None:
        """Start-up is done: from now on what is held is the budget."""
        self.budget_bytes = self.held_bytes

    def put(self, handle: int) -> None:
        """A granule chunk that no range holds any more, for the next move to take."""
        self._free.append(handle)

    def take(self) -> int:
        """A granule chunk: a free one, or (before ``seal``, or within the budget) a new one."""
        return self._free.pop() if self._free else self.create(self.granule)

    @property
    def free_chunks(self) -> int:
        return len(self._free)

    def map_run(self, address: int, handles: list[int]) -> None:
        """Map granule chunks ``handles`` at consecutive granules from ``address``, then make the run accessible
        in one call; on failure, unmaps what this call mapped (the handles stay the caller's)."""
        g, done = self.granule, 0
        try:
            for handle in handles:
                self.driver.map(address + done * g, g, handle)
                done += 1
            self.driver.set_access(address, len(handles) * g)
        except BaseException:
            for i in range(done):
                self.driver.unmap(address + i * g, g)
            raise

    def map_granules(self, address: int, offsets: list[int], *, zero: bool = False) -> list[int]:
        """Map a granule chunk (``take``) at each of the sorted granule ``offsets`` from ``address``, in runs (one
        access call per run), zeroed if asked; returns the chunks in ``offsets``' order. On a failure (``OverBudget``
        or the driver's), what this call mapped is unmapped and its chunks go back to the free list."""
        g, index = self.granule, {offset: i for i, offset in enumerate(offsets)}
        handles: list[int] = []
        mapped: list[tuple[int, int]] = []
        try:
            for _ in offsets:
                handles.append(self.take())
            for offset, count in runs(offsets, g):
                first = index[offset]
                self.map_run(address + offset, handles[first:first + count])
                mapped.append((offset, count))
                if zero:
                    self.driver.view(address + offset, count * g).zero_()
        except BaseException:
            self.unmap_granules(address, [o for offset, count in mapped for o in range(offset, offset + count * g, g)])
            for handle in handles:
                self.put(handle)
            raise
        return handles

    def unmap_granules(self, address: int, offsets: list[int]) -> None:
        """Unmap the granule chunks at ``offsets`` from ``address``, one call each (each was its own mapping)."""
        for offset in offsets:
            self.driver.unmap(address + offset, self.granule)

    def stats(self) -> dict[str, int | None]:
        return {"device_held_bytes": self.held_bytes, "device_peak_bytes": self.peak_bytes,
                "device_budget_bytes": self.budget_bytes, "device_free_chunks": len(self._free)}


class SharedStaging:
    """The staging rows' chunk that every layer of one shape maps (as ``vllm.shared_rows.StagingArea`` on the CPU's
    own path): a layer's staging rows are written just before its kernel reads them, and layers run one after
    another, so one memory serves them all. Created on first use, before ``seal``."""

    def __init__(self, memory: DeviceMemory) -> None:
        self.memory = memory
        self.chunks: dict[tuple, tuple[int, int]] = {}  # layer shape -> (handle, size)

    def chunk(self, key: tuple, size: int) -> int:
        if key not in self.chunks:
            self.chunks[key] = (self.memory.create(size), size)
        return self.chunks[key][0]

    @property
    def nbytes(self) -> int:
        return sum(size for _, size in self.chunks.values())


class VmmRows:
    """One weight of one MoE layer in a reserved range (module docstring): ``num_experts`` home rows, one chunk per
    granule so that offloaded experts' granules can leave, then ``num_slots`` staging rows, whose whole granules map
    the ``SharedStaging`` chunk of layers of this shape. ``tensor`` is the weight, ``(rows, *row_shape)``."""

    def __init__(self, memory: DeviceMemory, like: torch.Tensor, num_experts: int, num_slots: int,
                 staging: SharedStaging) -> None:
        g, driver = memory.granule, memory.driver
        self.memory, self.num_experts = memory, num_experts
        self.row_bytes = like[0].nbytes
        self.home_end = -(-num_experts * self.row_bytes // g) * g  # the granules that hold home rows
        self.size = max(-(-(num_experts + num_slots) * self.row_bytes // g) * g, g)
        self.address = driver.reserve(self.size)
        self.home: dict[int, int] = {}  # granule offset -> its chunk, for the home granules mapped now
        self.lent: set[int] = set()  # home granules whose chunks are out (in the KV range or the free list)
        home = list(range(0, self.home_end, g))
        self.home = dict(zip(home, memory.map_granules(self.address, home)))
        if self.size > self.home_end:
            key = (like.dtype, tuple(like.shape[1:]), num_experts, num_slots)
            chunk = staging.chunk(key, self.size - self.home_end)
            driver.map(self.address + self.home_end, self.size - self.home_end, chunk)
            driver.set_access(self.address + self.home_end, self.size - self.home_end)
        rows = num_experts + num_slots
        self.tensor = driver.view(self.address, rows * self.row_bytes).view(like.dtype).view(rows, *like.shape[1:])
        self.tensor[:like.shape[0]].copy_(like)
        self.tensor[like.shape[0]:].zero_()

    def covered(self, experts: Iterable[int]) -> set[int]:
        """Home granules wholly inside the rows of ``experts``."""
        g, r, out = self.memory.granule, self.row_bytes, set()
        for start, end in _merge_rows(experts, r):
            out.update(range(-(-start // g) * g, end // g * g, g))
        return out

    def lend(self, offloaded: Iterable[int]) -> int:
        """Take out the granules the ``offloaded`` experts' rows now wholly cover (their rows must be in host copies
        already) and put their chunks in the free list; returns how many."""
        going = sorted(self.covered(offloaded) - self.lent)
        if going:
            self.memory.driver.synchronize()
        self.memory.unmap_granules(self.address, going)
        for offset in going:
            self.memory.put(self.home.pop(offset))
        self.lent.update(going)
        return len(going)

    def restore(self, offloaded: Iterable[int]) -> int:
        """Map chunks from the free list under the lent granules the ``offloaded`` experts no longer wholly cover
        (the experts coming home are then written from their host copies); returns how many. ``OverBudget``,
        changing nothing, where the free list is short."""
        coming = sorted(self.lent - self.covered(offloaded))
        handles = self.memory.map_granules(self.address, coming)
        self.home.update(zip(coming, handles))
        self.lent.difference_update(coming)
        return len(coming)


def move_experts(slots: ExpertSlots, rows: Sequence[VmmRows], offloaded: set[int]) -> None:
    """Make ``offloaded`` the layer's offloaded experts, in the order that keeps every byte with one owner: the
    home granules no longer wholly out are mapped back, the experts coming home are written from their host copies,
    the experts going out are copied to host memory, and only then are the granules they wholly cover taken out
    (into the free list, for the KV backing's grant to take)."""
    for weight in rows:
        weight.restore(offloaded)
    for expert in sorted(set(slots.out) - offloaded):
        slots.bring_home(expert)
    for expert in sorted(offloaded - set(slots.out)):
        slots.take_out(expert)
    for weight in rows:
        weight.lend(offloaded)


def runs(offsets: Iterable[int], granule: int) -> list[tuple[int, int]]:
    """Sorted granule offsets as runs of consecutive granules: ``(first offset, count)``."""
    out: list[tuple[int, int]] = []
    for offset in sorted(offsets):
        if out and out[-1][0] + out[-1][1] * granule == offset:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((offset, 1))
    return out


def _merge_rows(rows: Iterable[int], row_bytes: int) -> list[tuple[int, int]]:
    """The byte intervals of ``rows`` (each ``row_bytes`` long), adjacent rows merged."""
    out: list[tuple[int, int]] = []
    for row in sorted(rows):
        start = row * row_bytes
        if out and out[-1][1] == start:
            out[-1] = (out[-1][0], start + row_bytes)
        else:
            out.append((start, start + row_bytes))
    return out


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value
_MAP_NORESERVE = 0x4000  # Linux's value (Python 3.11's mmap module does not name it)
_MAP_RESERVE = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE
