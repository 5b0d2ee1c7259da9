"""Assembling an engine: the model, the arena and its storage, and the core objects that decide everything.

Order matters for one invariant — *the pool holds exactly the arena's KV block ids* (``Arena.attach_pool``):
the pool is built from ``arena.kv_block_ids()`` and attached before anything converts pages, so every expert
region converted later (static offload here, ``OffloadExperts`` actions at run time) adds its blocks to the pool
through the arena. Expert weights are copied into their home pages and into a host copy (pinned on CUDA), and the
model's own stacked expert parameters are dropped, so each routed expert exists once on the device.

Budget: ``kv_budget_bytes`` buys whole KV pages *on top of* the routed experts' pages (the experts are the
weights every engine must hold anyway; offloading them is how the KV share grows). A budget that leaves no room
for a single KV block, a missing model directory, an unknown policy or device are ``UserError``s.

``vamp`` / ``vamp-reclaim`` by name get ``engine.vamp``'s coefficients (a cost record measured once at build, or
given; per-expert touch rates); they need ``max_offload_ratio`` > 0 (0.15 by default, as in the replay).

Host KV (``kv_host_bytes`` > 0, WriteScope's engine half): that many bytes of whole KV blocks in host memory
(``engine.host_kv``; pinned on CUDA), numbered after every arena id and added to the same pool, which allocates
device blocks first (``BlockPool(host_tier=...)``); the arena sees only its own ids. Attention is then the
split backend (``engine.split_backend``) under the named split policy, on ``perf``'s costs for ``split_gpu`` and
``cpu`` (``None``: ``split_gpu``'s host; or a ``split_costs`` callable). With host KV the device KV budget may be
0: every block is a host
block. Without it nothing changes: the paged backend, the arena's blocks only.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from moetide.core.arena import Arena
from moetide.core.blocks import BlockPool, HostTier
from moetide.core.expert_line import ArenaLayout, ExpertLine
from moetide.core.config import ServingConfig, build_scheduler, expert_residency, make_policy
from moetide.core.experts import ExpertResidency
from moetide.core.kv_manager import KVCacheManager
from moetide.core.mamba_states import MambaStates
from moetide.core.pressure import PressurePolicy, VampParams, policy_entry
from moetide.core.scheduler import Scheduler
from moetide.engine.attention import PagedAttentionBackend
from moetide.engine.defaults import ENGINE_DEFAULTS
from moetide.engine.experts import StagedExpertProvider
from moetide.engine.host_kv import ArenaPoolView, HostKVStorage
from moetide.engine.loader import load_model
from moetide.engine.models import LinearStateShape, MoECausalLM
from moetide.engine.split_backend import SplitAttentionBackend
from moetide.core.splits import DEFAULT_SPLIT_GPU
from moetide.engine.split_plan import PerfSplitCosts, SplitCostSource, SplitStepper
from moetide.engine.state import BlockLinearStateStore, StateLayout
from moetide.engine.storage import (
    ArenaStorage,
    ExpertLayout,
    KVLayout,
    arena_config,
    default_page_bytes,
    dtype_bytes,
    pack_experts,
)
from moetide.core.pressure.step_costs import EngineCosts, engine_vamp_params
from moetide.engine.vamp import EngineStepStats, measure_costs
from moetide.errors import UserError
from moetide.perf.budget import DEFAULT_BLOCK_SIZE, page_aligned_block_size
from moetide.specs import get_gpu, host_for
from moetide.units import cdiv

DEVICES = ("cpu", "cuda")
# An expert computed on the host costs ~rows x 2 x params / F there; staging it costs ~bytes / link. With bf16
# weights (2 bytes a parameter) they break even at rows ~ F / link: ~36 for a socket's ~1.8 TFLOP/s (half its fp32
# FMA peak, perf.staging's assumption) against ~50 GB/s of PCIe Gen5.
COLD_EXPERT_MAX_ROWS = 32


# vLLM's start-up resolution of ServingConfig's hardware defaults, for this engine (room for a test model's
# sessions; vLLM's block size; its default batch limits on H100-class GPUs)


@dataclass(frozen=True)
class EngineConfig(ServingConfig):
    """``ServingConfig``'s options (``None`` resolved by ``ENGINE_DEFAULTS``; ``enable_prefix_caching=None``: on,
    as vLLM 0.32, hybrid models included unless beside host KV: ``_caching``) and what only the engine has: the
    device, the dtype (``None``: config.json's), its pages (``None``: ``storage.default_page_bytes``), and with host
    KV the ``split_gpu`` / ``cpu`` presets or files the split's costs come from (``cpu=None``: ``split_gpu``'s
    host). ``static_offload`` offloads the cap before the first request whatever the policy."""

    device: str = "cpu"
    dtype: str | None = None
    static_offload: bool = False
    page_bytes: int | None = None
    ignore_eos: bool = False
    split_gpu: str = DEFAULT_SPLIT_GPU
    cpu: str | None = None
    # offloaded experts routed at most this many rows are computed from their host copy with cold_experts "cpu"
    # (engine.experts)
    cold_expert_max_rows: int = COLD_EXPERT_MAX_ROWS

    def __post_init__(self) -> None:
        for name, default in ENGINE_DEFAULTS.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, default)
        super().__post_init__()
        if self.device not in DEVICES:
            raise ValueError(f"EngineConfig.device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if self.static_offload and self.max_offload_ratio == 0.0:
            raise ValueError("EngineConfig.static_offload needs EngineConfig.max_offload_ratio > 0 (the share of "
                             "expert bytes to offload)")
        if self.page_bytes is not None and (self.page_bytes < 64 or self.page_bytes & (self.page_bytes - 1)):
            raise ValueError(f"EngineConfig.page_bytes must be a power of two >= 64, got {self.page_bytes!r}")
        if not isinstance(self.cold_expert_max_rows, int) or self.cold_expert_max_rows < 1:
            raise ValueError(f"EngineConfig.cold_expert_max_rows must be a positive integer, got "
                             f"{self.cold_expert_max_rows!r}")


@dataclass
class EngineParts:
    config: EngineConfig  # as given, with the block size resolved (``engine_block_size``)
    model: MoECausalLM
    storage: ArenaStorage
    attention: PagedAttentionBackend | SplitAttentionBackend
    linear_states: BlockLinearStateStore | None
    experts: StagedExpertProvider
    expert_line: ExpertLine
    residency: ExpertResidency
    scheduler: Scheduler
    eos_token_ids: frozenset[int]
    host_kv: HostKVStorage | None = None
    step_stats: EngineStepStats | None = None  # what vamp reads of the steps, when the engine built its params


def _device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: no CUDA device is available (torch.cuda.is_available() is False)")
    return torch.device(name)


def eos_token_ids(model_dir: Path) -> frozenset[int]:
    """Stop tokens from config.json's and generation_config.json's ``eos_token_id`` (an int or a list)."""
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        path = model_dir / name
        try:
            value = json.loads(path.read_text(encoding="utf-8")).get("eos_token_id")
        except (OSError, ValueError, AttributeError):
            continue
        ids.update(v for v in (value if isinstance(value, list) else [value]) if isinstance(v, int))
    return frozenset(ids)


def _policy(policy: PressurePolicy | None, params: dict[str, object], config: EngineConfig, model: MoECausalLM,
            provider: StagedExpertProvider, residency: ExpertResidency, costs: EngineCosts | None
            ) -> tuple[PressurePolicy, EngineStepStats | None]:
    """The config's policy (or the instance given), priced by the engine's cost provider when its entry needs
    costs and ``params`` does not carry them (measured now unless ``costs`` is given), and the step record its
    costs read (the runner feeds it after each step)."""
    if policy is not None:
        return policy, None
    if policy_entry(config.policy).needs_costs and "params" not in params and residency.max_num_offloaded == 0:
        raise UserError(f"--policy {config.policy} moves experts out of HBM: give it room with --max-offload-ratio "
                        f"(e.g. 0.15); at {config.max_offload_ratio} it can offload no expert")
    steps: list[EngineStepStats] = []

    def priced() -> VampParams:
        layout, top_k = provider.layout, getattr(model.config, "num_experts_per_tok", 1)
        # the routed experts were moved out of the model: top_k of them per token and layer are active
        active = sum(p.numel() for p in model.parameters()) + len(layout.moe_layer_ids) * layout.numel * top_k
        steps.append(EngineStepStats(provider, residency, costs or measure_costs(provider, active),
                                     experts_per_token=top_k))
        return engine_vamp_params(steps[0], block_size=config.block_size, chunk_tokens=config.max_num_batched_tokens,
                                  horizon_s=config.vamp_horizon_s)

    try:
        return make_policy(config, priced, **params), (steps[0] if steps else None)
    except (ValueError, TypeError) as exc:
        raise UserError(f"--policy {config.policy}: {exc}") from None


def machine_memory_bytes(device: torch.device) -> int | None:
    """What the device can hold at most: the GPU's memory, or the host's physical memory (None: unknown)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _check_fits(config: EngineConfig, device: torch.device) -> None:
    """A budget past the machine's memory is a user's mistake, said as one, before the arena's books are laid
    out (a petabyte of pages is a MemoryError there)."""
    for what, num_bytes, where in (("KV budget", config.kv_cache_memory, device),
                                   ("host KV budget", config.kv_host_memory, torch.device("cpu"))):
        total = machine_memory_bytes(where)
        if total is not None and num_bytes > total:
            raise UserError(f"a {what} of {num_bytes:,} bytes ({num_bytes / 2**30:,.1f} GiB) is more than the "
                            f"{total:,} bytes ({total / 2**30:,.1f} GiB) of {where.type} memory here")


