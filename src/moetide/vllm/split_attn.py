"""vLLM's CPU attention backend with WriteScope's host KV tier (``vllm.host_tier``): registered over ``CPU_ATTN``,
keeping its name, because vLLM's CPU platform returns ``CPU_ATTN`` whatever backend is asked for.

Without a host tier in the process (``host_tier.installed()`` is None) every method is vLLM's own, unchanged. With
one, each step:

* **build** (once per step, the metadata builder): reads each sequence's used blocks from the block table. A step
  in which no sequence uses a host block is vLLM's metadata, unchanged. Otherwise the split policy
  (``engine.split_plan.plan_split_step``, the engine's code on ``core.splits``) gives each sequence with host blocks
  its ``num_cpu_blocks``: its first that many host blocks, in table order, are attended by the CPU where they lie,
  the rest are streamed through the staging ring. The sequences with device blocks only keep vLLM's kernel, over
  metadata of their own (``_stock_subset``). The measured CPU time of the step before goes to the online correction.
* **do_kv_cache_update** (each layer): tokens whose slot is a host slot are written to the host tier; vLLM's write
  kernel writes the rest (``HostTier.write``).
* **forward** (each layer): vLLM's kernel for the device-only sequences; for each other sequence, one partial
  attention per region (its device blocks read through ``BlockOrder``, its CPU blocks in place, its streamed
  blocks through the ring), each with its log-sum-exp, merged exactly (``engine.split_attention``). A decode
  query's CPU blocks are read where they lie by the native paged kernel (``HostTier.decode_partial``); the rest go
  through torch's CPU flash attention. Causal masking is by position, so prefill chunks and decode tokens go the
  same way.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, fields

import torch
from torch import Tensor
from vllm import _custom_ops as ops
from vllm import envs
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadata,
    CPUAttentionMetadataBuilder,
)

from moetide.core.splits import StepSplit
from moetide.engine.split_attention import cpu_partial_attention, lse_attention, merge_partials
from moetide.engine.split_plan import observe_split_step, plan_split_step
from moetide.units import cdiv
from moetide.vllm.host_tier import HostTier, installed


@dataclass(frozen=True)
class _Region:
    kind: str  # "device" (ids into vLLM's tensor), "cpu" or "stream" (host storage indices)
    blocks: Tensor
    mask: Tensor | None  # [1, 1, Q, n · block_size] True = attend; None: every query attends every key
    last_row_keys: int  # keys the last query attends: a prefix of the region's, in position order


@dataclass(frozen=True)
class _Seq:
    start: int  # the sequence's query rows [start, end)
    end: int
    regions: tuple[_Region, ...]


@dataclass(frozen=True)
class _Stock:
    rows: Tensor  # the query rows of the sequences with device blocks only
    metadata: CPUAttentionMetadata  # vLLM's metadata for those sequences alone


@dataclass
class HostStep:
    """One step's plan over a host tier: the split sequences and the rest (module docstring)."""

    seqs: tuple[_Seq, ...]
    stock: _Stock | None
    split: StepSplit


@dataclass
class HostSplitMetadata(CPUAttentionMetadata):
    host_step: HostStep | None = None


class MoetideCPUAttentionBackend(CPUAttentionBackend):
    @staticmethod
    def get_impl_cls() -> type[MoetideCPUAttentionImpl]:
        return MoetideCPUAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[MoetideCPUAttentionBuilder]:
        return MoetideCPUAttentionBuilder


