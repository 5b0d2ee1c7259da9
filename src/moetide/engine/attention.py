"""Paged attention over the arena: the engine's ``AttentionBackend``.

Each step the runner hands over the scheduler's plan as a ``StepBatch`` plus every sequence's block table
(``KVCacheManager.get_blocks``: block i holds tokens ``[i·block_size, (i+1)·block_size)``). ``prepare`` turns
them into index tensors once per step; each full-attention layer then

1. **writes** the K and V of *every* token of the step into its slot (block ``table[pos // block_size]``, slot
   ``pos % block_size``) — all sequences first, because the KV cache manager registers a block for prefix reuse
   when it is allocated, so a request scheduled later in the same step may already count that block as computed
   and must find this layer's K/V in it when it attends (vLLM's ordering);
2. **attends** each sequence over its blocks: gather the sequence's keys and values slot by slot (one
   ``index_select`` each over the arena's row views, ``ArenaStorage.kv_rows``; the row indices are built once
   per step and shared by every layer) into ``[context, Hkv, D]`` and run causal attention with torch's
   ``scaled_dot_product_attention`` (GQA heads as transformers' ``repeat_kv``; the same kernel transformers'
   default ``sdpa`` attention calls), one call per group. A group of decode tokens on the CPU in fp32 or bf16
   instead reads its keys and values where they lie, in one native call (``engine.native.paged_decode_attention``: no
   gather, no mask; equal to SDPA to fp32 round-off), unless the native kernels are unavailable.

Sequences are attended in groups: all one-token (decode) sequences of the step together, padded to the longest
context, and every multi-token (prefill chunk) sequence on its own, so padding never multiplies a long chunk by the
batch. A step that is one group (pure decode, or one sequence) skips the query gather/scatter. Padding is harmless
by construction: a key slot past a sequence's context is masked to -inf *and* gathered from the sequence's own
slot 0 — real, finite K/V — never from the slot itself, because a recycled page may hold any bytes, including NaN
patterns, and 0 × NaN is NaN; a padded query row (a zero query) attends valid keys and its output is dropped.

Nothing here allocates or frees blocks: the scheduler owns every memory decision, this only reads the tables.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from moetide.engine import native
from moetide.engine.models import AttentionBackend, DecodeRows, StepBatch
from moetide.engine.storage import ArenaStorage
from moetide.units import cdiv


@dataclass(frozen=True)
class _Group:
    """Sequences attended together, b of them, each padded to Q query rows and L key slots."""

    key_rows: Tensor  # [b·L] ``kv_rows`` row of every key slot (past a sequence's context: its slot 0's row)
    num_keys: int  # L
    token_index: Tensor | None  # [b, Q] packed token of each query row (padding: row T, a zero row); None
    # when the group is the whole step, in order (``_StepPlan.direct``)
    attend: Tensor  # [b, 1, Q, L] True = the query attends the key (causal, inside the context)
    lengths: Tensor  # [b] each sequence's context (keys attended by its last query row)


@dataclass
class _StepPlan:
    groups: list[_Group]
    num_tokens: int
    direct: tuple[int, int] | None  # (b, Q) when one group holds every token in order, unpadded: no reshuffle
    batch: StepBatch
    block_tables: list[list[int]]
    storage: ArenaStorage

    @functools.cached_property
    def write_index(self) -> tuple[Tensor, ...]:
        """(group, slot, offset) [T] each: where each token's K/V goes in the arena's KV views. Built on first use:
        a pure decode step that the native kernel writes never needs it."""
        bs, blocks, offsets = self.storage.kv_layout.block_size, [], []
        for table, n, computed in zip(self.block_tables, self.batch.num_new_tokens, self.batch.num_computed_tokens):
            blocks += [table[p // bs] for p in range(computed, computed + n)]
            offsets += [p % bs for p in range(computed, computed + n)]
        return (*self.storage.block_coords(blocks),
                torch.tensor(offsets, dtype=torch.long, device=self.storage.device))


class PagedAttentionBackend(AttentionBackend):
    """``AttentionBackend`` over ``ArenaStorage``: ``prepare(batch, block_tables)`` once per step, then the model
    calls ``attend`` per full-attention layer. See the module docstring."""

    def __init__(self, storage: ArenaStorage) -> None:
        self.storage = storage
        self.layout = storage.kv_layout
        self._attn_index = {layer_id: a for a, layer_id in enumerate(self.layout.attn_layer_ids)}
        self._plan: _StepPlan | None = None
        self._slot_rows = torch.arange(self.layout.block_size, device=storage.device) * storage.row_step  # [bs]

    # ---- per step -----------------------------------------------------------------------------------------
    def prepare(self, batch: StepBatch, block_tables: list[list[int]]) -> None:
        """Index tensors for the step. ``block_tables[i]`` is sequence i's table and must cover its context."""
        bs = self.layout.block_size
        for table, n, computed in zip(block_tables, batch.num_new_tokens, batch.num_computed_tokens):
            if len(table) * bs < computed + n:
                raise ValueError(f"a block table of {len(table)} blocks cannot hold {computed + n} tokens")
        rows, direct, starts = query_groups(batch)
        self._plan = _StepPlan([self._group(batch, block_tables, starts, r) for r in rows], batch.num_tokens, direct,
                               batch, block_tables, self.storage)

    def _group(self, batch: StepBatch, tables: list[list[int]], starts: list[int] | None, rows: list[int]) -> _Group:
        """``starts``: each sequence's first token in the step, or None when the group is the whole step."""
        bs, device, b = self.layout.block_size, self.storage.device, len(rows)
        num_q = max(batch.num_new_tokens[i] for i in rows)
        contexts = [batch.num_computed_tokens[i] + batch.num_new_tokens[i] for i in rows]
        num_blocks = cdiv(max(contexts), bs)
        blocks: list[int] = []
        for i, context in zip(rows, contexts):
            used = tables[i][: cdiv(context, bs)]
            blocks += used + [used[0]] * (num_blocks - len(used))
        num_keys = num_blocks * bs
        ints = torch.tensor(contexts + self.storage.key_rows(blocks), device=device)  # one host-to-device copy
        key_pos = torch.arange(num_keys, device=device)
        key_valid = key_pos < ints[:b, None]  # [b, L]
        key_rows = (ints[b:].view(b, num_blocks, 1) + self._slot_rows).view(b, num_keys)  # [b, L]
        if num_q == 1:  # a decode token sits at the last position of its context: it attends every valid key
            attend = key_valid[:, None, None, :]
        else:
            query_pos = [[c + j for j in range(num_q)] for c in (batch.num_computed_tokens[i] for i in rows)]
            attend = ((key_pos <= torch.tensor(query_pos, device=device)[:, :, None]) & key_valid[:, None])[:, None]
        token_index = group_token_index(batch, starts, rows, num_q, device)
        return _Group(torch.where(key_valid, key_rows, key_rows[:, :1]).flatten(), num_keys, token_index, attend,
                      ints[:b])

    def end_step(self) -> None:
        """Nothing to close: the paged backend measures nothing (the split backend does)."""

    # ---- per layer ----------------------------------------------------------------------------------------
    def decode_rows(self, layer_id: int, num_heads: int, like: Tensor) -> DecodeRows | None:
        """A pure decode step's key rows (``AttentionBackend.decode_rows``) where the native kernel reads them in
        place: one group of one token per sequence, a KV cache in ``like``'s dtype, work ``decode_worth_it``."""
        plan = self._plan
        if plan is None or plan.direct is None or plan.direct[1] != 1:
            return None
        k_rows, v_rows = self.storage.kv_rows(self._attn_index[layer_id])
        group, b = plan.groups[0], plan.direct[0]
        macs = native.decode_macs(b * num_heads * k_rows.shape[2], group.num_keys)
        if k_rows.dtype != like.dtype or not native.worth_it(like, macs, native.EXPERT_DTYPES):
            return None
        return DecodeRows(k_rows, v_rows, group.key_rows.view(b, group.num_keys), group.lengths)

    def attend(self, layer_id: int, q: Tensor, k: Tensor, v: Tensor, batch: StepBatch, scale: float) -> Tensor:
        plan = self._plan
        if plan is None or plan.num_tokens != q.shape[0]:
            raise RuntimeError("PagedAttentionBackend.attend() before prepare() for this step")
        rows = self.decode_rows(layer_id, q.shape[1], q)
        if rows is not None:  # a pure decode step: each token's K/V written into its slot, then attended
            return native.paged_decode_attention(q, rows.k_rows, rows.v_rows, rows.key_rows, rows.lengths, scale,
                                                 new_kv=(k, v))
        a = self._attn_index[layer_id]
        k_rows, v_rows = self.storage.kv_rows(a)
        k_cache, v_cache = self.storage.kv_views(a)
        k_cache[plan.write_index] = k.to(k_cache.dtype)  # every token of the step first (see the module docstring)
        if v_cache is not k_cache:  # else the values are the keys (``KVLayout.values_in_keys``): written once
            v_cache[plan.write_index] = v.to(v_cache.dtype)
        if plan.direct is not None:
            out = self._attend_group(q.view(*plan.direct, *q.shape[1:]), k_rows, v_rows, plan.groups[0], scale)
            return out.reshape(q.shape)
        q_rows = pad_queries(q)
        results = [self._attend_group(q_rows[g.token_index], k_rows, v_rows, g, scale) for g in plan.groups]
        return scatter_groups(q, plan.num_tokens, [g.token_index for g in plan.groups], results)

    @staticmethod
    def _attend_group(q: Tensor, k_rows: Tensor, v_rows: Tensor, group: _Group, scale: float) -> Tensor:
        """One group's attention: decode reads the pages in place (native), anything else gathers first."""
        b, num_q, Hq, D = q.shape
        if (num_q == 1 and k_rows.dtype == q.dtype  # decode: read the pages in place
                and native.decode_worth_it(q, group.num_keys, native.EXPERT_DTYPES)):
            key_rows = group.key_rows.view(b, group.num_keys)
            return native.paged_decode_attention(q.view(b, Hq, D), k_rows, v_rows, key_rows, group.lengths,
                                                 scale).view(q.shape)
        keys, values = gather_kv(k_rows, v_rows, group.key_rows, b, group.num_keys)
        return attend_gathered(q, keys, values, group.attend, scale)


