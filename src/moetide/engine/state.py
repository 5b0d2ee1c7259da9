"""Linear-attention (Gated DeltaNet) state in KV-pool blocks: the engine's ``LinearStateStore`` for hybrid models.

Where the bytes live: like vLLM's hybrid allocator, a hybrid model's fixed-size per-sequence state is carved from
the same pool as KV — ``KVCacheManager(num_state_blocks_per_request=n)`` gives each running request ``n`` private
blocks with its first allocation and frees them with the request. The state of one sequence, all linear layers, is
laid out as one byte string (``StateLayout``: per layer ``conv`` [C, kernel-1] in the model dtype then
``recurrent`` [Hv, Dk, Dv] in fp32, each 64-byte aligned) cut into ``kv_block_bytes`` pieces, piece i in the
request's state block i. A request's state blocks need not be adjacent in the arena, so a layer's state cannot be
one tensor view; instead each step *gathers* the scheduled sequences' state blocks into a contiguous scratch
(``native.copy_blocks``, one memcpy per block into a scratch kept across steps; without the native library an
indexed torch copy), the model updates views of the scratch in place, and ``commit`` scatters the scratch back. Two
copies of the state per step — the recurrent update itself reads and writes it several times — for exact memory
accounting by the pool and no second allocator.

Correctness across preemption: a linear state cannot be rebuilt from a cached attention prefix (it summarises
every earlier token), so for hybrid models the engine disables prefix caching and a preempted request recomputes
from token 0 (vLLM does the same for Mamba-style layers without state checkpoints). The scheduler then always
reports ``num_computed_tokens == 0`` for a (re)started request, and the model ignores the contents of a state
whose sequence has no computed tokens, so recycled blocks need no clearing.

With host KV (``engine.host_kv``) a state block may be a host block (the pool hands out device blocks first, but
a request admitted once the device part is full gets host blocks). Such a block is gathered from the host tensor
into the same scratch (CUDA: one copy to the device) and scattered back there at ``commit``; the layout is the
same, so nothing else changes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from moetide.engine import native
from moetide.engine.host_kv import HostKVStorage
from moetide.engine.models import LinearState, LinearStateShape, StepBatch
from moetide.engine.storage import ArenaStorage, dtype_bytes
from moetide.units import cdiv

ALIGN_BYTES = 64


def _align(n: int) -> int:
    return cdiv(n, ALIGN_BYTES) * ALIGN_BYTES


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


@dataclass(frozen=True)
class StateField:
    offset: int  # bytes from the start of the sequence's state
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return _numel(self.shape) * dtype_bytes(self.dtype)


@dataclass(frozen=True)
class StateLayout:
    """Byte layout of one sequence's state over all linear layers: layer id -> (conv field, recurrent field)."""

    fields: dict[int, tuple[StateField, StateField]]
    total_bytes: int

    @classmethod
    def of(cls, shapes: dict[int, LinearStateShape], conv_dtype: torch.dtype) -> StateLayout:
        fields, offset = {}, 0
        for layer_id in sorted(shapes):
            conv = StateField(offset, shapes[layer_id].conv, conv_dtype)
            offset = _align(offset + conv.nbytes)
            recurrent = StateField(offset, shapes[layer_id].recurrent, torch.float32)
            offset = _align(offset + recurrent.nbytes)
            fields[layer_id] = (conv, recurrent)
        return cls(fields, offset)

    def num_blocks(self, block_bytes: int) -> int:
        return cdiv(self.total_bytes, block_bytes) if self.total_bytes else 0


