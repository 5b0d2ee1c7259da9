"""The arena as bytes: ONE tensor of ``num_pages × page_bytes`` on the engine's device, laid out by ``core.arena``.

``core.arena`` keeps the books (which tenant owns each page, which block ids exist, where block ``b`` starts);
this module is the storage backend that carries them out with plain tensors. Nothing here decides anything: a
page's meaning comes from the books alone, so the same bytes are an expert's weights before a conversion and KV
blocks after it, and converting moves no byte (on a GPU, CUDA VMM map/unmap would carry the books out instead;
with one preallocated tensor, relabelling *is* the conversion).

Layouts (all offsets in bytes from the arena's start; ``page_bytes`` is a multiple of every element size):

* **KV block** ``b`` starts at ``arena.block_byte_offset(b)`` and holds ``kv_block_bytes`` bytes::

      [full-attention layer a][k | v][slot 0..block_size-1][kv head][head dim]   (model dtype)

  (MLA, ``KVLayout.values_in_keys``: ``[layer a][slot][1][latent | rope key]``, no V tile: a layer's values are the
  first ``kv_lora_rank`` elements of its keys, read through the same rows), so one layer's K (or V) of one block is a
  contiguous ``[block_size, Hkv, D]`` tile, and a block's position in the arena is (group, slot): ``group = b //
  blocks_per_group`` at ``group × pages_per_block × page_bytes``, ``slot = b % blocks_per_group`` at ``slot ×
  kv_block_bytes`` inside it (``core.arena``'s rule). The same rule as one strided view — ``[num_groups,
  blocks_per_group, A, 2, block_size, Hkv, D]`` — lets attention gather any blocks by (group, slot) index tensors.
  Linear-attention state blocks use the raw byte view (``[num_groups, blocks_per_group, kv_block_bytes]``, see
  ``engine.state``). For reading, each layer's K and V are also one *row* view ``[rows, Hkv, D]`` in which every token
  slot of every block is a row (``kv_rows``, ``key_rows``), so attention gathers a whole step's keys with one
  ``index_select`` per layer.
* **Routed expert** (MoE layer m, expert e) lives in ``arena.home_pages(m, e)`` (consecutive pages): its fused
  ``gate_up`` [2I, H] then ``down`` [H, I], packed with no gap; the pages' tail is padding. Home pages are evenly
  spaced, so all experts of a MoE layer are also one strided view (``stacked_experts``: [E, 2I, H] and
  [E, H, I]) for the grouped expert GEMMs; an offloaded expert's rows in it hold KV bytes. Shared experts, dense
  MLPs, attention and embeddings are ordinary model parameters outside the arena: they are never offloaded.

The arena is zero-filled once at start, so a block that was never written reads as zeros (attention still
masks every slot past a sequence's context, and zeroes those values, because recycled pages hold stale bytes
of any kind — old KV, expert weights, fp32 state read as bf16).
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass

import torch
from torch import Tensor

from moetide.core.arena import DEFAULT_PAGE_BYTES, Arena, ArenaConfig
from moetide.engine.models import ExpertWeights, MoECausalLM
from moetide.engine.models.common import SparseMoE

MIN_PAGE_BYTES = 4096


def dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class KVLayout:
    """Geometry of one KV block. ``attn_layer_ids`` are the model's full-attention layers, in block order.
    ``values_in_keys``: a token stores one vector per layer that attention reads as its key and (a prefix of it)
    as its value — MLA's compressed latent plus rope key (``MoECausalLM.kv_cache_shape``) — so a block holds no
    V tile and the V views are the K views."""

    attn_layer_ids: tuple[int, ...]
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    values_in_keys: bool = False

    @property
    def tiles_per_layer(self) -> int:
        """K and V, or the K tile alone (``values_in_keys``)."""
        return 1 if self.values_in_keys else 2

    @property
    def bytes_per_token(self) -> int:
        return (len(self.attn_layer_ids) * self.tiles_per_layer * self.num_kv_heads * self.head_dim
                * dtype_bytes(self.dtype))

    @property
    def block_bytes(self) -> int:
        return self.block_size * self.bytes_per_token

    @classmethod
    def of(cls, model: MoECausalLM, block_size: int) -> KVLayout:
        attn = tuple(i for i, layer in enumerate(model.layers) if layer.is_full_attention)
        num_kv_heads, head_dim, values_in_keys = model.kv_cache_shape()
        return cls(attn, block_size, num_kv_heads, head_dim, model.embed_tokens.weight.dtype, values_in_keys)


@dataclass(frozen=True)
class ExpertLayout:
    """Geometry of one routed expert; ``moe_layer_ids[m]`` is the model layer of arena/residency MoE layer m."""

    moe_layer_ids: tuple[int, ...]
    num_experts: int
    hidden_size: int
    intermediate_size: int
    dtype: torch.dtype

    @property
    def gate_up_numel(self) -> int:
        return 2 * self.intermediate_size * self.hidden_size

    @property
    def numel(self) -> int:
        return 3 * self.intermediate_size * self.hidden_size

    @property
    def expert_bytes(self) -> int:
        return self.numel * dtype_bytes(self.dtype)

    def weights(self, flat: Tensor) -> ExpertWeights:
        """Views of one packed expert (``flat``: [numel] in the model dtype)."""
        gate_up = flat[: self.gate_up_numel].view(2 * self.intermediate_size, self.hidden_size)
        down = flat[self.gate_up_numel : self.numel].view(self.hidden_size, self.intermediate_size)
        return ExpertWeights(gate_up, down)

    @classmethod
    def of(cls, model: MoECausalLM) -> ExpertLayout:
        moe = tuple(i for i, layer in enumerate(model.layers) if isinstance(layer.mlp, SparseMoE))
        config = model.config
        return cls(moe, config.num_experts, config.hidden_size, config.moe_intermediate_size,
                   model.embed_tokens.weight.dtype)


def default_page_bytes(expert_bytes: int) -> int:
    """2 MiB (the CUDA VMM granularity), or for experts smaller than that the next power of two above one expert
    (at least 4 KiB), so a tiny test model's arena is not 99% padding. The books are the same either way."""
    page = MIN_PAGE_BYTES
    while page < expert_bytes and page < DEFAULT_PAGE_BYTES:
        page *= 2
    return page