def _arena(kv: KVLayout, experts: ExpertLayout, config: EngineConfig) -> Arena:
    page_bytes = config.page_bytes or default_page_bytes(experts.expert_bytes)
    arena = Arena(arena_config(kv, experts, config.kv_cache_memory, page_bytes))
    if arena.num_kv_blocks == 0 and not config.static_offload and config.kv_host_memory < kv.block_bytes:
        raise UserError(f"a KV budget of {config.kv_cache_memory} bytes holds no KV block of {kv.block_bytes} "
                        f"bytes (block_size {kv.block_size} x {kv.bytes_per_token} bytes per token, in pages of "
                        f"{page_bytes} bytes); raise it to at least {cdiv(kv.block_bytes, page_bytes) * page_bytes}")
    return arena


def _caching(config: EngineConfig, hybrid: bool) -> bool:
    """Prefix caching as vLLM 0.32 resolves it: on unless turned off, for hybrid models too (their states cached
    as blocks, ``core.mamba_states``), except beside a host KV tier, where a hybrid model's cached states are not
    supported (off by default, an error when asked for)."""
    if hybrid and config.kv_host_memory:
        if config.enable_prefix_caching:
            raise UserError("prefix caching of a hybrid (linear-attention) model beside host KV is not supported: "
                            "give --no-prefix-caching or no --kv-host-memory")
        return False
    return True if config.enable_prefix_caching is None else config.enable_prefix_caching