class BlockLinearStateStore:
    """``LinearStateStore`` over pool blocks: ``prepare`` (gather) before the forward, ``commit`` (scatter)
    after it. See the module docstring."""

    def __init__(self, storage: ArenaStorage, layout: StateLayout, host: HostKVStorage | None = None) -> None:
        if storage.arena.config.kv_block_bytes % 4:  # scratch rows must start fp32-aligned
            raise ValueError(f"kv_block_bytes={storage.arena.config.kv_block_bytes} must be a multiple of 4 to "
                             f"hold fp32 linear-attention state")
        self.storage, self.layout, self.host = storage, layout, host
        self._host_index: tuple[Tensor, Tensor, Tensor] | None = None  # (device pos, host pos, host blocks)
        self.num_blocks = layout.num_blocks(storage.arena.config.kv_block_bytes)
        self._rows: dict[int, int] = {}
        self._scratch: Tensor | None = None  # [B, num_blocks * kv_block_bytes] uint8
        self._index: tuple[Tensor, Tensor] | None = None
        self._views: dict[tuple[int, int], LinearState] = {}
        # The blocks as 8-byte words when their layout allows: gathering and scattering whole states moves words,
        # not bytes, which on the CPU is several times faster (the step's main cost at batch 32 otherwise).
        blocks = storage.block_bytes_view
        # ... and where the native library builds, one memcpy per block (faster still, and for any alignment)
        self._native = blocks.device.type == "cpu" and blocks.stride(-1) == 1 and native.available()
        self._buffer = torch.empty(0, dtype=torch.uint8)  # the native path's scratch, reused step to step
        self._words = blocks.view(torch.int64) if all(n % 8 == 0 for n in (*blocks.stride()[:-1], blocks.shape[-1],
                                                                             blocks.storage_offset())) else None

    def prepare(self, batch: StepBatch, state_tables: list[list[int]]) -> None:
        """Gather the state blocks of the step's sequences (``state_tables`` in batch order)."""
        for table in state_tables:
            if len(table) != self.num_blocks:
                raise ValueError(f"a sequence holds {len(table)} state blocks, the layout needs {self.num_blocks}")
        flat = [b for table in state_tables for b in table]
        device = self.storage.device
        self._host_index = None
        if self.host is not None and any(self.host.is_host(b) for b in flat):
            self._prepare_tiered(flat, len(state_tables))
        else:
            groups, slots = self.storage.block_coords(flat)
            shape = (len(state_tables), self.num_blocks)
            self._index = (torch.tensor(groups, device=device).view(shape),
                           torch.tensor(slots, device=device).view(shape))
            if self._native:
                row_bytes = self.num_blocks * self.storage.arena.config.kv_block_bytes
                need = len(state_tables) * row_bytes
                if self._buffer.numel() < need:  # kept across steps: fresh pages each step cost a fault and a zeroing
                    self._buffer = torch.empty(need, dtype=torch.uint8)
                self._scratch = self._buffer[:need].view(len(state_tables), row_bytes)
                native.copy_blocks(self._scratch, self.storage.block_bytes_view, self._index, to_blocks=False)
            elif self._words is not None:
                self._scratch = self._words[self._index].view(torch.uint8).reshape(len(state_tables), -1)
            else:
                self._scratch = self.storage.block_bytes_view[self._index].reshape(len(state_tables), -1)
        self._rows = {seq_id: row for row, seq_id in enumerate(batch.seq_ids)}
        self._views = {}

    def _prepare_tiered(self, flat: list[int], num_seqs: int) -> None:
        """Gather state blocks of which some are host blocks (module docstring)."""
        host, device = self.host, self.storage.device
        on_host = [host.is_host(b) for b in flat]
        dev_pos = [i for i, h in enumerate(on_host) if not h]
        host_pos = [i for i, h in enumerate(on_host) if h]
        scratch = torch.empty(len(flat), self.storage.arena.config.kv_block_bytes, dtype=torch.uint8, device=device)
        groups, slots = self.storage.block_coords([flat[i] for i in dev_pos])
        self._index = (torch.tensor(groups, device=device, dtype=torch.long),
                       torch.tensor(slots, device=device, dtype=torch.long))
        dev_pos_t = torch.tensor(dev_pos, device=device, dtype=torch.long)
        if dev_pos:
            scratch[dev_pos_t] = self.storage.block_bytes_view[self._index]
        host_blocks = torch.tensor(host.index_of(flat[i] for i in host_pos), dtype=torch.long)
        host_pos_t = torch.tensor(host_pos, device=device, dtype=torch.long)
        scratch[host_pos_t] = host.block_bytes_view[host_blocks].to(device)
        self._host_index = (dev_pos_t, host_pos_t, host_blocks)
        self._scratch = scratch.view(num_seqs, -1)

    def state(self, layer_id: int, seq_id: int) -> LinearState:
        key = (layer_id, seq_id)
        view = self._views.get(key)
        if view is None:
            if self._scratch is None:
                raise RuntimeError("BlockLinearStateStore.state() called outside prepare()/commit()")
            row = self._scratch[self._rows[seq_id]]
            conv, recurrent = self.layout.fields[layer_id]
            view = self._views[key] = LinearState(self._field(row, conv), self._field(row, recurrent))
        return view

    @staticmethod
    def _field(row: Tensor, field: StateField) -> Tensor:
        return row[field.offset : field.offset + field.nbytes].view(field.dtype).view(field.shape)

    def commit(self) -> None:
        """Scatter the updated scratch back into the state blocks and end the step."""
        if self._scratch is None or self._index is None:
            return
        rows = self._scratch.shape[0]
        if self._host_index is None and self._native:
            native.copy_blocks(self._scratch, self.storage.block_bytes_view, self._index, to_blocks=True)
        elif self._host_index is None and self._words is not None:
            self._words[self._index] = self._scratch.view(torch.int64).view(rows, self.num_blocks, -1)
        elif self._host_index is None:
            self.storage.block_bytes_view[self._index] = self._scratch.view(rows, self.num_blocks, -1)
        else:
            dev_pos, host_pos, host_blocks = self._host_index
            flat = self._scratch.view(rows * self.num_blocks, -1)
            if dev_pos.numel():
                self.storage.block_bytes_view[self._index] = flat[dev_pos]
            self.host.block_bytes_view[host_blocks] = flat[host_pos].to(host_blocks.device)
        self._scratch, self._index, self._views, self._host_index = None, None, {}, None
