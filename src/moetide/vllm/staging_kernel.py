"""The masked row copy of the expert pager's per-call path on CUDA (``staging.copy_rows_where``), in Triton.

One program copies one chunk of one slot's row, and only if the slot's expert is routed in this call (``need``,
computed on the device): the launch has a fixed shape, so a CUDA graph captures it once, and the rows it reads
over the bus are only the routed ones. The host rows are pinned: with unified addressing their address is valid on
the device, so the kernel reads them where they lie (no staging buffer, no host sync). Imported only when a CUDA
copy runs; Triton's interpreter (``TRITON_INTERPRET=1``) runs the same kernel on CPU tensors, which is how the
tests check its masking without a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_BYTES = 4096


@triton.jit
def _copy_rows_where(need_ptr, dst_ptr, src_ptr, row_words, BLOCK: tl.constexpr):
    slot = tl.program_id(0)
    offsets = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    limit = tl.where(tl.load(need_ptr + slot) != 0, row_words, 0)  # an unrouted slot copies nothing
    mask = offsets < limit
    words = tl.load(src_ptr + slot * row_words + offsets, mask=mask)
    tl.store(dst_ptr + slot * row_words + offsets, words, mask=mask)


class _HostPointer:
    """A pinned host tensor as Triton sees a pointer argument (its address is valid on the device)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor, self.dtype = tensor, tensor.dtype

    def data_ptr(self) -> int:
        return self.tensor.data_ptr()


def as_words(rows: torch.Tensor) -> torch.Tensor:
    """Contiguous rows viewed as 32-bit words (or bytes where a row is not whole words), one row per slot."""
    flat = rows.reshape(rows.shape[0], -1).view(torch.uint8)
    return flat.view(torch.int32) if flat.shape[1] % 4 == 0 else flat


def copy_rows_where_cuda(need: torch.Tensor, dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst[s] = src[s]`` where ``need[s]``; ``dst`` on the device, ``src`` pinned (or, under Triton's
    interpreter, both on the CPU)."""
    if not (dst.is_contiguous() and src.is_contiguous() and dst.shape == src.shape):
        raise ValueError(f"staging rows {tuple(dst.shape)} and host rows {tuple(src.shape)} must match, contiguous")
    if dst.shape[0] == 0:
        return
    dst_words, src_words = as_words(dst), as_words(src)
    row_words = dst_words.shape[1]
    block = BLOCK_BYTES // dst_words.element_size()
    pointer = src_words if src_words.device == dst_words.device else _HostPointer(src_words)
    grid = (dst_words.shape[0], triton.cdiv(row_words, block))
    _copy_rows_where[grid](need.to(torch.int8), dst_words, pointer, row_words, BLOCK=block)
