"""Assembling an engine: the model, the arena and its storage, and the core objects that decide everything.

Order matters for one invariant — *the pool holds exactly the arena's KV block ids* (``Arena.attach_pool``):
the pool is built from ``arena.kv_block_ids()`` and attached before anything converts pages, so every expert
region converted later (static offload here, ``OffloadExperts`` actions at run time) adds its blocks to the pool
through the arena. Expert weights are copied into their home pages and into a host copy (pinned on CUDA), and the
model's own stacked expert parameters are dropped, so each routed expert exists once on the device.

Budget: ``kv_budget_bytes`` buys whole KV pages *on top of* the routed experts' pages (the experts are the
weights every engine must hold anyway; offloading them is how the KV share grows). A budget that leaves no room
for a single KV block, a missing model directory, an unknown policy or device are ``UserError``s.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from moetide.core.arena import Arena
from moetide.core.blocks import BlockPool
from moetide.core.experts import ExpertResidency, ExpertResidencyConfig
from moetide.core.kv_manager import KVCacheManager
from moetide.core.pressure import NEEDS_VAMP_PARAMS, PressurePolicy, get_policy
from moetide.core.scheduler import Scheduler, SchedulerConfig
from moetide.engine.attention import PagedAttentionBackend
from moetide.engine.experts import ArenaExpertLine, StagedExpertProvider
from moetide.engine.loader import load_model
from moetide.engine.models import MoECausalLM
from moetide.engine.state import BlockLinearStateStore, StateLayout
from moetide.engine.storage import (
    ArenaStorage,
    ExpertLayout,
    KVLayout,
    arena_config,
    default_page_bytes,
    pack_experts,
)
from moetide.errors import UserError

DEVICES = ("cpu", "cuda")


@dataclass(frozen=True)
class EngineConfig:
    """Everything an engine is built with. ``enable_prefix_caching=None``: on, except for hybrid models (off:
    see ``engine.state``). ``page_bytes=None``: ``storage.default_page_bytes``. ``dtype=None``: config.json's."""

    kv_budget_bytes: int
    device: str = "cpu"
    dtype: str | None = None
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_offload_ratio: float = 0.0
    static_offload: bool = False
    enable_prefix_caching: bool | None = None
    page_bytes: int | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        for name in ("kv_budget_bytes", "block_size", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < (0 if name == "kv_budget_bytes"
                                                                                 else 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if not 0.0 <= self.max_offload_ratio <= 1.0:
            raise ValueError(f"max_offload_ratio must be in [0, 1], got {self.max_offload_ratio!r}")
        if self.static_offload and self.max_offload_ratio == 0.0:
            raise ValueError("static_offload needs max_offload_ratio > 0 (the share of expert bytes to offload)")
        if self.page_bytes is not None and (self.page_bytes < 64 or self.page_bytes & (self.page_bytes - 1)):
            raise ValueError(f"page_bytes must be a power of two >= 64, got {self.page_bytes!r}")


@dataclass
class EngineParts:
    model: MoECausalLM
    storage: ArenaStorage
    attention: PagedAttentionBackend
    linear_states: BlockLinearStateStore | None
    experts: StagedExpertProvider
    expert_line: ArenaExpertLine
    residency: ExpertResidency
    scheduler: Scheduler
    eos_token_ids: frozenset[int]


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


def _policy(policy: str | PressurePolicy, params: dict[str, object]) -> PressurePolicy:
    if not isinstance(policy, str):
        return policy
    if policy.lower() in NEEDS_VAMP_PARAMS and "params" not in params:
        raise UserError(f"--policy {policy} is not wired into the engine yet (its cost coefficients come from the "
                        f"replay's perf model); use --policy vllm, optionally with --static-offload")
    try:
        return get_policy(policy, **params)
    except (ValueError, TypeError) as exc:
        raise UserError(f"--policy {policy}: {exc}") from None


def _arena(kv: KVLayout, experts: ExpertLayout, config: EngineConfig) -> Arena:
    page_bytes = config.page_bytes or default_page_bytes(experts.expert_bytes)
    arena = Arena(arena_config(kv, experts, config.kv_budget_bytes, page_bytes))
    if arena.num_kv_blocks == 0 and not config.static_offload:
        raise UserError(f"a KV budget of {config.kv_budget_bytes} bytes holds no KV block of {kv.block_bytes} "
                        f"bytes (block_size {kv.block_size} x {kv.bytes_per_token} bytes per token, in pages of "
                        f"{page_bytes} bytes); raise it to at least {-(-kv.block_bytes // page_bytes) * page_bytes}")
    return arena


def _caching(config: EngineConfig, hybrid: bool) -> bool:
    if config.enable_prefix_caching and hybrid:
        raise UserError("prefix caching is not supported for hybrid (linear-attention) models: a linear state "
                        "cannot be rebuilt from a cached prefix")
    return (not hybrid) if config.enable_prefix_caching is None else config.enable_prefix_caching


def _place_experts(model: MoECausalLM, storage: ArenaStorage, device: torch.device) -> torch.Tensor:
    """Host copy of every routed expert (taken out of the model), each also written into its home pages."""
    layout = storage.expert_layout
    host = pack_experts(model, layout, pin=device.type == "cuda")
    for m in range(len(layout.moe_layer_ids)):
        for e in range(layout.num_experts):
            storage.store_expert(m, e, host[m, e])
    return host


def build_engine(model_dir: Path, config: EngineConfig, policy: str | PressurePolicy,
                 policy_params: dict[str, object]) -> EngineParts:
    device = _device(config.device)
    model = load_model(model_dir, dtype=config.dtype, device="cpu")
    kv_layout, expert_layout = KVLayout.of(model, config.block_size), ExpertLayout.of(model)
    arena = _arena(kv_layout, expert_layout, config)
    shapes = model.linear_state_shapes()
    pool = BlockPool(arena.kv_block_ids(), enable_caching=_caching(config, bool(shapes)))
    arena.attach_pool(pool)
    state_layout = StateLayout.of(shapes, kv_layout.dtype)
    kv = KVCacheManager(pool, config.block_size,
                        num_state_blocks_per_request=state_layout.num_blocks(kv_layout.block_bytes))
    residency = ExpertResidency(ExpertResidencyConfig(
        num_layers=len(expert_layout.moe_layer_ids), num_experts=expert_layout.num_experts,
        expert_bytes=expert_layout.expert_bytes, max_offload_ratio=config.max_offload_ratio))
    storage = ArenaStorage(arena, kv_layout, expert_layout, device)
    host = _place_experts(model, storage, device)
    model.to(device)
    provider = StagedExpertProvider(storage, residency, host)
    line = ArenaExpertLine(arena, residency, provider)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=config.max_num_batched_tokens,
                                          max_num_seqs=config.max_num_seqs,
                                          enable_prefix_caching=pool.enable_caching),
                          kv, _policy(policy, policy_params), expert_line=line)
    if config.static_offload:
        region = residency.next_offload_region(max_experts=residency.max_num_offloaded)
        if region:
            line.offload(tuple(region))
    if pool.num_blocks == 0:
        raise UserError(f"the KV budget of {config.kv_budget_bytes} bytes holds no KV block of "
                        f"{kv_layout.block_bytes} bytes, even after static offload")
    return EngineParts(model, storage, PagedAttentionBackend(storage),
                       BlockLinearStateStore(storage, state_layout) if shapes else None, provider, line, residency,
                       scheduler, frozenset() if config.ignore_eos else eos_token_ids(model_dir))
