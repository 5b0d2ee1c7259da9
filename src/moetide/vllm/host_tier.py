"""WriteScope's host KV tier inside vLLM: KV blocks past the device KV cache, in host memory, attended in place.

One block pool. The scheduler's ``BlockPool`` holds ``num_host_blocks`` ids after the device's (``extend`` in
``vllm.plugin``: only the scheduler's KV config gains them; every worker allocates the device KV exactly as vLLM
sizes it). vLLM's free queue starts in id order, so device blocks are handed out first and host blocks once the
device ones are gone. An id says where a block lives for good: below ``first_host_id`` in vLLM's KV tensors, at or
above it in ``HostKVStorage`` (``engine.host_kv``: the layout moetide's engine spills to, which the CPU attends
where it lies and the accelerator reads unchanged when a block is streamed). A block's residency is fixed when it
is written; nothing is ever copied to change it.

Ids in this module are the attention kernel's blocks (``first_host_id`` is the device KV tensor's block count).

Reading vLLM's device blocks. vLLM's CPU attention keeps a block's K and V in an order of its own that depends on
the ISA it picked (``vec`` stores K transposed; ``amx`` packs tiles). ``BlockOrder.probe`` asks vLLM's own write
kernel where each (token, dim) element lands, so no layout is assumed, and ``BlockOrder.check`` writes random K/V
through the same kernel and reads them back: the tier refuses to start where the two disagree. The device part of
a sequence that also has host blocks is gathered through that order and attended with torch's CPU flash attention,
which returns the log-sum-exp the merge needs (vLLM's kernel returns none).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from moetide.core.splits import StepSplit
from moetide.engine import native
from moetide.engine.host_kv import HostKVStorage, StagingRing
from moetide.engine.split_plan import SplitCounters, SplitStepper
from moetide.engine.storage import KVLayout

_INSTALLED: HostTier | None = None


def num_host_blocks(kv_host_memory: int, block_bytes: int, world_size: int) -> int:
    """Whole blocks of ``block_bytes`` per rank (one block id over every layer of a rank) that ``kv_host_memory``
    bytes over ``world_size`` ranks hold: what the scheduler's pool gains and each worker allocates."""
    if kv_host_memory <= 0:
        return 0
    return kv_host_memory // (block_bytes * world_size)