def arena_config(kv: KVLayout, experts: ExpertLayout, kv_budget_bytes: int, page_bytes: int) -> ArenaConfig:
    """Every routed expert resident in its home pages, then ``kv_budget_bytes // page_bytes`` KV pages."""
    elt = max(dtype_bytes(kv.dtype), dtype_bytes(experts.dtype), 4)
    if page_bytes % elt or kv.block_bytes % dtype_bytes(kv.dtype):
        raise ValueError(f"page_bytes={page_bytes} must be a multiple of {elt}")
    return ArenaConfig(kv_block_bytes=kv.block_bytes, expert_bytes=experts.expert_bytes,
                       num_layers=len(experts.moe_layer_ids), num_experts=experts.num_experts,
                       num_kv_pages=kv_budget_bytes // page_bytes, page_bytes=page_bytes)


HUGE_PAGE_MIN_BYTES = 4 << 20  # below this a mapping holds no 2 MiB page worth asking for


def host_zeros(nbytes: int) -> Tensor:
    """A zeroed uint8 CPU tensor of ``nbytes`` (storage offset 0) for memory the kernels stream through: from an
    anonymous mapping advised for transparent huge pages where the OS offers them (Linux's ``madvise`` mode, this
    machine's default), so reading weights and KV front to back misses the TLB every 2 MiB, not every 4 KiB
    (Mixtral-shaped experts from memory, 8 and 32 tokens: 4-13% faster a layer). Elsewhere, or small, torch.zeros.
    Every page is touched here, as torch.zeros touches its memory (and vLLM its KV cache at start-up): else the
    kernel would fault and zero each page on its first write, inside a step."""
    if nbytes < HUGE_PAGE_MIN_BYTES or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.zeros(nbytes, dtype=torch.uint8)
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # zero-filled by the kernel
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # THP off or unsupported: ordinary pages, same contents
        pass
    data = torch.frombuffer(mapping, dtype=torch.uint8)  # the tensor keeps the mapping alive
    data[:: mmap.PAGESIZE].zero_()  # one write a page: faulted in now (a huge page at its first byte)
    return data


class ArenaStorage:
    """The arena tensor and its typed views. See the module docstring for the byte layout."""

    def __init__(self, arena: Arena, kv: KVLayout, experts: ExpertLayout, device: torch.device | str) -> None:
        cfg = arena.config
        self.arena, self.kv_layout, self.expert_layout = arena, kv, experts
        self.device = torch.device(device)
        nbytes = cfg.num_pages * cfg.page_bytes
        self.data = (host_zeros(nbytes) if self.device.type == "cpu"
                     else torch.zeros(nbytes, dtype=torch.uint8, device=self.device))
        group_bytes = cfg.pages_per_block * cfg.page_bytes
        self.block_bytes_view = self.data.as_strided(  # [G, bpg, kv_block_bytes]
            (cfg.num_groups, cfg.blocks_per_group, cfg.kv_block_bytes), (group_bytes, cfg.kv_block_bytes, 1))
        self._kv_views = self._build_kv_views(cfg, kv)
        self._row_unit, self._kv_rows = self._build_kv_rows(cfg, kv)
        unit_bytes = self._row_unit * dtype_bytes(kv.dtype)
        self._row_geometry = (cfg.blocks_per_group, group_bytes // unit_bytes, cfg.kv_block_bytes // unit_bytes)
        self._stacked_experts = [self._build_stacked_experts(cfg, experts, m)
                                 for m in range(len(experts.moe_layer_ids))]

    def _build_kv_views(self, cfg: ArenaConfig, kv: KVLayout) -> list[tuple[Tensor, Tensor]]:
        """Per full-attention layer a, (K, V) views [G, bpg, block_size, Hkv, D] over every block position."""
        elt = dtype_bytes(kv.dtype)
        return layer_kv_views(self.data.view(kv.dtype), kv, (cfg.num_groups, cfg.blocks_per_group),
                              (cfg.pages_per_block * cfg.page_bytes // elt, cfg.kv_block_bytes // elt))

    def _build_kv_rows(self, cfg: ArenaConfig, kv: KVLayout) -> tuple[int, list[tuple[Tensor, Tensor]]]:
        """Per full-attention layer a, (K, V) as read views [rows, Hkv, D] with u = gcd(group stride, block
        stride, Hkv·D), so every token slot of every block starts on a row (``layer_kv_rows``)."""
        elt = dtype_bytes(kv.dtype)
        unit = math.gcd(cfg.pages_per_block * cfg.page_bytes // elt, cfg.kv_block_bytes // elt,
                        kv.num_kv_heads * kv.head_dim)
        return unit, layer_kv_rows(self.data.view(kv.dtype), kv, unit)

    def _build_stacked_experts(self, cfg: ArenaConfig, experts: ExpertLayout, m: int) -> tuple[Tensor, Tensor]:
        """(gate_up [E, 2I, H], down [E, H, I]) of MoE layer m over every expert's home pages (expert e's pages
        start ``pages_per_expert`` pages after expert e-1's: ``core.arena``'s rule)."""
        elt, typed = dtype_bytes(experts.dtype), self.data.view(experts.dtype)
        step, base = cfg.pages_per_expert * cfg.page_bytes // elt, m * cfg.num_experts
        E, I, H = experts.num_experts, experts.intermediate_size, experts.hidden_size
        gate_up = typed.as_strided((E, 2 * I, H), (step, H, 1), storage_offset=base * step)
        down = typed.as_strided((E, H, I), (step, I, 1), storage_offset=base * step + experts.gate_up_numel)
        return gate_up, down

    # ---- KV -----------------------------------------------------------------------------------------------
    def kv_rows(self, attn_index: int) -> tuple[Tensor, Tensor]:
        """(K, V) read views [rows, Hkv, D] of full-attention layer ``attn_index`` (see ``key_rows``)."""
        return self._kv_rows[attn_index]

    def key_rows(self, block_ids: list[int]) -> list[int]:
        """The ``kv_rows`` row of each block's slot 0 (slot o is ``row_step`` × o rows further)."""
        bpg, group_rows, slot_rows = self._row_geometry
        return [b // bpg * group_rows + b % bpg * slot_rows for b in block_ids]

    @property
    def row_step(self) -> int:
        kv = self.kv_layout
        return kv.num_kv_heads * kv.head_dim // self._row_unit

    def kv_views(self, attn_index: int) -> tuple[Tensor, Tensor]:
        """(K, V) of full-attention layer ``attn_index`` (position in ``KVLayout.attn_layer_ids``)."""
        return self._kv_views[attn_index]

    def block_coords(self, block_ids: list[int]) -> tuple[Tensor, Tensor]:
        """(group, slot) of each block id, two int64 [n] on the device: the first two indices of every view here."""
        ids, bpg = torch.tensor(block_ids, dtype=torch.long), self.arena.config.blocks_per_group
        return (ids // bpg).to(self.device), (ids % bpg).to(self.device)

    def kv_block(self, block_id: int) -> Tensor:
        """The raw bytes of one KV block (a view)."""
        offset = self.arena.block_byte_offset(block_id)
        return self.data[offset : offset + self.arena.config.kv_block_bytes]

    def kv_checksum(self, block_ids: list[int]) -> int:
        """A position-sensitive checksum of the blocks' bytes, in the order given (detects moved bytes)."""
        if not block_ids:
            return 0
        raw = torch.cat([self.kv_block(b) for b in block_ids]).to(torch.int64)
        weights = torch.arange(raw.numel(), device=raw.device, dtype=torch.int64) % 65_521 + 1
        return int((raw * weights).sum())

    # ---- experts ------------------------------------------------------------------------------------------
    def expert_flat(self, moe_index: int, expert_id: int) -> Tensor:
        """The packed expert in its home pages, as [numel] of the model dtype (a view)."""
        layout = self.expert_layout
        start = self.arena.home_pages(moe_index, expert_id).start * self.arena.config.page_bytes
        return self.data[start : start + layout.expert_bytes].view(layout.dtype)

    def expert_weights(self, moe_index: int, expert_id: int) -> ExpertWeights:
        """Views of a resident expert's weights in its home pages (garbage once its pages are KV)."""
        return self.expert_layout.weights(self.expert_flat(moe_index, expert_id))

    def stacked_experts(self, moe_index: int) -> tuple[Tensor, Tensor]:
        """Views (gate_up [E, 2I, H], down [E, H, I]) of every expert of a MoE layer in its home pages (an
        offloaded expert's rows are KV bytes)."""
        return self._stacked_experts[moe_index]

    def store_expert(self, moe_index: int, expert_id: int, packed: Tensor) -> None:
        """Write a packed expert ([numel], any device) into its home pages."""
        self.expert_flat(moe_index, expert_id).copy_(packed)


def layer_kv_views(typed: Tensor, kv: KVLayout, lead_size: tuple[int, ...],
                   lead_stride: tuple[int, ...]) -> list[tuple[Tensor, Tensor]]:
    """Per full-attention layer a, (K, V) views [*lead_size, block_size, Hkv, D] of ``typed`` (the storage in the KV
    dtype), one block per position of the leading dims (``lead_stride`` elements apart), in the per-block layout
    ``[layer a][k | v][slot][kv head][head dim]`` (V is K where ``values_in_keys``)."""
    tile = kv.block_size * kv.num_kv_heads * kv.head_dim  # elements of one layer's K (or V) in one block
    size = (*lead_size, kv.block_size, kv.num_kv_heads, kv.head_dim)
    stride = (*lead_stride, kv.num_kv_heads * kv.head_dim, kv.head_dim, 1)
    views = []
    for a in range(len(kv.attn_layer_ids)):
        k = typed.as_strided(size, stride, storage_offset=kv.tiles_per_layer * a * tile)
        v = k if kv.values_in_keys else typed.as_strided(size, stride, storage_offset=(2 * a + 1) * tile)
        views.append((k, v))
    return views


def layer_kv_rows(typed: Tensor, kv: KVLayout, unit: int) -> list[tuple[Tensor, Tensor]]:
    """Per full-attention layer a, (K, V) as read views [rows, Hkv, D] of ``typed``: row r starts r·``unit``
    elements after the layer's first tile. Rows overlap when ``unit`` < Hkv·D: read only (attention gathers keys
    with one ``index_select``); otherwise the native decode kernel also writes a token's new K/V through them."""
    width, tile = kv.num_kv_heads * kv.head_dim, kv.block_size * kv.num_kv_heads * kv.head_dim
    views = []
    for a in range(len(kv.attn_layer_ids)):
        pair = []
        for offset in ((a * tile,) if kv.values_in_keys else (2 * a * tile, (2 * a + 1) * tile)):
            rows = max(0, (typed.numel() - offset - width) // unit + 1)
            pair.append(typed.as_strided((rows, kv.num_kv_heads, kv.head_dim), (unit, kv.head_dim, 1),
                                         storage_offset=offset))
        views.append((pair[0], pair[-1]))
    return views


def pack_experts(model: MoECausalLM, layout: ExpertLayout, pin: bool) -> Tensor:
    """Host copy of every routed expert: [M, E, numel] in the model dtype on the CPU (pinned when ``pin``), each
    row ``gate_up.flatten() ++ down.flatten()`` — the same packing as the home pages, so staging is one copy.
    Moves the experts out of the model: each layer's stacked parameters are dropped once copied, so host memory
    never holds more than the copy plus one layer's originals."""
    host = torch.empty(len(layout.moe_layer_ids), layout.num_experts, layout.numel, dtype=layout.dtype,
                       pin_memory=pin)
    for m, layer_id in enumerate(layout.moe_layer_ids):
        experts = model.layers[layer_id].mlp.experts
        host[m, :, : layout.gate_up_numel].copy_(experts.gate_up_proj.detach().reshape(layout.num_experts, -1))
        host[m, :, layout.gate_up_numel :].copy_(experts.down_proj.detach().reshape(layout.num_experts, -1))
        empty = torch.empty(0, dtype=layout.dtype, device=experts.gate_up_proj.device)
        experts.gate_up_proj = torch.nn.Parameter(empty, requires_grad=False)
        experts.down_proj = torch.nn.Parameter(empty.clone(), requires_grad=False)
    return host
