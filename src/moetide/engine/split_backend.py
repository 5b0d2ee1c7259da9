"""Split attention over device and host KV: the engine's ``AttentionBackend`` when KV spills to host memory.

Each step, ``prepare`` reads every sequence's block table; a block's id says where it lives, for good
(``engine.host_kv``: device ids below ``HostKVStorage.first_block_id``, host ids at or above it). A sequence's
used blocks fall into three regions (``core.splits.Region``):

* device/in-place — device blocks, attended on the device where they lie;
* host/in-place — the first ``num_cpu_blocks`` of its host blocks (table order), attended by the CPU in place;
* host/streamed — its other host blocks, gathered into a device staging ring and attended there.

``num_cpu_blocks`` per sequence comes from the step's split policy (``engine.split_plan``: writescope or a
baseline, on ``perf``'s costs). Then each full-attention layer

1. **writes** every token's K and V into its slot, device or host (all sequences first: ``engine.attention``
   says why);
2. **hands the CPU its part**: the queries of every sequence with host/in-place blocks go to a worker thread.
   A group of decode tokens (fp32) is attended where its host blocks lie, by the native kernel that also returns
   the log-sum-exp (``engine.native.paged_decode_attention``; it releases the GIL while it runs); otherwise the
   worker gathers those blocks' slots (one ``index_select`` per K and V over the host rows) and runs torch's CPU
   flash attention, which returns the log-sum-exp (``split_attention.cpu_partial_attention``);
3. meanwhile, on the calling thread, attends the device blocks, and **streams** the host/streamed blocks: their
   slots are gathered on the host into the ring (CUDA: a pinned buffer, then one async copy to the device; CPU: the
   gather writes the ring directly) and attended there;
4. **merges** the partials exactly by log-sum-exp in fp32 (``split_attention.merge_partials``). A region a
   sequence does not have, or a query row that attends nothing in a region (causal rows of a prefill chunk), is an
   empty partial (lse = -inf) and drops out.

A group whose sequences have only device blocks skips the merge: one ``scaled_dot_product_attention`` call, as in
``PagedAttentionBackend``. Groups are the paged backend's: all one-token sequences together, each prefill chunk on
its own. Padding follows its rule too: a padded key slot is masked *and* read from a real slot of the same region,
never from bytes nobody wrote (NaN × 0 is NaN).

Measured per step: the worker's time in the CPU partials, all layers (``end_step`` feeds it to the online
correction). On a machine without an accelerator the "device" is the CPU: the same code runs, with the CUDA-only
details (pinned staging, async copies, moving queries and partials) behind device checks.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
from torch import Tensor

from moetide.core.splits import StepSplit
from moetide.engine import native
from moetide.engine.attention import (
    attend_gathered,
    gather_kv,
    group_token_index,
    pad_queries,
    query_groups,
    scatter_groups,
)
from moetide.engine.host_kv import HostKVStorage, StagingRing
from moetide.engine.models import AttentionBackend, StepBatch
from moetide.engine.split_attention import lse_attention, merge_partials
from moetide.engine.split_plan import SplitCounters, SplitStepper, observe_split_step, plan_split_step
from moetide.engine.storage import ArenaStorage
from moetide.units import cdiv

CPU = torch.device("cpu")


@dataclass(frozen=True)
class _Part:
    """One region's keys for one group: rows of the region's row view, padded to L per sequence."""

    rows: Tensor  # [b·L] rows of the source's ``kv_rows`` (a padded slot: a real row of the same region)
    num_keys: int  # L
    attend: Tensor | None  # [b, 1, Q, L] True = attend; None when every query attends every key
    row_has_key: Tensor | None  # [b, 1, Q]: the query row attends some key here (None with ``attend``)
    lengths: Tensor  # [b] each sequence's keys in this region: its valid slots, a prefix of its rows (the region
    # is its blocks in table order, and only the context's last block can be partial); on the CPU


@dataclass(frozen=True)
class _Group:
    token_index: Tensor | None  # [b, Q] packed token of each query row (padding: row T); None when direct
    shape: tuple[int, int]  # (b, Q)
    device: _Part | None
    cpu: _Part | None  # rows and mask on the CPU
    stream: _Part | None  # rows on the CPU (host rows), mask on the device


@dataclass(frozen=True)
class _Writes:
    index: tuple[Tensor, ...]  # where each token goes: (group, slot, offset) on the device, (block, offset) host
    tokens: Tensor | None  # [n] which of the step's tokens; None = all of them, in order


@dataclass(frozen=True)
class _StepPlan:
    device_writes: _Writes | None
    host_writes: _Writes | None
    groups: list[_Group]
    num_tokens: int
    direct: tuple[int, int] | None
    has_cpu: bool


class SplitAttentionBackend(AttentionBackend):
    """``AttentionBackend`` over the arena and the host KV storage (module docstring)."""

    def __init__(self, storage: ArenaStorage, host: HostKVStorage, stepper: SplitStepper) -> None:
        self.storage, self.host, self.stepper = storage, host, stepper
        self.layout = storage.kv_layout
        self.device = storage.device
        self._attn_index = {layer_id: a for a, layer_id in enumerate(self.layout.attn_layer_ids)}
        self.ring = StagingRing(self.device)
        self.counters = SplitCounters()
        self._plan: _StepPlan | None = None
        self._split: StepSplit | None = None
        self._step_cpu_s = 0.0
        self._executor: ThreadPoolExecutor | None = None

    # ---- per step -----------------------------------------------------------------------------------------
    def prepare(self, batch: StepBatch, block_tables: list[list[int]]) -> None:
        """Where each token's K/V goes, the step's split (the policy), and each group's gather indices."""
        bs = self.layout.block_size
        contexts = [c + n for c, n in zip(batch.num_computed_tokens, batch.num_new_tokens)]
        used = []
        for table, context in zip(block_tables, contexts):
            if len(table) * bs < context:
                raise ValueError(f"a block table of {len(table)} blocks cannot hold {context} tokens")
            used.append(table[: cdiv(context, bs)])
        writes = self._writes(batch, block_tables)
        num_cpu = self._split_step(batch, used, contexts)
        regions = [self._regions(blocks, c) for blocks, c in zip(used, num_cpu)]
        rows, direct, starts = query_groups(batch)
        groups = [self._group(batch, contexts, regions, starts, r) for r in rows]
        self._plan = _StepPlan(*writes, groups, batch.num_tokens, direct, any(g.cpu is not None for g in groups))
        self._step_cpu_s = 0.0

    def _writes(self, batch: StepBatch, tables: list[list[int]]) -> tuple[_Writes | None, _Writes | None]:
        bs, host = self.layout.block_size, self.host
        dev: list[list[int]] = [[], [], []]  # block, offset, token
        hst: list[list[int]] = [[], [], []]
        token = 0
        for table, n, computed in zip(tables, batch.num_new_tokens, batch.num_computed_tokens):
            for p in range(computed, computed + n):
                block = table[p // bs]
                target = hst if host.is_host(block) else dev
                target[0].append(block)
                target[1].append(p % bs)
                target[2].append(token)
                token += 1
        self.counters.host_tokens_written += len(hst[0])
        device_writes = host_writes = None
        if dev[0]:
            index = (*self.storage.block_coords(dev[0]), torch.tensor(dev[1], device=self.device))
            tokens = None if len(dev[0]) == token else torch.tensor(dev[2], device=self.device)
            device_writes = _Writes(index, tokens)
        if hst[0]:
            index = torch.tensor([host.index_of(hst[0]), hst[1]])
            tokens = None if len(hst[0]) == token else torch.tensor(hst[2], device=self.device)
            host_writes = _Writes((index[0], index[1]), tokens)
        return device_writes, host_writes

    def _split_step(self, batch: StepBatch, used: list[list[int]], contexts: list[int]) -> list[int]:
        """Each sequence's ``num_cpu_blocks`` from the split policy (all 0 when no host block is used)."""
        on_host = [[self.host.is_host(b) for b in blocks] for blocks in used]  # each block classified once
        self._split = plan_split_step(self.stepper, self.counters, on_host, contexts, batch.num_tokens,
                                      self.layout.block_size)
        if self._split is None:
            return [0] * len(used)
        return [s.num_cpu_blocks for s in self._split.splits]

    def _regions(self, blocks: list[int], num_cpu: int) -> dict[str, tuple[list[int], list[int]]]:
        """region -> (slot-0 row of each block in the region's row view, the block's index in the table)."""
        host, out = self.host, {"device": ([], []), "cpu": ([], []), "stream": ([], [])}
        num_host = 0
        for j, b in enumerate(blocks):
            if host.is_host(b):
                region = "cpu" if num_host < num_cpu else "stream"
                num_host += 1
            else:
                region = "device"
            out[region][0].append(b)
            out[region][1].append(j)
        for region, (ids, _) in out.items():
            ids[:] = self.storage.key_rows(ids) if region == "device" else host.key_rows(ids)
        return out

    def _group(self, batch: StepBatch, contexts: list[int], regions: list[dict], starts: list[int] | None,
               rows: list[int]) -> _Group:
        num_q = max(batch.num_new_tokens[i] for i in rows)
        query_pos = None
        if num_q > 1:
            query_pos = torch.tensor([[batch.num_computed_tokens[i] + j for j in range(num_q)] for i in rows])
        ctx = torch.tensor([contexts[i] for i in rows])
        parts = {}
        for region, row_step, rows_device, mask_device in (
                ("device", self.storage.row_step, self.device, self.device),
                ("cpu", self.host.row_step, CPU, CPU),
                ("stream", self.host.row_step, CPU, self.device)):
            parts[region] = self._part([regions[i][region] for i in rows], ctx, query_pos, row_step, rows_device,
                                       mask_device)
        token_index = group_token_index(batch, starts, rows, num_q, self.device)
        return _Group(token_index, (len(rows), num_q), parts["device"], parts["cpu"], parts["stream"])

    def _part(self, lists: list[tuple[list[int], list[int]]], ctx: Tensor, query_pos: Tensor | None,
              row_step: int, rows_device: torch.device, mask_device: torch.device) -> _Part | None:
        num_blocks = max(len(starts) for starts, _ in lists)
        if num_blocks == 0:
            return None
        bs = self.layout.block_size
        b = len(lists)
        pad = [num_blocks - len(starts) for starts, _ in lists]
        block_rows = torch.tensor([starts + [0] * p for (starts, _), p in zip(lists, pad)]).view(b, num_blocks, 1)
        base = torch.tensor([[j * bs for j in index] + [c] * p  # a padded block sits past the context: invalid
                             for (_, index), p, c in zip(lists, pad, ctx.tolist())]).view(b, num_blocks, 1)
        slot = torch.arange(bs)
        rows = (block_rows + slot * row_step).view(b, -1)  # [b, L]
        key_pos = (base + slot).view(b, -1)
        valid = key_pos < ctx[:, None]
        first_key = key_pos.masked_fill(~valid, key_pos.numel() + int(ctx.max())).min(dim=1).values  # [b]
        if query_pos is None:  # a decode token attends every key of its context
            full = bool(valid.all())
            attend = valid[:, None, None, :]
            row_has_key = (first_key < ctx)[:, None, None]
        else:
            full = bool(valid.all()) and int(key_pos.max()) <= int(query_pos.min())
            attend = ((key_pos[:, None, :] <= query_pos[:, :, None]) & valid[:, None, :])[:, None]
            row_has_key = (first_key[:, None] <= query_pos)[:, None]
        first = rows.gather(1, valid.int().argmax(dim=1, keepdim=True))  # each sequence's first real row
        any_row = rows[valid][:1]  # a real row of the group, for a sequence with none in this region
        fallback = torch.where(valid.any(dim=1, keepdim=True), first, any_row.expand_as(first))
        rows = torch.where(valid, rows, fallback).flatten()
        lengths = valid.sum(dim=1)
        if full:
            return _Part(rows.to(rows_device), key_pos.shape[1], None, None, lengths)
        return _Part(rows.to(rows_device), key_pos.shape[1], attend.to(mask_device), row_has_key.to(mask_device),
                     lengths)

    def end_step(self) -> None:
        """Close the step: feed the measured CPU time to the online correction (writescope)."""
        split, self._split = self._split, None
        if split is not None:
            observe_split_step(self.stepper, self.counters, split, self._step_cpu_s)

    # ---- per layer ----------------------------------------------------------------------------------------
    def attend(self, layer_id: int, q: Tensor, k: Tensor, v: Tensor, batch: StepBatch, scale: float) -> Tensor:
        plan = self._plan
        if plan is None or plan.num_tokens != q.shape[0]:
            raise RuntimeError("SplitAttentionBackend.attend() before prepare() for this step")
        a = self._attn_index[layer_id]
        self._write(a, k, v, plan)
        if plan.direct is not None:
            queries = [q.view(*plan.direct, *q.shape[1:])]
        else:
            q_rows = pad_queries(q)
            queries = [q_rows[g.token_index] for g in plan.groups]
        future = self._submit_cpu(a, plan, queries, scale) if plan.has_cpu else None
        outs: list[Tensor | list] = []
        for group, qg in zip(plan.groups, queries):
            outs.append(self._attend_on_device(a, group, qg, scale))
        if future is not None:
            cpu_partials, seconds = future.result()
            self._step_cpu_s += seconds
            for i, partial in enumerate(cpu_partials):
                if partial is not None:
                    outs[i].append(tuple(t.to(self.device, non_blocking=True) for t in partial))
        results = [o if isinstance(o, Tensor) else self._merge(o, qg) for o, qg in zip(outs, queries)]
        if plan.direct is not None:
            return results[0].reshape(q.shape)
        return scatter_groups(q, plan.num_tokens, [g.token_index for g in plan.groups], results)

    def _write(self, a: int, k: Tensor, v: Tensor, plan: _StepPlan) -> None:
        """Every token's K/V into its block, device or host, before any attention (module docstring)."""
        for writes, views, device in ((plan.device_writes, self.storage.kv_views(a), self.device),
                                      (plan.host_writes, self.host.kv_views(a), CPU)):
            if writes is None:
                continue
            for src, cache in zip((k, v), views[: 1 if views[1] is views[0] else 2]):  # V is K: written once
                rows = src if writes.tokens is None else src.index_select(0, writes.tokens)
                cache[writes.index] = rows.to(device=device, dtype=cache.dtype)

    def _attend_on_device(self, a: int, group: _Group, q: Tensor, scale: float) -> Tensor | list:
        """The group's output [b, Q, Hq, D] when it has device blocks only; else its device and streamed
        partials (a list the CPU partial joins)."""
        b = group.shape[0]
        if group.cpu is None and group.stream is None:
            keys, values = self._gather(self.storage.kv_rows(a), group.device, b)
            return attend_gathered(q, keys, values, group.device.attend, scale)
        partials = []
        if group.device is not None:
            keys, values = self._gather(self.storage.kv_rows(a), group.device, b)
            partials.append(self._partial(q, keys, values, group.device, scale))
        if group.stream is not None:
            k_rows, v_rows = self.host.kv_rows(a)
            keys, values = self.ring.stage(k_rows, v_rows, group.stream.rows)
            shape = (b, group.stream.num_keys, *keys.shape[1:])
            partials.append(self._partial(q, keys.view(shape), values.view(shape), group.stream, scale))
        return partials

    @staticmethod
    def _gather(kv_rows: tuple[Tensor, Tensor], part: _Part, b: int) -> tuple[Tensor, Tensor]:
        return gather_kv(*kv_rows, part.rows, b, part.num_keys)

    @staticmethod
    def _partial(q: Tensor, keys: Tensor, values: Tensor, part: _Part, scale: float) -> tuple[Tensor, Tensor]:
        """(out [b, Hq, Q, D] fp32, lse [b, Hq, Q]) of q [b, Q, Hq, D] over keys/values [b, L, Hkv, D]."""
        return lse_attention(q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), scale, part.attend,
                             part.row_has_key)

    @staticmethod
    def _merge(partials: list[tuple[Tensor, Tensor]], q: Tensor) -> Tensor:
        out, _ = merge_partials(partials)
        return out.to(q.dtype).transpose(1, 2)  # [b, Q, Hq, D]

    # ---- the CPU's part (worker thread) -------------------------------------------------------------------
    def _submit_cpu(self, a: int, plan: _StepPlan, queries: list[Tensor], scale: float) -> Future:
        if self._executor is None:
            num_threads = torch.get_num_threads()
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moetide-cpu-attention",
                                                initializer=torch.set_num_threads, initargs=(num_threads,))
        work = [(qg.to(CPU), g.cpu) if g.cpu is not None else None for g, qg in zip(plan.groups, queries)]
        return self._executor.submit(self._cpu_partials, a, work, scale)

    def _cpu_partials(self, a: int, work: list, scale: float) -> tuple[list, float]:
        """In the worker: each group's CPU partial over its host/in-place blocks, and the seconds it took."""
        start = time.perf_counter()
        out = []
        with torch.inference_mode():
            kv_rows = self.host.kv_rows(a)
            for item in work:
                if item is None:
                    out.append(None)
                    continue
                q, part = item
                b, num_q, Hq, D = q.shape
                if num_q == 1 and native.decode_worth_it(q, part.num_keys):
                    out.append(self._native_partial(q.view(b, Hq, D), kv_rows, part, scale))
                    continue
                keys, values = self._gather(kv_rows, part, b)
                out.append(self._partial(q, keys, values, part, scale))
        return out, time.perf_counter() - start

    @staticmethod
    def _native_partial(q: Tensor, kv_rows: tuple[Tensor, Tensor], part: _Part,
                        scale: float) -> tuple[Tensor, Tensor]:
        """A decode group's CPU partial read where the host blocks lie (``native.paged_decode_attention``, with the
        log-sum-exp), as ``_partial`` returns it: each sequence attends its first ``part.lengths`` rows."""
        b, Hq, D = q.shape
        lse = q.new_empty(b, Hq, dtype=torch.float32)
        out = native.paged_decode_attention(q, *kv_rows, part.rows.view(b, part.num_keys), part.lengths, scale,
                                            lse=lse)
        return out.view(b, Hq, 1, D), lse.view(b, Hq, 1)

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