class MoetideCPUAttentionBuilder(CPUAttentionMetadataBuilder):
    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False) -> CPUAttentionMetadata:
        metadata = super().build(common_prefix_len, common_attn_metadata, fast_build)
        tier = installed()
        if tier is None:
            return metadata
        _close_step(tier)
        step = self._plan(tier, metadata, common_attn_metadata.num_reqs)
        if step is None:
            return metadata
        return HostSplitMetadata(**{f.name: getattr(metadata, f.name) for f in fields(metadata)}, host_step=step)

    def _plan(self, tier: HostTier, metadata: CPUAttentionMetadata, num_reqs: int) -> HostStep | None:
        bs, first = tier.storage.layout.block_size, tier.first_host_id
        starts = metadata.query_start_loc[: num_reqs + 1].tolist()
        lengths = metadata.seq_lens[:num_reqs].tolist()
        tables = [metadata.block_table[i, : cdiv(n, bs)] for i, n in enumerate(lengths)]
        on_host = [(t >= first).tolist() for t in tables]
        split = plan_split_step(tier.stepper, tier.counters, on_host, lengths, starts[-1], bs)
        if split is None:
            return None
        tier.pending, tier.step_cpu_s = split, 0.0
        tier.host_blocks_used = sum(sum(flags) for flags in on_host)
        tier.cpu_share = sum(s.num_cpu_blocks for s in split.splits) / tier.host_blocks_used
        seqs, stock = [], []
        for i, s in enumerate(split.splits):
            if not any(on_host[i]):
                stock.append(i)
                continue
            regions = _regions(tables[i], on_host[i], s.num_cpu_blocks, first, bs, lengths[i],
                               starts[i + 1] - starts[i])
            seqs.append(_Seq(starts[i], starts[i + 1], regions))
        return HostStep(tuple(seqs), self._stock_subset(metadata, stock, starts) if stock else None, split)

    def _stock_subset(self, metadata: CPUAttentionMetadata, index: list[int], starts: list[int]) -> _Stock:
        """vLLM's metadata for the sequences ``index`` alone, their queries packed in order."""
        rows = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in index])
        query_lens = torch.tensor([starts[i + 1] - starts[i] for i in index], dtype=metadata.query_start_loc.dtype)
        query_start_loc = torch.zeros(len(index) + 1, dtype=query_lens.dtype)
        torch.cumsum(query_lens, 0, out=query_start_loc[1:])
        picked = torch.tensor(index)
        seq_lens = metadata.seq_lens[picked]
        scheduler_metadata = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=len(index), num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
            seq_lens=seq_lens, dtype=self.dtype, query_start_loc=query_start_loc, causal=metadata.causal,
            sliding_window_size=self.window_size, isa=self.isa, enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV,
            dynamic_causal=None, kv_cache_dtype=self.kv_cache_dtype)
        subset = CPUAttentionMetadata(
            num_actual_tokens=len(rows), max_query_len=int(query_lens.max()), query_start_loc=query_start_loc,
            max_seq_len=int(seq_lens.max()), seq_lens=seq_lens, block_table=metadata.block_table[picked],
            slot_mapping=metadata.slot_mapping, scheduler_metadata=scheduler_metadata, causal=metadata.causal)
        return _Stock(rows, subset)


def _regions(table: Tensor, on_host: list[bool], num_cpu: int, first_host_id: int, block_size: int,
             context: int, num_queries: int) -> tuple[_Region, ...]:
    """A sequence's device, CPU and streamed blocks (table order within each) with their causal masks. For a
    prefill chunk each kind's blocks that every query sees come apart from the rest, so the mask (an additive bias
    of Q x keys) covers only the blocks the chunk overlaps."""
    where = {"device": [], "cpu": [], "stream": []}
    num_host = 0
    for j, host in enumerate(on_host):
        kind = "device" if not host else ("cpu" if num_host < num_cpu else "stream")
        num_host += host
        where[kind].append(j)
    query_pos = torch.arange(context - num_queries, context)
    regions = []
    for kind, positions in where.items():
        parts = [positions]
        if num_queries > 1:  # blocks every query sees, then the ones the chunk overlaps
            parts = [[], []]
            for j in positions:
                parts[(j + 1) * block_size - 1 > context - num_queries].append(j)
        regions += [_region(kind, table, part, first_host_id, block_size, query_pos) for part in parts if part]
    return tuple(regions)