def query_groups(batch: StepBatch) -> tuple[list[list[int]], tuple[int, int] | None, list[int] | None]:
    """The step's attention groups — all one-token sequences together, then the prefill chunks of each length
    together (one batched call where prompts of one length arrive together; keys padded to the group's longest
    context and masked) — as sequence indices; ``direct`` ([b, Q] of the one group) when one group is the whole
    step (no query gather/scatter); else ``starts``, each sequence's first token in the step."""
    by_length: dict[int, list[int]] = {}
    for i, n in enumerate(batch.num_new_tokens):
        by_length.setdefault(n, []).append(i)
    decode = by_length.pop(1, [])
    rows = ([decode] if decode else []) + list(by_length.values())
    direct = None
    if len(rows) == 1:
        direct = (len(rows[0]), batch.num_new_tokens[rows[0][0]])
    return rows, direct, None if direct else [s.start for s in batch.token_slices()]


def group_token_index(batch: StepBatch, starts: list[int] | None, rows: list[int], num_q: int,
                      device: torch.device) -> Tensor | None:
    """[b, Q] step-token index of each query row of the group (padding rows point at row T, a zero row), or None
    when the group is the whole step."""
    if starts is None:
        return None
    return torch.tensor([[starts[i] + j if j < batch.num_new_tokens[i] else batch.num_tokens for j in range(num_q)]
                         for i in rows], device=device)