@dataclass(frozen=True)
class BlockOrder:
    """Where vLLM's CPU attention keeps each element of a block: for one (block, KV head), vLLM's K then V occupy
    ``2 · block_size · head_dim`` elements; ``index[e]`` is where element e of [K | V] as [k|v][token][dim] is."""

    index: Tensor  # [2 · block_size · head_dim] int64
    block_size: int
    head_dim: int

    @classmethod
    def probe(cls, isa: str, dtype: torch.dtype, block_size: int, head_dim: int) -> BlockOrder:
        """Write tokens whose K holds its token number and V its dim (then the other way round) through vLLM's
        ``cpu_attn_reshape_and_cache``, and read where each landed (integers below 257 are exact in bf16)."""
        from vllm import _custom_ops as ops

        if max(block_size, head_dim) > 256:
            raise ValueError(f"moetide's host KV tier: block size {block_size} or head dim {head_dim} over 256")
        n = block_size * head_dim
        token = torch.arange(block_size, dtype=torch.float32)[:, None, None].expand(block_size, 1, head_dim)
        dim = torch.arange(head_dim, dtype=torch.float32)[None, None, :].expand(block_size, 1, head_dim)
        seen = []
        for k, v in ((token, dim), (dim, token)):
            cache = torch.full((1, 1, 2 * block_size, head_dim), -1.0, dtype=dtype)
            key_cache, value_cache = cache.chunk(2, dim=2)
            ops.cpu_attn_reshape_and_cache(k.to(dtype).contiguous(), v.to(dtype).contiguous(), key_cache,
                                           value_cache, torch.arange(block_size), isa)
            seen.append(cache.flatten().long())
        element = torch.cat([seen[0][:n] * head_dim + seen[1][:n], n + seen[1][n:] * head_dim + seen[0][n:]])
        if not torch.equal(element.sort().values, torch.arange(2 * n)):
            raise RuntimeError(f"moetide's host KV tier: vLLM's CPU KV layout (isa {isa}, {dtype}) is not a "
                               f"permutation of each block's elements; the tier cannot read it")
        index = torch.empty_like(element)
        index[element] = torch.arange(2 * n)
        return cls(index, block_size, head_dim)

    def gather(self, kv_cache: Tensor, blocks: Tensor) -> tuple[Tensor, Tensor]:
        """(K, V) of ``blocks`` (ids into vLLM's layer tensor ``kv_cache``, [num_blocks, Hkv, block_size, 2·D]) in
        table order: [Hkv, len(blocks) · block_size, D] each."""
        num_blocks, heads = kv_cache.shape[0], kv_cache.shape[1]
        flat = kv_cache.view(num_blocks, heads, -1)[blocks][..., self.index]  # [n, Hkv, 2·bs·D], [k|v][t][d]
        kv = flat.view(len(blocks), heads, 2, self.block_size, self.head_dim).permute(2, 1, 0, 3, 4)
        kv = kv.reshape(2, heads, len(blocks) * self.block_size, self.head_dim)
        return kv[0], kv[1]

    def check(self, isa: str, dtype: torch.dtype, num_kv_heads: int) -> None:
        """Write random K/V to scattered slots of a small cache through vLLM's kernel and read them back through
        ``gather``; raise in one line where they differ."""
        from vllm import _custom_ops as ops

        bs, dim = self.block_size, self.head_dim
        generator = torch.Generator().manual_seed(0)
        cache = torch.zeros(3, num_kv_heads, 2 * bs, dim, dtype=dtype)
        slots = torch.randperm(3 * bs, generator=generator)
        k, v = (torch.randn(3 * bs, num_kv_heads, dim, generator=generator).to(dtype) for _ in range(2))
        key_cache, value_cache = cache.chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slots, isa)
        got_k, got_v = self.gather(cache, torch.arange(3))
        order = slots.argsort()  # slot s holds token order[s]
        if not (torch.equal(got_k, k[order].transpose(0, 1)) and torch.equal(got_v, v[order].transpose(0, 1))):
            raise RuntimeError(f"moetide's host KV tier: vLLM's CPU KV layout (isa {isa}, {dtype}) does not read back "
                               f"as probed; the tier cannot read device blocks")


