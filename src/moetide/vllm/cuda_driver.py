"""``vllm.vmm.VmmDriver`` on CUDA: the driver's virtual-memory calls through ctypes, with torch alone (no vLLM), as
vLLM PR 56492 ("Extensible KV cache") and kvcached use them: ``cuMemAddressReserve``, ``cuMemCreate``,
``cuMemMap``, ``cuMemSetAccess``, ``cuMemUnmap``, ``cuMemRelease``. A kernel touching an unmapped address faults
(an illegal address), as ``HostDriver``'s SIGSEGV does. Tensors reach the memory through
``__cuda_array_interface__``. Runs only where a GPU is lent (``benchmarks/gpu_checks.sh``).
"""

from __future__ import annotations

import ctypes

import torch

from moetide.vllm.vmm import VmmDriver

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


class _Lib:
    """``libcuda``'s calls, each checked (a failure names the call and the CUresult)."""

    def __init__(self) -> None:
        try:
            self.lib = ctypes.CDLL("libcuda.so.1")
        except OSError as exc:
            raise RuntimeError(f"the CUDA driver (libcuda.so.1) cannot be loaded: {exc}") from None

    def __call__(self, name: str, *args) -> None:
        result = self.lib[name](*args)
        if result != 0:
            message = ctypes.c_char_p()
            self.lib.cuGetErrorString(result, ctypes.byref(message))
            raise RuntimeError(f"{name} failed: CUresult {result} ({(message.value or b'').decode()})")


class _DeviceArray:
    """What ``torch.as_tensor`` needs to view device memory it did not allocate."""

    def __init__(self, address: int, size: int) -> None:
        self.__cuda_array_interface__ = {"shape": (size,), "typestr": "|u1", "data": (address, False),
                                         "version": 3, "strides": None}


class CudaDriver(VmmDriver):
    """The calls on device ``device`` (torch's primary context made current first)."""

    def __init__(self, device: int = 0) -> None:
        torch.cuda.init()
        torch.empty(1, device=f"cuda:{device}")  # the primary context torch uses is current from here on
        self.cu, self.device = _Lib(), device
        self.prop = _AllocationProp(type=_CU_MEM_ALLOCATION_TYPE_PINNED,
                                    location=_Location(_CU_MEM_LOCATION_TYPE_DEVICE, device))
        self.access = _AccessDesc(location=_Location(_CU_MEM_LOCATION_TYPE_DEVICE, device),
                                  flags=_CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
        granularity = ctypes.c_size_t()
        self.cu("cuMemGetAllocationGranularity", ctypes.byref(granularity), ctypes.byref(self.prop),
                _CU_MEM_ALLOC_GRANULARITY_MINIMUM)
        self.granule = granularity.value

    def reserve(self, size: int) -> int:
        address = ctypes.c_uint64()
        self.cu("cuMemAddressReserve", ctypes.byref(address), ctypes.c_size_t(size), ctypes.c_size_t(self.granule),
                ctypes.c_uint64(0), ctypes.c_uint64(0))
        return address.value

    def free(self, address: int, size: int) -> None:
        self.cu("cuMemAddressFree", ctypes.c_uint64(address), ctypes.c_size_t(size))

    def create(self, size: int) -> int:
        handle = ctypes.c_uint64()
        self.cu("cuMemCreate", ctypes.byref(handle), ctypes.c_size_t(size), ctypes.byref(self.prop),
                ctypes.c_uint64(0))
        return handle.value

    def release(self, handle: int) -> None:
        self.cu("cuMemRelease", ctypes.c_uint64(handle))

    def map(self, address: int, size: int, handle: int) -> None:
        self.cu("cuMemMap", ctypes.c_uint64(address), ctypes.c_size_t(size), ctypes.c_size_t(0),
                ctypes.c_uint64(handle), ctypes.c_uint64(0))

    def unmap(self, address: int, size: int) -> None:
        self.cu("cuMemUnmap", ctypes.c_uint64(address), ctypes.c_size_t(size))

    def set_access(self, address: int, size: int) -> None:
        self.cu("cuMemSetAccess", ctypes.c_uint64(address), ctypes.c_size_t(size), ctypes.byref(self.access),
                ctypes.c_size_t(1))

    def view(self, address: int, size: int) -> torch.Tensor:
        return torch.as_tensor(_DeviceArray(address, size), device=f"cuda:{self.device}")

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