def _kv_manager(pool: BlockPool, config: EngineConfig, state_layout: StateLayout, kv_layout: KVLayout,
                host_kv: HostKVStorage | None) -> KVCacheManager:
    """The KV books; a hybrid model's state takes ``n`` blocks (its bytes cut into block-sized pieces): with prefix
    caching, piece i is linear-attention group i of ``core.mamba_states`` (each state a slot of its own, cached
    at block boundaries, as vLLM's align mode), else ``n`` private blocks per request."""
    num_state_blocks = state_layout.num_blocks(kv_layout.block_bytes)
    mamba = MambaStates(pool, config.block_size, num_state_blocks) if num_state_blocks and pool.enable_caching \
        else None
    return KVCacheManager(pool, config.block_size, num_state_blocks_per_request=0 if mamba else num_state_blocks,
                          evict_device_prefixes=host_kv is not None and config.evict_device_prefixes, mamba=mamba)


def _place_experts(model: MoECausalLM, storage: ArenaStorage, device: torch.device) -> torch.Tensor:
    """Host copy of every routed expert (taken out of the model), each also written into its home pages."""
    layout = storage.expert_layout
    host = pack_experts(model, layout, pin=device.type == "cuda")
    for m in range(len(layout.moe_layer_ids)):
        for e in range(layout.num_experts):
            storage.store_expert(m, e, host[m, e])
    return host


def _host_kv(kv: KVLayout, arena: Arena, config: EngineConfig, device: torch.device) -> HostKVStorage | None:
    """Host KV blocks numbered after every arena id, or None without a host budget (module docstring)."""
    if config.kv_host_memory == 0:
        return None
    num_blocks = config.kv_host_memory // kv.block_bytes
    if num_blocks == 0:
        raise UserError(f"a host KV budget of {config.kv_host_memory} bytes holds no KV block of {kv.block_bytes} "
                        f"bytes (block_size {kv.block_size} x {kv.bytes_per_token} bytes per token)")
    return HostKVStorage(kv, num_blocks, arena.config.num_block_ids, pin=device.type == "cuda")