class HostTier:
    """One worker's host tier: the host blocks, the order vLLM keeps device blocks in, the step's split policy
    and what it counted. ``layer_index`` maps an attention layer's name to its index in the host block layout."""

    def __init__(self, layout: KVLayout, layer_names: list[str], num_blocks: int, first_host_id: int,
                 order: BlockOrder, stepper: SplitStepper, *, pin: bool) -> None:
        self.storage = HostKVStorage(layout, num_blocks, first_host_id, pin=pin)
        self.first_host_id = first_host_id
        self.layer_index = {name: a for a, name in enumerate(layer_names)}
        self.order, self.stepper = order, stepper
        self.ring = StagingRing(torch.device("cpu"))
        self.counters = SplitCounters()
        self.host_blocks_written = 0  # blocks whose first slot was written on the host
        self.host_blocks_used = 0  # host blocks the last step with any attended
        self._reported_written = 0  # host_blocks_written at the last ``take_step_stats``
        self.cpu_share = 0.0  # of the host blocks the last split step attended, the share the CPU attended in place
        self.pending: StepSplit | None = None  # the split of the step under way, closed when the next is built
        self.step_cpu_s = 0.0  # its CPU partials' time so far, all layers

    def write(self, layer_name: str, key: Tensor, value: Tensor, slot_mapping: Tensor) -> Tensor:
        """Write the tokens whose slots are host slots into the host blocks; return ``slot_mapping`` with those
        slots as -1 (vLLM's padding slot, which its write kernel skips) for vLLM's write of the rest."""
        bs = self.storage.layout.block_size
        first_slot = self.first_host_id * bs
        host = slot_mapping >= first_slot
        if not bool(host.any()):
            return slot_mapping
        tokens = host.nonzero().squeeze(1)
        slots = slot_mapping[tokens] - first_slot
        block, offset = slots // bs, slots % bs
        a = self.layer_index[layer_name]
        k_view, v_view = self.storage.kv_views(a)
        k_view.index_put_((block, offset), key[tokens].to(k_view.dtype))
        v_view.index_put_((block, offset), value[tokens].to(v_view.dtype))
        if a == 0:
            self.host_blocks_written += int((offset == 0).sum())
            self.counters.host_tokens_written += len(tokens)
        return torch.where(host, torch.full_like(slot_mapping, -1), slot_mapping)

    def host_kv(self, layer_name: str, blocks: Tensor) -> tuple[Tensor, Tensor]:
        """(K, V) of host ``blocks`` (storage indices), attended where they lie: [Hkv, n · block_size, D] each."""
        k_view, v_view = self.storage.kv_views(self.layer_index[layer_name])
        return tuple(view[blocks].flatten(0, 1).transpose(0, 1) for view in (k_view, v_view))

    def decode_partial(self, layer_name: str, q: Tensor, blocks: Tensor, num_keys: int,
                       scale: float) -> tuple[Tensor, Tensor] | None:
        """One decode query's partial over host ``blocks`` (storage indices, table order) read where they lie, by
        the native paged kernel: (out [1, Hq, 1, D] fp32, lse [1, Hq, 1]) over their first ``num_keys`` keys; None
        where that kernel does not take it (``cpu_partial_attention`` over ``host_kv`` then)."""
        _, num_heads, _, head_dim = q.shape
        if not native.decode_worth_it(q, num_keys, native.EXPERT_DTYPES):
            return None
        k_rows, v_rows = self.storage.kv_rows(self.layer_index[layer_name])
        if q.dtype != k_rows.dtype:
            return None
        rows = self._rows(blocks)
        lse = torch.empty(1, num_heads, dtype=torch.float32)
        out = native.paged_decode_attention(q.reshape(1, num_heads, head_dim), k_rows, v_rows, rows[None],
                                            torch.tensor([num_keys]), scale, lse=lse, fp32_out=True)
        return out.view(1, num_heads, 1, head_dim), lse.view(1, num_heads, 1)

    def _rows(self, blocks: Tensor) -> Tensor:
        """The ``kv_rows`` rows of every slot of host ``blocks`` (storage indices), in order."""
        starts = torch.tensor(self.storage.key_rows((blocks + self.first_host_id).tolist()))
        return (starts[:, None] + torch.arange(self.storage.layout.block_size)).flatten()

    def streamed_kv(self, layer_name: str, blocks: Tensor) -> tuple[Tensor, Tensor]:
        """(K, V) of host ``blocks`` (storage indices) through the staging ring, as an accelerator receives them:
        [Hkv, n · block_size, D] each."""
        k_rows, v_rows = self.storage.kv_rows(self.layer_index[layer_name])
        k, v = self.ring.stage(k_rows, v_rows, self._rows(blocks))
        return k.transpose(0, 1), v.transpose(0, 1)

    def take_step_stats(self) -> dict[str, float | int]:
        """What ``vllm.metrics`` reports for this worker since the last call: blocks written to the host (a
        counter) and, as gauges, the host blocks the last step attended, the CPU's share of them and writescope's
        correction factor."""
        written, self._reported_written = self.host_blocks_written - self._reported_written, self.host_blocks_written
        return {"kv_host_blocks_written": written, "kv_host_blocks_used": self.host_blocks_used,
                "kv_host_cpu_share": self.cpu_share, "kv_host_correction_factor": self.stepper.correction_factor}

    def stats(self) -> dict:
        return {"host_blocks": self.storage.num_blocks, "host_blocks_written": self.host_blocks_written,
                "host_blocks_used": self.host_blocks_used, "split_policy": self.stepper.name,
                "correction_factor": self.stepper.correction_factor, **self.counters.as_dict()}


def install(tier: HostTier | None) -> None:
    """Make ``tier`` this process's host tier (a worker's, built with its KV cache; None: none, stock)."""
    global _INSTALLED
    _INSTALLED = tier


def installed() -> HostTier | None:
    """This process's host tier, or None: the attention backend then runs vLLM's own path, unchanged."""
    return _INSTALLED


