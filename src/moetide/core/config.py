"""The serving options every driver builds the core from, and the one builder of the core's decision makers.

``ServingConfig`` is the one place each shared option is named (vLLM's name where vLLM has the option), given its
unit (sizes in bytes) and its default. The replay's and moetide's engine's configs extend it with what only they
have (the modeled GPU; the device and its pages); a third driver (vLLM through the plugin) builds one directly.
A ``None`` is a default the driver resolves from its hardware, as vLLM resolves it at start-up: the replay from the
GPU preset and the model (``sim.vllm_defaults``), the engine in ``engine.build``.

``make_policy`` and ``build_scheduler`` are what every driver calls to turn that config into the policy (priced by
the driver's one cost provider when its registry entry says it needs costs) and the scheduler over the driver's
own KV manager and expert line; ``expert_residency`` is the expert side's bookkeeping from the model's shape.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from moetide.core.experts import DEFAULT_MAX_OFFLOAD_RATIO, ExpertResidency, ExpertResidencyConfig
from moetide.core.expert_line import ExpertLine
from moetide.core.kv_manager import DEVICE_PREFIXES, KVCacheManager
from moetide.core.pressure import CostProvider, PressurePolicy, VampParams, get_policy, policy_entry, start_offload
from moetide.core.scheduler import Scheduler, SchedulerConfig
from moetide.core.splits import SPLIT_POLICIES

# offloaded experts a step does not prefetch: staged over the host link, or computed on the host where they lie
COLD_EXPERT_MODES = ("fetch", "cpu")
# the KV cache a server gets where nothing sizes it: moetide's engine, and vLLM on the CPU under `moetide serve`
DEFAULT_KV_CACHE_MEMORY = 256 * 2**20


@dataclass(frozen=True)
class ServingConfig:
    """The options the core decides with, one default each (module docstring). Errors name ``<class>.<field>``
    so a driver can say them in its own words (the CLI names the flag)."""

    policy: str = "vllm"
    # bytes of KV cache per device (vLLM's --kv-cache-memory-bytes); None: the driver sizes it
    kv_cache_memory: int | None = None
    block_size: int | None = None  # None: vLLM's (16, or the hybrid page-aligned size)
    max_num_seqs: int | None = None  # None: vLLM's default for the hardware
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool | None = None  # None: vLLM's resolution for the model
    max_offload_ratio: float = DEFAULT_MAX_OFFLOAD_RATIO  # cap on the offloaded share of routed-expert bytes
    vamp_horizon_s: float = VampParams.horizon_s  # vamp's review interval and rate time constant
    cold_experts: str = "fetch"  # COLD_EXPERT_MODES
    # host KV tier (WriteScope): bytes of KV blocks in host memory (0: none); the bound on what running requests
    # attend there each step (None: none); whether LRU cached device prefixes go before new KV spills
    kv_host_memory: int = 0
    kv_host_active_memory: int | None = None
    device_prefixes: str = "keep"  # DEVICE_PREFIXES
    split_policy: str = "writescope"  # who attends the host KV each step (core.splits)
    split_fixed_ratio: float = 0.5  # the fixed-ratio split policy's CPU share

    def __post_init__(self) -> None:
        name = type(self).__name__
        try:
            policy_entry(self.policy)
        except ValueError as exc:
            raise ValueError(f"{name}.policy: {exc}") from None
        memory = self.kv_cache_memory  # 0: a driver with a host KV tier may keep no KV on the device
        if memory is not None and (not isinstance(memory, int) or isinstance(memory, bool) or memory < 0):
            raise ValueError(f"{name}.kv_cache_memory must be a whole number of bytes >= 0, got {memory!r}")
        for field in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, field)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{name}.{field} must be a positive whole number, got {value!r}")
        for field, value in (("max_offload_ratio", self.max_offload_ratio),
                             ("split_fixed_ratio", self.split_fixed_ratio)):
            if not 0 <= value <= 1:
                raise ValueError(f"{name}.{field} must be in [0, 1], got {value}")
        if not (math.isfinite(self.vamp_horizon_s) and self.vamp_horizon_s > 0):
            raise ValueError(f"{name}.vamp_horizon_s must be positive, got {self.vamp_horizon_s}")
        for field, value, choices in (("cold_experts", self.cold_experts, COLD_EXPERT_MODES),
                                      ("device_prefixes", self.device_prefixes, DEVICE_PREFIXES),
                                      ("split_policy", self.split_policy, SPLIT_POLICIES)):
            if value not in choices:
                raise ValueError(f"{name}.{field} must be one of {', '.join(choices)}, got {value!r}")
        self._check_host_memory(name)

    def _check_host_memory(self, name: str) -> None:
        host, active = self.kv_host_memory, self.kv_host_active_memory
        if not isinstance(host, int) or isinstance(host, bool) or host < 0:
            raise ValueError(f"{name}.kv_host_memory must be a whole number of bytes >= 0, got {host!r}")
        if active is None:
            return
        if not host:
            raise ValueError(f"{name}.kv_host_active_memory bounds a host KV tier: give {name}.kv_host_memory too")
        if not isinstance(active, int) or isinstance(active, bool) or not 0 < active <= host:
            raise ValueError(f"{name}.kv_host_active_memory must be in (0, {name}.kv_host_memory = {host}] bytes, "
                             f"got {active!r}")

    @property
    def evict_device_prefixes(self) -> bool:
        return self.device_prefixes == "evict"


def expert_residency(config: ServingConfig, *, num_layers: int, num_experts: int,
                     expert_bytes: int) -> ExpertResidency:
    """Which routed experts are where, for a model of this shape under the config's offload cap."""
    return ExpertResidency(ExpertResidencyConfig(num_layers=num_layers, num_experts=num_experts,
                                                 expert_bytes=expert_bytes,
                                                 max_offload_ratio=config.max_offload_ratio))


def make_policy(config: ServingConfig, costs: CostProvider, **params: object) -> PressurePolicy:
    """The policy the config names; ``costs`` (the driver's one cost provider) is called only if it needs them and
    ``params`` (a test's fixed coefficients) does not carry them."""
    return get_policy(config.policy, costs=costs, **params)


def build_scheduler(config: ServingConfig, kv: KVCacheManager, line: ExpertLine, policy: PressurePolicy, *,
                    static_offload: bool = False, **rules: object) -> Scheduler:
    """The scheduler over the driver's KV manager and expert line, with the config's batch limits (resolved by
    then); the offload cap goes out before the first request when the policy asks (or ``static_offload``).
    ``rules``: ``SchedulerConfig``'s version rules and host-KV bound, where a driver sets them."""
    if config.max_num_batched_tokens is None or config.max_num_seqs is None:
        raise ValueError("build_scheduler needs resolved batch limits (max_num_batched_tokens, max_num_seqs)")
    scheduler_config = SchedulerConfig(max_num_batched_tokens=config.max_num_batched_tokens,
                                       max_num_seqs=config.max_num_seqs,
                                       enable_prefix_caching=kv.pool.enable_caching, **rules)
    start_offload(policy, line, always=static_offload)
    return Scheduler(scheduler_config, kv, policy, expert_line=line)
