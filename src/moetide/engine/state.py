"""Linear-attention (Gated DeltaNet) state in KV-pool blocks: the engine's ``LinearStateStore`` for hybrid models.

Where the bytes live: like vLLM's hybrid allocator, a hybrid model's fixed-size per-sequence state is carved from
the same pool as KV (``KVCacheManager``: ``n`` blocks per state, below). The state of one sequence, all linear
layers, is laid out as one byte string (``models.StateLayout``) cut into ``kv_block_bytes`` pieces, piece i in the
request's state block i, so exact memory accounting needs no second allocator.

Two ways to reach it. A decode step on the CPU hands the native kernel the blocks' addresses (``state_blocks``), and
the kernel updates each state where it lies, as vLLM's kernels index a state slot: no copy. A layer that needs
tensors (a prefill chunk, the torch path, a CUDA device) calls ``state``; since a request's state blocks need not
be adjacent in the arena, the first such call gathers the step's state blocks into a contiguous scratch (one memcpy
per block with the native library, else an indexed copy), the layer updates views of it, and ``commit`` scatters it
back. After a gather, ``state_blocks`` points into the scratch, so the two ways never see different bytes.

Which blocks: without prefix caching, the request's ``n`` private state blocks; with it, each group's newest state
slot (``core.mamba_states``: piece i is group i), which the runner first fills with the state it starts from (the
slot before, or a prefix hit's cached state). A request that starts from nothing (no computed tokens) has its state
ignored by the model, so recycled blocks need no clearing.

With host KV (``engine.host_kv``) a state block may be a host block (the pool hands out device blocks first, but
a request admitted once the device part is full gets host blocks). A step with such a block gathers at ``prepare``
from both tensors into the scratch (CUDA: one copy to the device) and scatters back there at ``commit``; the layout
is the same, so nothing else changes.
"""

from __future__ import annotations

import torch
from torch import Tensor

from moetide.engine import native
from moetide.engine.host_kv import HostKVStorage
from moetide.engine.models import LinearState, LinearStateStore, StateBlocks, StateLayout, StepBatch
from moetide.engine.storage import ArenaStorage


