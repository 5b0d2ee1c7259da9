"""The KV backing on CUDA: the driver's virtual memory, so the reserve's device memory exists only while granted.

``CpuBacking``'s interface (``vllm.backing``) over the CUDA driver's virtual-memory calls, as vLLM PR 56492
("Extensible KV cache") uses them: one virtual address range for the whole line (``cuMemAddressReserve``), and
physical chunks of the mapping granularity (2 MiB on current GPUs) created and mapped only where a base block or
a granted block lies (``cuMemCreate``, ``cuMemMap``, ``cuMemSetAccess``). Giving a region back unmaps and releases
the chunks only its blocks used (``cuMemUnmap``, ``cuMemRelease``), so the memory returns to the device. A kernel
that touches an unmapped chunk faults (an illegal address), as the CPU backing's SIGSEGV does. Chunks are zeroed
when mapped, as ``torch.zeros`` gives vLLM.

The buffer reaches torch through ``__cuda_array_interface__``, so nothing here needs vLLM: the tests run on a
device machine that has torch alone (``tests/test_vllm_cuda_backing.py``, marked ``gpu``). The expert side of the
line (mapping an expert's chunk into the KV range) comes with the expert pager.
"""

from __future__ import annotations

import ctypes

import torch

from moetide.vllm.backing import BlockSpans, check_op
from moetide.vllm.line import LineOp

_CU_MEM_ALLOCATION_TYPE_PINNED = 1
_CU_MEM_LOCATION_TYPE_DEVICE = 1
_CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3
_CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _AllocationProp(ctypes.Structure):  # CUmemAllocationProp
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", _Location),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", _AllocFlags)]


class _AccessDesc(ctypes.Structure):  # CUmemAccessDesc
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


class Driver:
    """The few CUDA driver calls the backing makes, each checked (a failure names the call and the CUresult)."""

    def __init__(self) -> None:
        try:
            self.lib = ctypes.CDLL("libcuda.so.1")
        except OSError as exc:
            raise RuntimeError(f"the CUDA driver (libcuda.so.1) cannot be loaded: {exc}") from None

    def __call__(self, name: str, *args) -> None:
        result = getattr(self.lib, name)(*args)
        if result != 0:
            message = ctypes.c_char_p()
            self.lib.cuGetErrorString(result, ctypes.byref(message))
            raise RuntimeError(f"{name} failed: CUresult {result} ({(message.value or b'').decode()})")


class _DeviceArray:
    """What ``torch.as_tensor`` needs to view device memory it did not allocate."""

    def __init__(self, address: int, size: int) -> None:
        self.__cuda_array_interface__ = {"shape": (size,), "typestr": "|i1", "data": (address, False),
                                         "version": 3, "strides": None}


class CudaVmmBacking:
    """The KV buffer of one worker on one CUDA device, the reserve's chunks mapped only while granted."""

    def __init__(self, size: int, tensors, *, num_base_blocks: int, num_blocks: int, device: int = 0) -> None:
        torch.cuda.init()
        torch.empty(1, device=f"cuda:{device}")  # the primary context torch uses is current from here on
        self.cu, self.device = Driver(), device
        self.prop = _AllocationProp(type=_CU_MEM_ALLOCATION_TYPE_PINNED,
                                    location=_Location(_CU_MEM_LOCATION_TYPE_DEVICE, device))
        granularity = ctypes.c_size_t()
        self.cu("cuMemGetAllocationGranularity", ctypes.byref(granularity), ctypes.byref(self.prop),
                _CU_MEM_ALLOC_GRANULARITY_MINIMUM)
        self.granule = granularity.value
        self.reserved = -(-max(size, 1) // self.granule) * self.granule
        address = ctypes.c_uint64()
        self.cu("cuMemAddressReserve", ctypes.byref(address), ctypes.c_size_t(self.reserved), ctypes.c_size_t(0),
                ctypes.c_uint64(0), ctypes.c_uint64(0))
        self.address = address.value
        self.spans = BlockSpans(tensors, self.granule, self.reserved, num_blocks)
        self.num_base_blocks, self.num_blocks = num_base_blocks, num_blocks
        self.handles: dict[int, int] = {}  # chunk offset -> physical allocation handle
        self.granted: set[int] = set()
        self.applied: list[LineOp] = []
        for start, end in self.spans.units(range(num_base_blocks), inward=False):
            self._map(start, end)
        self.buffer = torch.as_tensor(_DeviceArray(self.address, size), device=f"cuda:{device}")

    def _map(self, start: int, end: int) -> None:
        access = _AccessDesc(location=_Location(_CU_MEM_LOCATION_TYPE_DEVICE, self.device),
                             flags=_CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
        for offset in range(start, end, self.granule):
            if offset in self.handles:
                continue
            handle = ctypes.c_uint64()
            self.cu("cuMemCreate", ctypes.byref(handle), ctypes.c_size_t(self.granule), ctypes.byref(self.prop),
                    ctypes.c_uint64(0))
            self.cu("cuMemMap", ctypes.c_uint64(self.address + offset), ctypes.c_size_t(self.granule),
                    ctypes.c_size_t(0), handle, ctypes.c_uint64(0))
            self.cu("cuMemSetAccess", ctypes.c_uint64(self.address + offset), ctypes.c_size_t(self.granule),
                    ctypes.byref(access), ctypes.c_size_t(1))
            self.cu("cuMemsetD8_v2", ctypes.c_uint64(self.address + offset), ctypes.c_ubyte(0),
                    ctypes.c_size_t(self.granule))
            self.handles[offset] = handle.value

    def _unmap(self, start: int, end: int) -> None:
        for offset in range(start, end, self.granule):
            handle = self.handles.pop(offset, None)
            if handle is None:
                continue
            self.cu("cuMemUnmap", ctypes.c_uint64(self.address + offset), ctypes.c_size_t(self.granule))
            self.cu("cuMemRelease", ctypes.c_uint64(handle))

    @property
    def mapped_bytes(self) -> int:
        """Device memory the backing holds now: the base's chunks and the granted ones."""
        return len(self.handles) * self.granule

    def apply(self, op: LineOp, lent=()) -> None:
        """Grant (map) or give back (unmap and release) the op's blocks; the device must be idle for a give-back
        (the runner applies ops as a step starts, after the previous step's kernels were waited for)."""
        check_op(op, self.granted, self.num_base_blocks, self.num_blocks)
        ids = set(op.block_ids)
        if op.grow:
            self.granted |= ids
            for start, end in self.spans.units(ids, inward=False):
                self._map(start, end)
        else:
            self.granted -= ids
            torch.cuda.synchronize(self.device)
            for start, end in self.spans.released(ids, lambda b: b < self.num_base_blocks or b in self.granted):
                self._unmap(start, end)
        self.applied.append(op)

    def close(self) -> None:
        """Unmap everything and free the address range (the buffer must not be used after)."""
        torch.cuda.synchronize(self.device)
        for offset in list(self.handles):
            self._unmap(offset, offset + self.granule)
        self.cu("cuMemAddressFree", ctypes.c_uint64(self.address), ctypes.c_size_t(self.reserved))