def _region(kind: str, table: Tensor, positions: list[int], first_host_id: int, block_size: int,
            query_pos: Tensor) -> _Region:
    index = torch.tensor(positions)
    blocks = table[index].long() - (first_host_id if kind != "device" else 0)
    key_pos = (index[:, None] * block_size + torch.arange(block_size)).flatten()
    mask = key_pos[None, :] <= query_pos[:, None]
    return _Region(kind, blocks, None if bool(mask.all()) else mask[None, None], int(mask[-1].sum()))


def _close_step(tier: HostTier) -> None:
    """Feed the step before's measured CPU time (all layers) to the counters and the online correction."""
    if tier.pending is not None:
        observe_split_step(tier.stepper, tier.counters, tier.pending, tier.step_cpu_s)
        tier.counters.correction_factor = tier.stepper.correction_factor
        tier.pending = None


class MoetideCPUAttentionImpl(CPUAttentionBackendImpl):
    def do_kv_cache_update(self, layer, key: Tensor, value: Tensor, kv_cache: Tensor, slot_mapping: Tensor) -> None:
        tier = installed()
        if tier is not None and layer.layer_name in tier.layer_index:
            slot_mapping = tier.write(layer.layer_name, key, value, slot_mapping)
        super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)

    def forward(self, layer, query: Tensor, key: Tensor, value: Tensor, kv_cache: Tensor, attn_metadata,
                output: Tensor, output_scale: Tensor | None = None,
                output_block_scale: Tensor | None = None) -> Tensor:
        step = attn_metadata.host_step if isinstance(attn_metadata, HostSplitMetadata) else None
        if step is None:
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                                   output_block_scale)
        if step.stock is not None:
            rows = step.stock.rows
            part = output.new_empty((len(rows), *output.shape[1:]))
            super().forward(layer, query[rows], key, value, kv_cache, step.stock.metadata, part)
            output[rows] = part
        tier = installed()
        out = output.view(output.shape[0], self.num_heads, self.head_size)
        for seq in step.seqs:
            out[seq.start:seq.end] = self._attend(tier, layer.layer_name, query[seq.start:seq.end], kv_cache,
                                                  seq).to(out.dtype)
        return output

    def _attend(self, tier: HostTier, layer_name: str, query: Tensor, kv_cache: Tensor, seq: _Seq) -> Tensor:
        """One sequence's attention over its regions, merged: [Q, H, D]."""
        q = query.view(query.shape[0], self.num_heads, self.head_size).transpose(0, 1)[None]  # [1, H, Q, D]
        partials = []
        for region in seq.regions:
            if region.kind == "device":
                k, v = tier.order.gather(kv_cache, region.blocks)
                partials.append(cpu_partial_attention(q, k[None], v[None], self.scale, region.mask))
            elif region.kind == "cpu":
                began = time.perf_counter()
                partials.append(self._in_place(tier, layer_name, q, region))
                tier.step_cpu_s += time.perf_counter() - began
            else:
                k, v = tier.streamed_kv(layer_name, region.blocks)
                partials.append(lse_attention(q, k[None], v[None], self.scale, region.mask))
        out, _ = merge_partials(partials)
        return out[0].transpose(0, 1)

    def _in_place(self, tier: HostTier, layer_name: str, q: Tensor, region: _Region) -> tuple[Tensor, Tensor]:
        """The CPU's partial over host blocks where they lie: a decode query by the native paged kernel (no copy),
        else torch's CPU flash attention over the blocks gathered."""
        if q.shape[2] == 1:
            partial = tier.decode_partial(layer_name, q, region.blocks, region.last_row_keys, self.scale)
            if partial is not None:
                return partial
        k, v = tier.host_kv(layer_name, region.blocks)
        return cpu_partial_attention(q, k[None], v[None], self.scale, region.mask)