class BlockLinearStateStore(LinearStateStore):
    """``LinearStateStore`` over pool blocks: ``prepare`` before the forward, ``commit`` after it. See the module
    docstring."""

    def __init__(self, storage: ArenaStorage, layout: StateLayout, host: HostKVStorage | None = None) -> None:
        if storage.arena.config.kv_block_bytes % 4:  # scratch rows must start fp32-aligned
            raise ValueError(f"kv_block_bytes={storage.arena.config.kv_block_bytes} must be a multiple of 4 to "
                             f"hold fp32 linear-attention state")
        self.storage, self.layout, self.host = storage, layout, host
        self.block_bytes = storage.arena.config.kv_block_bytes
        self.num_blocks = layout.num_blocks(self.block_bytes)
        self._host_index: tuple[Tensor, Tensor, Tensor] | None = None  # (device pos, host pos, host blocks)
        self._rows: dict[int, int] = {}
        self._index: tuple[Tensor, Tensor] | None = None  # (groups, slots) [B, num_blocks], between prepare/commit
        self._scratch: Tensor | None = None  # [B, num_blocks * kv_block_bytes] uint8, once gathered
        self._addresses: Tensor | None = None  # state_blocks' answer for all rows, in batch order
        self._views: dict[tuple[int, int], LinearState] = {}
        blocks = storage.block_bytes_view
        # in place and one memcpy per block where the native library builds (the blocks are CPU memory)
        self._native = blocks.device.type == "cpu" and blocks.stride(-1) == 1 and native.available()
        self._buffer = torch.empty(0, dtype=torch.uint8)  # the native path's scratch, reused step to step
        # else the blocks as 8-byte words when their layout allows: moving words, not bytes, is several times faster
        self._words = blocks.view(torch.int64) if all(n % 8 == 0 for n in (*blocks.stride()[:-1], blocks.shape[-1],
                                                                             blocks.storage_offset())) else None

    def prepare(self, batch: StepBatch, state_tables: list[list[int]]) -> None:
        """Take the state blocks of the step's sequences (``state_tables`` in batch order); gather them now only
        where some are host blocks."""
        for table in state_tables:
            if len(table) != self.num_blocks:
                raise ValueError(f"a sequence holds {len(table)} state blocks, the layout needs {self.num_blocks}")
        flat = [b for table in state_tables for b in table]
        self._host_index, self._scratch, self._addresses, self._views = None, None, None, {}
        self._rows = {seq_id: row for row, seq_id in enumerate(batch.seq_ids)}
        if self.host is not None and any(self.host.is_host(b) for b in flat):
            self._prepare_tiered(flat, len(state_tables))
            return
        shape = (len(state_tables), self.num_blocks)
        groups, slots = self.storage.block_coords(flat)
        self._index = (groups.view(shape), slots.view(shape))

    def _gather(self) -> Tensor:
        """The step's state rows as one contiguous scratch, gathered on first use (module docstring)."""
        if self._scratch is not None:
            return self._scratch
        if self._index is None:
            raise RuntimeError("BlockLinearStateStore used outside prepare()/commit()")
        rows, self._addresses = self._index[0].shape[0], None
        if self._native:
            need = rows * self.num_blocks * self.block_bytes
            if self._buffer.numel() < need:  # kept across steps: fresh pages each step cost a fault and a zeroing
                self._buffer = torch.empty(need, dtype=torch.uint8)
            self._scratch = self._buffer[:need].view(rows, -1)
            native.copy_blocks(self._scratch, self.storage.block_bytes_view, self._index, to_blocks=False)
        elif self._words is not None:
            self._scratch = self._words[self._index].view(torch.uint8).reshape(rows, -1)
        else:
            self._scratch = self.storage.block_bytes_view[self._index].reshape(rows, -1)
        return self._scratch

    def _prepare_tiered(self, flat: list[int], num_seqs: int) -> None:
        """Gather state blocks of which some are host blocks (module docstring)."""
        host, device = self.host, self.storage.device
        on_host = [host.is_host(b) for b in flat]
        dev_pos = [i for i, h in enumerate(on_host) if not h]
        host_pos = [i for i, h in enumerate(on_host) if h]
        scratch = torch.empty(len(flat), self.block_bytes, dtype=torch.uint8, device=device)
        self._index = self.storage.block_coords([flat[i] for i in dev_pos])
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
            view = self._views[key] = self.layout.views(self._gather()[self._rows[seq_id]], layer_id)
        return view

    def state_blocks(self, seq_ids: list[int]) -> StateBlocks | None:
        if not self._native or not self.num_blocks:
            return None
        if self._index is None:
            raise RuntimeError("BlockLinearStateStore used outside prepare()/commit()")
        if self._addresses is None:  # every row's, once per step (and again after a gather)
            if self._scratch is not None:  # gathered: the scratch holds the step's state until commit
                scratch = self._scratch
                self._addresses = (scratch.data_ptr() + torch.arange(scratch.shape[0])[:, None] * scratch.stride(0)
                                   + torch.arange(self.num_blocks)[None, :] * self.block_bytes)
            else:
                blocks, (groups, slots) = self.storage.block_bytes_view, self._index
                self._addresses = blocks.data_ptr() + groups * blocks.stride(0) + slots * blocks.stride(1)
        rows = [self._rows[s] for s in seq_ids]
        if rows == list(range(len(self._rows))):
            return StateBlocks(self._addresses, self.block_bytes, self.layout)
        return StateBlocks(self._addresses[torch.tensor(rows, dtype=torch.long)], self.block_bytes, self.layout)

    def commit(self) -> None:
        """Scatter a gathered scratch back into the state blocks and end the step."""
        scratch, index, host_index = self._scratch, self._index, self._host_index
        self._scratch = self._index = self._host_index = self._addresses = None
        self._views = {}
        if scratch is None or index is None:
            return
        rows = scratch.shape[0]
        if host_index is None and self._native:
            native.copy_blocks(scratch, self.storage.block_bytes_view, index, to_blocks=True)
        elif host_index is None and self._words is not None:
            self._words[index] = scratch.view(torch.int64).view(rows, self.num_blocks, -1)
        elif host_index is None:
            self.storage.block_bytes_view[index] = scratch.view(rows, self.num_blocks, -1)
        else:
            dev_pos, host_pos, host_blocks = host_index
            flat = scratch.view(rows * self.num_blocks, -1)
            if dev_pos.numel():
                self.storage.block_bytes_view[index] = flat[dev_pos]
            self.host.block_bytes_view[host_blocks] = flat[host_pos].to(host_blocks.device)