def build(vllm_config, settings, kv_cache_config, kv_caches: dict[str, Tensor]) -> HostTier:
    """The host tier of one worker whose device KV vLLM has just allocated (``kv_caches``, layer name -> vLLM's
    tensor); raises ``ValueError`` in one line for a model or mode it does not serve."""
    from pathlib import Path

    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from moetide.engine.split_plan import PerfSplitCosts
    from moetide.specs import get_gpu
    from moetide.specs.loader import host_for
    from moetide.vllm.line import kv_block_bytes

    _refuse(vllm_config, kv_cache_config, FullAttentionSpec)
    names = list(kv_cache_config.kv_cache_groups[0].layer_names)
    first = kv_caches[names[0]]
    first_host_id, heads, kernel_bs, head_dim = first.shape[0], first.shape[1], first.shape[2], first.shape[3] // 2
    spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
    world = vllm_config.parallel_config.tensor_parallel_size
    blocks = num_host_blocks(settings.kv_host_memory, kv_block_bytes(kv_cache_config), world)
    dtype = first.dtype
    isa = _get_attn_isa(dtype, kernel_bs, head_dim, vllm_config.cache_config.cache_dtype)
    order = BlockOrder.probe(isa, dtype, kernel_bs, head_dim)
    order.check(isa, dtype, heads)
    layout = KVLayout(tuple(range(len(names))), kernel_bs, heads, head_dim, dtype)
    gpu = settings.split_gpu
    costs = PerfSplitCosts(Path(vllm_config.model_config.model), gpu=gpu, host=host_for(None, get_gpu(gpu)),
                           kv_dtype_bytes=dtype.itemsize, block_size=kernel_bs)
    stepper = SplitStepper(settings.split_policy, costs, layout.block_bytes, settings.split_fixed_ratio)
    return HostTier(layout, names, blocks * (spec.block_size // kernel_bs), first_host_id, order, stepper, pin=False)


def _refuse(vllm_config, kv_cache_config, full_attention) -> None:
    """Raise in one line where the host tier cannot serve this model or mode."""
    from vllm.platforms import current_platform

    where = "moetide: kv_host_memory (a host KV tier)"
    if current_platform.device_type != "cpu":
        raise ValueError(f"{where} runs on vLLM's CPU build only so far, not {current_platform.device_type}: drop "
                         f"kv_host_memory")
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1 or type(groups[0].kv_cache_spec) is not full_attention:
        kinds = ", ".join(type(g.kv_cache_spec).__name__ for g in groups)
        raise ValueError(f"{where} serves models whose every layer is full attention (one KV cache group); this "
                         f"model's groups are {kinds}: drop kv_host_memory")
    if vllm_config.cache_config.cache_dtype not in ("auto", None):
        raise ValueError(f"{where} keeps KV in the model's dtype, not --kv-cache-dtype "
                         f"{vllm_config.cache_config.cache_dtype}: leave it out")
    if kv_cache_config.needs_kv_cache_zeroing:
        raise ValueError(f"{where} does not zero host blocks, which this model's KV cache needs: drop "
                         f"kv_host_memory")
    spec = groups[0].kv_cache_spec
    if spec.sliding_window is not None or spec.attention_chunk_size or spec.non_causal:
        raise ValueError(f"{where} attends every earlier key, not a sliding window, chunks or non-causal "
                         f"attention: drop kv_host_memory")
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention import Attention

    from moetide.vllm.split_attn import MoetideCPUAttentionImpl

    for name, layer in get_layers_from_vllm_config(vllm_config, Attention, groups[0].layer_names).items():
        impl = layer.impl
        if not isinstance(impl, MoetideCPUAttentionImpl):
            raise ValueError(f"{where}: layer {name} runs {type(impl).__name__}, not moetide's CPU attention "
                             f"(was MOETIDE_VLLM_DISABLE set in a worker?)")
        if impl.alibi_slopes is not None or impl.sinks is not None or impl.logits_soft_cap:
            raise ValueError(f"{where}: layer {name} uses ALiBi, attention sinks or a logit soft cap, which the "
                             f"host tier's attention does not: drop kv_host_memory")
