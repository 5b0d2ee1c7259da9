"""Which memory the line moves in this process: the CPU's own pages (``vllm.backing``, ``vllm.shared_rows``), or
chunks of the driver's virtual memory (``vllm.vmm``): CUDA's on a GPU, or, where the settings ask for it
(``cpu_vmm_granule``), the same design on the CPU through ``vmm.HostDriver``, so that the CUDA path's logic runs
inside vLLM without a GPU. One decision, asked by the engine core's sizing (the granule an expert is valued in and
the backing's spare) and by each worker (the pager's rows and the KV backing)."""

from __future__ import annotations

import math

CUDA_GRANULE = 2 << 20  # the mapping granularity the engine core sizes the line with on CUDA (checked at start)
_MEMORY: dict[str, tuple] = {}  # device -> (DeviceMemory, SharedStaging) of this process


def line_granule(settings, device_type: str) -> int | None:
    """The granule the line's memory moves in on ``device_type`` (vLLM's platform), or None where it moves pages
    (the CPU's default)."""
    if device_type == "cuda":
        return CUDA_GRANULE
    if device_type == "cpu" and settings.cpu_vmm_granule:
        return settings.cpu_vmm_granule
    return None


def device_memory(settings, device):
    """This process's ledger of ``device`` (a torch device) and its layers' shared staging chunk, created on first
    use; None where the line moves pages. ``RuntimeError`` in one line where a GPU maps memory in other granules than
    the engine core sized the line with."""
    granule = line_granule(settings, device.type)
    if granule is None:
        return None
    key = str(device)
    if key not in _MEMORY:
        from moetide.vllm.vmm import DeviceMemory, HostDriver, SharedStaging

        if device.type == "cuda":
            from moetide.vllm.cuda_driver import CudaDriver

            driver = CudaDriver(device.index or 0)
        else:
            driver = HostDriver(granule)
        if driver.granule != granule:
            raise RuntimeError(f"moetide: {device} maps memory in {driver.granule}-byte granules; the line is sized "
                               f"for {granule}: this device is not supported yet")
        memory = DeviceMemory(driver)
        _MEMORY[key] = (memory, SharedStaging(memory))
    return _MEMORY[key]


def lendable_bytes(row_bytes: int, granule: int) -> int:
    """The fewest bytes of whole granules inside one row of ``row_bytes``, wherever in a run of equal rows it lies:
    what offloading one expert surely frees of that weight."""
    return max(row_bytes - granule + math.gcd(row_bytes, granule), 0) // granule * granule
