"""Host copies of expert rows and their staging back, with torch alone (the expert pager's copies; no vLLM here, so
a GPU machine without vLLM can test them).

An expert going out is copied to the host: a clone on the CPU, pinned host memory for a device row (so that
staging it back is an asynchronous copy). ``Stager.stage`` copies host rows into staging rows: on CUDA on a copy
stream of its own that first waits for the work queued before it and that the compute stream then waits for, so
the kernel that reads the staging rows runs after the copies, and the copies never overwrite rows a previous
kernel still reads.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def host_copy(row: torch.Tensor) -> torch.Tensor:
    """An expert row's host copy (module docstring)."""
    if row.device.type == "cpu":
        return row.clone()
    return torch.empty(row.shape, dtype=row.dtype, device="cpu", pin_memory=True).copy_(row)


class Stager:
    """Copies host rows into rows of ``device`` (module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def stage(self, copies: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> int:
        """Copy each (staging row, host copy); returns the bytes copied."""
        stream = self.stream
        if stream is None:
            for row, host in copies:
                row.copy_(host)
            return sum(row.nbytes for row, _ in copies)
        compute = torch.cuda.current_stream(stream.device)
        stream.wait_stream(compute)
        with torch.cuda.stream(stream):
            for row, host in copies:
                row.copy_(host, non_blocking=True)
        compute.wait_stream(stream)
        return sum(row.nbytes for row, _ in copies)
