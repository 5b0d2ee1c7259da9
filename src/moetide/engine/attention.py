"""Paged attention over the arena: the engine's ``AttentionBackend``.

Each step the runner hands over the scheduler's plan as a ``StepBatch`` plus every sequence's block table
(``KVCacheManager.get_blocks``: block i holds tokens ``[i·block_size, (i+1)·block_size)``). ``prepare`` turns
them into index tensors once per step; each full-attention layer then

1. **writes** the K and V of *every* token of the step into its slot (block ``table[pos // block_size]``, slot
   ``pos % block_size``) — all sequences first, because the KV cache manager registers a block for prefix reuse
   when it is allocated, so a request scheduled later in the same step may already count that block as computed
   and must find this layer's K/V in it when it attends (vLLM's ordering);
2. **attends** each sequence over its blocks: gather the sequence's blocks (by (group, slot) index into the
   arena's strided KV view, ``engine.storage``) into a contiguous ``[context, Hkv, D]`` K and V and run causal
   attention with torch's ``scaled_dot_product_attention`` (GQA heads as transformers' ``repeat_kv``; the same
   kernel transformers' default ``sdpa`` attention calls), one call per group.

Sequences are attended in groups: all one-token (decode) sequences of the step together, padded to the longest
context, and every multi-token (prefill chunk) sequence on its own, so padding never multiplies a long chunk by the
batch. A step that is one group (pure decode, or one sequence) skips the query gather/scatter. Padding is harmless by construction: a key slot past a sequence's context is masked to -inf *and* its value
zeroed (a recycled page may hold any bytes, including NaN patterns), and a padded query row attends only key 0.

Nothing here allocates or frees blocks: the scheduler owns every memory decision, this only reads the tables.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from moetide.engine.models import StepBatch
from moetide.engine.storage import ArenaStorage


@dataclass(frozen=True)
class _Group:
    """Sequences attended together: gather indices [b, nb] (group, slot), and per padded query row the packed
    token it stands for ([b, q] into the step's tokens; padding rows point at row ``T``, a zero row)."""

    groups: Tensor
    slots: Tensor
    token_index: Tensor
    attend: Tensor  # [b, 1, q, nb*block_size] True = the query attends the key (causal, inside the context)
    key_valid: Tensor  # [b, nb*block_size, 1, 1] True where the slot is inside the context


@dataclass(frozen=True)
class _StepPlan:
    write_groups: Tensor  # [T]
    write_slots: Tensor  # [T]
    write_offsets: Tensor  # [T]
    groups: list[_Group]
    num_tokens: int
    direct: tuple[int, int] | None  # (b, Q) when one group holds every token in order, unpadded: no reshuffle


class PagedAttentionBackend:
    """``AttentionBackend`` over ``ArenaStorage``: ``prepare(batch, block_tables)`` once per step, then the model
    calls ``attend`` per full-attention layer. See the module docstring."""

    def __init__(self, storage: ArenaStorage) -> None:
        self.storage = storage
        self.layout = storage.kv_layout
        self._attn_index = {layer_id: a for a, layer_id in enumerate(self.layout.attn_layer_ids)}
        self._plan: _StepPlan | None = None

    # ---- per step -----------------------------------------------------------------------------------------
    def prepare(self, batch: StepBatch, block_tables: list[list[int]]) -> None:
        """Index tensors for the step. ``block_tables[i]`` is sequence i's table and must cover its context."""
        bs = self.layout.block_size
        write_blocks: list[int] = []
        write_offsets: list[int] = []
        for table, n, computed in zip(block_tables, batch.num_new_tokens, batch.num_computed_tokens):
            if len(table) * bs < computed + n:
                raise ValueError(f"a block table of {len(table)} blocks cannot hold {computed + n} tokens")
            write_blocks += [table[p // bs] for p in range(computed, computed + n)]
            write_offsets += [p % bs for p in range(computed, computed + n)]
        wg, ws = self.storage.block_coords(write_blocks)
        device = self.storage.device
        decode = [i for i, n in enumerate(batch.num_new_tokens) if n == 1]
        prefill = [[i] for i, n in enumerate(batch.num_new_tokens) if n > 1]
        starts = [s.start for s in batch.token_slices()]
        rows = ([decode] if decode else []) + prefill
        direct = None
        if len(rows) == 1:  # a pure decode step, or a single sequence
            direct = (len(decode), 1) if decode else (1, batch.num_tokens)
        self._plan = _StepPlan(torch.tensor(wg, device=device), torch.tensor(ws, device=device),
                               torch.tensor(write_offsets, device=device),
                               [self._group(batch, block_tables, starts, r) for r in rows], batch.num_tokens, direct)

    def _group(self, batch: StepBatch, tables: list[list[int]], starts: list[int], rows: list[int]) -> _Group:
        bs, device = self.layout.block_size, self.storage.device
        num_q = max(batch.num_new_tokens[i] for i in rows)
        contexts = [batch.num_computed_tokens[i] + batch.num_new_tokens[i] for i in rows]
        num_blocks = -(-max(contexts) // bs)
        padded = [tables[i][:num_blocks] + [0] * (num_blocks - len(tables[i][:num_blocks])) for i in rows]
        flat_groups, flat_slots = self.storage.block_coords([b for t in padded for b in t])
        token_index, query_pos = [], []
        for i in rows:
            n, c = batch.num_new_tokens[i], batch.num_computed_tokens[i]
            token_index.append([starts[i] + j for j in range(n)] + [batch.num_tokens] * (num_q - n))
            query_pos.append([c + j for j in range(n)] + [0] * (num_q - n))
        key_pos = torch.arange(num_blocks * bs, device=device)
        context = torch.tensor(contexts, device=device)[:, None]  # [b, 1]
        qpos = torch.tensor(query_pos, device=device)  # [b, q]
        key_valid = key_pos[None, :] < context  # [b, K]
        attend = (key_pos[None, None, :] <= qpos[:, :, None]) & key_valid[:, None, :]  # [b, q, K]
        shape = (len(rows), num_blocks)
        return _Group(torch.tensor(flat_groups, device=device).view(shape),
                      torch.tensor(flat_slots, device=device).view(shape),
                      torch.tensor(token_index, device=device), attend[:, None], key_valid[:, :, None, None])

    # ---- per layer ----------------------------------------------------------------------------------------
    def attend(self, layer_id: int, q: Tensor, k: Tensor, v: Tensor, batch: StepBatch, scale: float) -> Tensor:
        plan = self._plan
        if plan is None or plan.num_tokens != q.shape[0]:
            raise RuntimeError("PagedAttentionBackend.attend() before prepare() for this step")
        k_cache, v_cache = self.storage.kv_views(self._attn_index[layer_id])
        index = (plan.write_groups, plan.write_slots, plan.write_offsets)
        k_cache[index] = k.to(k_cache.dtype)  # every token of the step first (see the module docstring)
        v_cache[index] = v.to(v_cache.dtype)
        if plan.direct is not None:
            out = self._attend_group(q.view(*plan.direct, *q.shape[1:]), k_cache, v_cache, plan.groups[0], scale)
            return out.reshape(q.shape)
        q_rows = torch.cat([q, q.new_zeros(1, *q.shape[1:])])  # row T: the zero query padding rows read
        out = q.new_empty(plan.num_tokens + 1, *q.shape[1:])
        for group in plan.groups:
            out[group.token_index] = self._attend_group(q_rows[group.token_index], k_cache, v_cache, group, scale)
        return out[: plan.num_tokens]

    @staticmethod
    def _attend_group(q: Tensor, k_cache: Tensor, v_cache: Tensor, group: _Group, scale: float) -> Tensor:
        """q [b, Q, Hq, D] -> [b, Q, Hq, D] over the group's gathered blocks (query head h reads KV head
        h // (Hq / Hkv), transformers' ``repeat_kv``; softmax accumulated in fp32)."""
        keys = k_cache[group.groups, group.slots].flatten(1, 2)  # [b, K, Hkv, D]
        values = v_cache[group.groups, group.slots].flatten(1, 2).masked_fill(~group.key_valid, 0.0)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                                             attn_mask=group.attend, scale=scale, enable_gqa=True)
        return out.transpose(1, 2)  # [b, Q, Hq, D]