def pad_queries(q: Tensor) -> Tensor:
    """q [T, Hq, D] with a zero row T appended: what a group's padding query rows read."""
    return torch.cat([q, q.new_zeros(1, *q.shape[1:])])


def scatter_groups(q: Tensor, num_tokens: int, token_indexes: list[Tensor], results: list[Tensor]) -> Tensor:
    """The groups' outputs [b, Q, Hq, D] back in step-token order, [T, Hq, D]."""
    out = q.new_empty(num_tokens + 1, *q.shape[1:])
    for token_index, result in zip(token_indexes, results):
        out[token_index] = result
    return out[:num_tokens]


def gather_kv(k_rows: Tensor, v_rows: Tensor, key_rows: Tensor, b: int, num_keys: int) -> tuple[Tensor, Tensor]:
    """Keys and values [b, L, Hkv, D] of ``key_rows`` ([b·L] row indices into the [rows, Hkv, D] views); one
    gather where the value rows are the key rows (``KVLayout.values_in_keys``)."""
    shape = (b, num_keys, *k_rows.shape[1:])
    keys = k_rows.index_select(0, key_rows).view(shape)
    return keys, keys if v_rows is k_rows else v_rows.index_select(0, key_rows).view(shape)


def attend_gathered(q: Tensor, keys: Tensor, values: Tensor, attend: Tensor | None, scale: float) -> Tensor:
    """q [b, Q, Hq, D] over keys/values [b, L, Hkv, D] -> [b, Q, Hq, D] (query head h reads KV head
    h // (Hq / Hkv), transformers' ``repeat_kv``; softmax accumulated in fp32)."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                                         attn_mask=attend, scale=scale, enable_gqa=True)
    return out.transpose(1, 2)
