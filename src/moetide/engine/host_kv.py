"""Host-resident KV blocks: the host half of WriteScope's write-time placement (``core.splits``).

What it is: one host tensor of ``num_blocks × kv_block_bytes`` (pinned on CUDA, so the accelerator reads it by DMA)
whose every block has exactly the arena's per-block layout (``engine.storage``)::

    [full-attention layer a][k | v][slot 0..block_size-1][kv head][head dim]   (model dtype)

One layout that both consumers read: the CPU attends a host block where it lies (``kv_rows`` gathers its slots
for the CPU kernel), and the accelerator receives the same bytes unchanged when the block is streamed (through
``StagingRing``). Which of the
two happens is a per-step choice of the split policy; nothing is ever copied to change a block's residency.

Block ids. Host blocks are numbered after every id the arena can ever hand out
(``first_block_id = arena.config.num_block_ids``), so an id alone says where a block lives, for good: below
``first_block_id`` it is in the arena, at or above it on the host. The engine's one ``BlockPool`` holds both kinds,
the host ones as its ``HostTier(first_block_id, num_blocks)``, so device blocks are always allocated first and host
blocks only once no uncached device block is free (``core.blocks``: two tiers; a cached device prefix is not evicted
for new KV).
``ArenaPoolView`` shows the arena only its own ids.

The pool is shared by every request and by the prefix cache, so a sequence that spilled may get a device block
again when one frees up (``core.splits``, "Placement"). The split backend does not rely on contiguity: a sequence's host blocks are taken in table order, the first
``num_cpu_blocks`` of them attended in place and the rest streamed, wherever the device blocks sit between them.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

from moetide.engine.storage import KVLayout, dtype_bytes, host_zeros, layer_kv_rows, layer_kv_views


class HostKVStorage:
    """Host KV blocks ``[first_block_id, first_block_id + num_blocks)`` in the arena's per-block layout."""

    def __init__(self, layout: KVLayout, num_blocks: int, first_block_id: int, *, pin: bool) -> None:
        if num_blocks < 0 or first_block_id < 0:
            raise ValueError(f"HostKVStorage: num_blocks ({num_blocks}) and first_block_id ({first_block_id}) "
                             f"must be >= 0")
        self.layout, self.num_blocks, self.first_block_id = layout, num_blocks, first_block_id
        self.block_bytes = layout.block_bytes
        nbytes = num_blocks * self.block_bytes  # pinned for a CUDA device's copies; else huge pages where offered
        self.data = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=True) if pin else host_zeros(nbytes)
        self.block_bytes_view = self.data.view(num_blocks, self.block_bytes)  # [num_blocks, kv_block_bytes]
        elt = dtype_bytes(layout.dtype)
        width = layout.num_kv_heads * layout.head_dim  # elements of one token slot of one K (or V): one row
        self._block_rows = self.block_bytes // elt // width  # rows of ``kv_rows`` per block
        typed = self.data.view(layout.dtype)
        self._views = layer_kv_views(typed, layout, (num_blocks,), (self.block_bytes // elt,))
        self._rows = layer_kv_rows(typed, layout, width)

    # ---- ids ----------------------------------------------------------------------------------------------
    @property
    def block_ids(self) -> range:
        return range(self.first_block_id, self.first_block_id + self.num_blocks)

    def is_host(self, block_id: int) -> bool:
        return block_id >= self.first_block_id

    def index_of(self, block_ids: Iterable[int]) -> list[int]:
        """Position of each host block in the host tensor (the first index of ``kv_views``)."""
        first = self.first_block_id
        return [b - first for b in block_ids]

    # ---- reading and writing ------------------------------------------------------------------------------
    def kv_views(self, attn_index: int) -> tuple[Tensor, Tensor]:
        """(K, V) of full-attention layer ``attn_index``: [num_blocks, block_size, Hkv, D] each."""
        return self._views[attn_index]

    def kv_rows(self, attn_index: int) -> tuple[Tensor, Tensor]:
        """(K, V) read views [rows, Hkv, D] of layer ``attn_index``: slot o of host block b is row
        ``key_rows([b])[0] + o`` (``row_step`` is 1: a token slot is exactly one row here)."""
        return self._rows[attn_index]

    def key_rows(self, block_ids: Iterable[int]) -> list[int]:
        """The ``kv_rows`` row of each host block's slot 0."""
        first, per_block = self.first_block_id, self._block_rows
        return [(b - first) * per_block for b in block_ids]

    row_step = 1

    @property
    def nbytes(self) -> int:
        return self.data.numel()


class StagingRing:
    """The device staging ring that receives streamed host KV: ``num_slots`` (K, V) buffers used round robin,
    each grown to the largest group staged so far (a group's streamed part is staged whole, not cut into
    fixed-size extents that pipeline with attention: docs/writescope.md, "Not measured, not done").

    CUDA: the host rows are gathered into the slot's pinned buffer, then copied by one async DMA on the compute
    stream (so kernels that read the slot's previous contents finish first); the pinned buffer is not rewritten
    before its previous copy is done (an event). CPU: the gather writes the slot."""

    def __init__(self, device: torch.device, num_slots: int = 2) -> None:
        self.device, self.num_slots = device, num_slots
        self._slots: list[dict[str, object]] = [{} for _ in range(num_slots)]
        self._next = 0

    def stage(self, k_rows: Tensor, v_rows: Tensor, index: Tensor) -> tuple[Tensor, Tensor]:
        """(K, V) rows ``index`` of the host row views, on the device: [n, Hkv, D] each; where the value rows are the
        key rows (``KVLayout.values_in_keys``) the keys alone are copied and returned twice."""
        slot = self._slots[self._next]
        self._next = (self._next + 1) % self.num_slots
        n = index.numel()
        shape = (n, *k_rows.shape[1:])
        sources = (k_rows,) if v_rows is k_rows else (k_rows, v_rows)
        device_kv = self._buffer(slot, "device", shape, k_rows.dtype, self.device, pin=False)
        if self.device.type == "cpu":
            for src, dev in zip(sources, device_kv):
                torch.index_select(src, 0, index, out=dev[:n])
        else:
            event = slot.get("event")
            if event is not None:
                event.synchronize()  # the previous copy out of this pinned buffer is done
            host_kv = self._buffer(slot, "host", shape, k_rows.dtype, torch.device("cpu"), pin=True)
            for src, host, dev in zip(sources, host_kv, device_kv):
                torch.index_select(src, 0, index, out=host[:n])
                dev[:n].copy_(host[:n], non_blocking=True)
            slot["event"] = torch.cuda.Event()
            slot["event"].record()
        return device_kv[0][:n], device_kv[len(sources) - 1][:n]

    @staticmethod
    def _buffer(slot: dict, key: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                pin: bool) -> tuple[Tensor, Tensor]:
        buf = slot.get(key)
        if buf is None or buf[0].shape[0] < shape[0] or buf[0].dtype != dtype:
            rows = max(shape[0], 2 * buf[0].shape[0] if buf is not None else 0)
            buf = slot[key] = tuple(torch.empty((rows, *shape[1:]), dtype=dtype, device=device, pin_memory=pin)
                                    for _ in range(2))
        return buf


class ArenaPoolView:
    """The arena's view of a pool that also holds host blocks: ``block_ids`` lists only the arena's own ids (the
    pool's device blocks); growth and shrink pass straight through (they only ever name arena ids)."""

    def __init__(self, pool) -> None:
        self.pool = pool

    def add_blocks(self, block_ids: Iterable[int]) -> None:
        self.pool.add_blocks(block_ids)

    def remove_blocks(self, block_ids: Iterable[int]) -> bool:
        return self.pool.remove_blocks(block_ids)

    def block_ids(self) -> list[int]:
        is_host = self.pool.is_host
        return [b for b in self.pool.block_ids() if not is_host(b)]