def _attention(storage: ArenaStorage, host: HostKVStorage | None, config: EngineConfig, model_dir: Path,
               split_costs: SplitCostSource | None) -> PagedAttentionBackend | SplitAttentionBackend:
    if host is None:
        return PagedAttentionBackend(storage)
    layout = storage.kv_layout
    if split_costs is None:
        cpu = host_for(config.cpu, get_gpu(config.split_gpu))
        split_costs = PerfSplitCosts(model_dir, gpu=config.split_gpu, host=cpu,
                                     kv_dtype_bytes=dtype_bytes(layout.dtype), block_size=layout.block_size)
    stepper = SplitStepper(config.split_policy, split_costs, layout.block_bytes, config.split_fixed_ratio)
    return SplitAttentionBackend(storage, host, stepper)


def _active_host_blocks(config: EngineConfig, kv: KVLayout, host_kv: HostKVStorage | None) -> int | None:
    if host_kv is None or config.kv_host_active_memory is None:
        return None
    return max(config.kv_host_active_memory // kv.block_bytes, 1)


def engine_block_size(model: MoECausalLM, shapes: dict[int, LinearStateShape]) -> int:
    """vLLM's block size rule (``perf.budget.hybrid_block_size``) on the engine's own bytes: 16, or for a hybrid
    model the smallest multiple of 16 tokens whose KV page holds one linear-attention layer's state as the engine
    stores it (the recurrent part in fp32). Then a sequence's state is one block per layer, a prefill chunk of a
    fresh prompt is not cut every 16 tokens, and a state is copied to a new slot once per page of tokens."""
    if not shapes:
        return DEFAULT_BLOCK_SIZE
    layer_bytes = StateLayout.of(shapes, model.embed_tokens.weight.dtype).largest_layer_bytes
    return page_aligned_block_size(layer_bytes, KVLayout.of(model, DEFAULT_BLOCK_SIZE).bytes_per_token)


def build_engine(model_dir: Path, config: EngineConfig, policy: PressurePolicy | None,
                 policy_params: dict[str, object], split_costs: SplitCostSource | None = None,
                 costs: EngineCosts | None = None) -> EngineParts:
    device = _device(config.device)
    _check_fits(config, device)
    model = load_model(model_dir, dtype=config.dtype, device="cpu")
    shapes = model.linear_state_shapes()
    if config.block_size is None:
        config = replace(config, block_size=engine_block_size(model, shapes))
    kv_layout, expert_layout = KVLayout.of(model, config.block_size), ExpertLayout.of(model)
    arena = _arena(kv_layout, expert_layout, config)
    host_kv = _host_kv(kv_layout, arena, config, device)
    caching = _caching(config, bool(shapes))
    if host_kv is None:
        pool = BlockPool(arena.kv_block_ids(), enable_caching=caching)
        arena.attach_pool(pool)
    else:
        pool = BlockPool(arena.kv_block_ids(), enable_caching=caching,
                         host_tier=HostTier(host_kv.first_block_id, host_kv.num_blocks))
        arena.attach_pool(ArenaPoolView(pool))
    state_layout = StateLayout.of(shapes, kv_layout.dtype)
    kv = _kv_manager(pool, config, state_layout, kv_layout, host_kv)
    residency = expert_residency(config, num_layers=len(expert_layout.moe_layer_ids),
                                 num_experts=expert_layout.num_experts, expert_bytes=expert_layout.expert_bytes)
    storage = ArenaStorage(arena, kv_layout, expert_layout, device)
    host = _place_experts(model, storage, device)
    model.to(device)
    provider = StagedExpertProvider(storage, residency, host, host_max_rows=config.cold_expert_max_rows
                                    if config.cold_experts == "cpu" else 0)
    line = ExpertLine(residency, ArenaLayout(arena), weights=provider)
    chosen, step_stats = _policy(policy, policy_params, config, model, provider, residency, costs)
    scheduler = build_scheduler(config, kv, line, chosen, static_offload=config.static_offload,
                                max_host_blocks_held=_active_host_blocks(config, kv_layout, host_kv))
    if pool.num_blocks == 0:
        raise UserError(f"the KV budget of {config.kv_cache_memory} bytes holds no KV block of "
                        f"{kv_layout.block_bytes} bytes, even after static offload")
    return EngineParts(config, model, storage, _attention(storage, host_kv, config, model_dir, split_costs),
                       BlockLinearStateStore(storage, state_layout, host_kv) if shapes else None, provider, line,
                       residency, scheduler, frozenset() if config.ignore_eos else eos_token_ids(model_dir), host_kv,
                       step_stats)
