"""Build a replay from user-facing settings: specs → memory budget → pool, scheduler, policy, step-time model.

This is the one place where ``perf`` figures become the plain numbers ``core`` consumes (block counts, state
blocks per request), so ``core`` never imports ``perf``. Everything a replay's result depends on is in
``ReplayConfig`` and is written into the result's ``config``, so a JSON file says how it was made.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

from moetide.core.blocks import BlockPool
from moetide.core.config import ServingConfig, build_scheduler, expert_residency, make_policy
from moetide.core.expert_line import ByteLayout, ExpertLine, staging_room_bytes
from moetide.core.experts import ExpertResidency
from moetide.core.kv_manager import KVCacheManager
from moetide.core.pressure import VampParams, policy_entry
from moetide.core.pressure.step_costs import EngineCosts, RecordSteps, engine_vamp_params
from moetide.errors import UserError
from moetide.perf import MemoryBudget, StepTimeModel, default_block_size, memory_budget, weights_per_gpu
from moetide.perf.engines import DEFAULT_ENGINE_PROFILE, engine_profiles
from moetide.perf.step_calibrate import step_efficiency_for_gpu
from moetide.perf.staging import CPU, STAGING_MODES, StagingModel
from moetide.sim.host_kv import HostKV, active_host_blocks, build_host_kv
from moetide.sim.host_kv import ring_blocks  # noqa: F401 (API: tests import it from here)
from moetide.sim.metrics import MetricsCollector
from moetide.sim.replay import Replay
from moetide.sim.step_time import (STAGING_MIX_HORIZONS, StepTimeWithStaging, reference_decode, staging_config,
                                    vamp_params)
from moetide.sim.vllm_defaults import (MAMBA_CACHE_MODES, SSM_CACHE_DTYPES, VLLM_VERSIONS, mamba_states, ssm_bytes,
                                       vllm_defaults, vllm_serving_defaults)
from moetide.specs import HardwareSpec, ModelSpec, get_gpu, get_model, host_for
from moetide.workloads.base import Workload


# vLLM's --dtype names -> bytes per element, and the HardwareSpec.matmul_dtype each needs
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
DTYPES = ("auto", *DTYPE_BYTES)
_MATMUL_DTYPE = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


@dataclass(frozen=True)
class ReplayConfig(ServingConfig):
    """``ServingConfig``'s options, resolved from the modeled GPU and model where left ``None``, and what only the
    replay has: the hardware it models and how it models it."""

    model: str = "qwen3-30b-a3b"
    gpu: str = "h100"
    tp: int = 1
    gpu_memory_utilization: float = 0.9  # sizes the KV cache when kv_cache_memory is None
    # the vLLM whose scheduler rules and defaults the replay follows (VLLM_VERSIONS; docs/vllm_baseline.md)
    vllm_version: str = "0.32"
    # the step model's fitted efficiency for a GPU preset (perf.engines; "roofline": none); a device file's own
    # [efficiency] table replaces it
    engine_profile: str = DEFAULT_ENGINE_PROFILE
    # admit a waiting request only if its whole known sequence fits; False: on its first chunk; None: the vLLM's
    scheduler_reserve_full_isl: bool | None = None
    # hybrid models: vLLM's mamba_cache_mode ("align": states cached as blocks of their own, core.mamba_states;
    # "none": one state per running request and no prefix caching, as vLLM forces it); None: "align" with prefix
    # caching, "none" without (vLLM 0.32's resolution)
    mamba_cache_mode: str | None = None
    # vLLM's prefix_cache_retention_interval for those states: 0 (its default) keeps the prompt's replay boundary
    # and shared-prefix junctions; None keeps every block's state
    prefix_cache_retention_interval: int | None = 0  # (vLLM 0.15 keeps every state: None is used there)
    # vLLM's mamba_ssm_cache_dtype: "auto" keeps hybrid recurrent states at the model's dtype; "float32" in fp32,
    # as moetide's engine keeps them (the block size and each state's blocks follow)
    mamba_ssm_cache_dtype: str = "auto"
    # "auto": prefetch the likeliest offloaded experts behind the previous layer's compute, fetch the rest on
    # demand; "touched": on demand only; "segment": the whole offloaded segment every step (perf/staging.py)
    staging_mode: str = "auto"
    routing_zipf_s: float = 0.0  # expert popularity skew for staging (0: uniform routing, the pessimistic case)
    routing_profile: str | None = None  # or a measured profile (`moetide generate --routing-out`), not with zipf
    host_link_shared_by: int = 1  # GPUs staging through one host uplink at once (2: TP partners on one switch)
    # the host socket (a host preset or file) that computes cold experts ("cpu") and attends host KV in place;
    # ``gpus_per_socket`` GPUs share it
    cpu: str | None = None  # None: the GPU's own host (HardwareSpec.host; DGX H200's is 2 x Xeon Platinum 8480C)
    gpus_per_socket: int = 1
    cpu_matmul_tflops: float | None = None  # the socket's expert-GEMM rate (None: fp32 FMA peak x 0.5; AMX: more)
    cpu_slowdown: float = 1.0  # true CPU attention time / modeled (writescope's correction learns it)
    seed: int = 0
    # vLLM's --dtype: "auto" is the device's matmul dtype (bf16 on the GPU presets, fp16 on V100, fp32 on a CPU
    # described by ``moetide calibrate --device-out``); weights, KV and activations all take it
    dtype: str = "auto"
    # vamp priced from this cost record (``EngineCosts`` fields) as vLLM's plugin and moetide's engine price it
    # (``RecordSteps`` over the replay's steps), instead of from the replay's own step and staging models; the
    # replay still charges its modeled step times
    vamp_costs: dict[str, float] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.vamp_costs is not None:
            try:
                EngineCosts(**self.vamp_costs)
            except TypeError as exc:
                raise ValueError(f"ReplayConfig.vamp_costs: {exc}") from None
        if self.dtype not in DTYPES:
            raise ValueError(f"ReplayConfig.dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.tp <= 0:
            raise ValueError(f"ReplayConfig.tp must be a positive integer, got {self.tp}")
        if self.kv_cache_memory == 0:
            raise ValueError("ReplayConfig.kv_cache_memory must be positive, got 0")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("ReplayConfig.gpu_memory_utilization must be in (0, 1], got "
                             f"{self.gpu_memory_utilization}")
        if self.routing_zipf_s < 0:
            raise ValueError(f"ReplayConfig.routing_zipf_s must be >= 0, got {self.routing_zipf_s}")
        if self.host_link_shared_by < 1:
            raise ValueError(f"ReplayConfig.host_link_shared_by must be >= 1, got {self.host_link_shared_by}")
        if self.routing_profile is not None and self.routing_zipf_s:
            raise ValueError("give ReplayConfig.routing_profile or ReplayConfig.routing_zipf_s, not both")
        if self.staging_mode not in STAGING_MODES:
            raise ValueError(f"ReplayConfig.staging_mode must be one of {', '.join(STAGING_MODES)}, got "
                             f"{self.staging_mode!r}")
        if self.cold_experts == CPU and self.staging_mode != "auto":
            raise ValueError("ReplayConfig.cold_experts cpu serves what ReplayConfig.staging_mode auto does not "
                             "prefetch: use ReplayConfig.staging_mode auto")
        if self.gpus_per_socket < 1:
            raise ValueError(f"ReplayConfig.gpus_per_socket must be >= 1, got {self.gpus_per_socket}")
        if self.cpu_matmul_tflops is not None and not self.cpu_matmul_tflops > 0:
            raise ValueError(f"ReplayConfig.cpu_matmul_tflops must be positive, got {self.cpu_matmul_tflops}")
        if self.mamba_cache_mode not in (None, *MAMBA_CACHE_MODES):
            raise ValueError(f"ReplayConfig.mamba_cache_mode must be one of {', '.join(MAMBA_CACHE_MODES)}, got "
                             f"{self.mamba_cache_mode!r}")
        if self.vllm_version not in VLLM_VERSIONS:
            raise ValueError(f"ReplayConfig.vllm_version must be one of {', '.join(VLLM_VERSIONS)}, got "
                             f"{self.vllm_version!r}")
        if self.engine_profile not in engine_profiles():
            raise ValueError(f"ReplayConfig.engine_profile must be one of {', '.join(engine_profiles())}, got "
                             f"{self.engine_profile!r}")
        if self.mamba_ssm_cache_dtype not in SSM_CACHE_DTYPES:
            raise ValueError(f"ReplayConfig.mamba_ssm_cache_dtype must be one of {', '.join(SSM_CACHE_DTYPES)}, got "
                             f"{self.mamba_ssm_cache_dtype!r}")
        if self.prefix_cache_retention_interval not in (None, 0):
            raise ValueError(f"ReplayConfig.prefix_cache_retention_interval: 0 or none are modeled, got "
                             f"{self.prefix_cache_retention_interval}")
        if not (math.isfinite(self.cpu_slowdown) and self.cpu_slowdown > 0):
            raise ValueError(f"ReplayConfig.cpu_slowdown must be a positive number, got {self.cpu_slowdown}")
        if self.kv_host_memory:
            self._check_host_kv()

    def _check_host_kv(self) -> None:
        if self.tp != 1:
            raise ValueError("ReplayConfig.kv_host_memory models one GPU beside one host socket: use "
                             "ReplayConfig.tp 1")
        if self.cold_experts == CPU:
            raise ValueError("ReplayConfig.kv_host_memory with ReplayConfig.cold_experts cpu: one socket attending "
                             "KV and computing experts is not modeled; use ReplayConfig.cold_experts fetch")
        if self.dtype == "float32":
            raise ValueError("ReplayConfig.kv_host_memory with ReplayConfig.dtype float32: the host tier's split is "
                             "modeled for a GPU beside a CPU, not for a CPU device; use a GPU")
        if policy_entry(self.policy).moves_line:
            raise ValueError(f"ReplayConfig.kv_host_memory with ReplayConfig.policy {self.policy}: a moving expert "
                             "line beside a host KV tier is not modeled yet (docs/writescope.md, Replay); use vllm or "
                             "static-offload")


@dataclass
class BuiltReplay:
    replay: Replay
    budget: MemoryBudget
    config: ReplayConfig
    expert_line: ExpertLine
    step_time: StepTimeWithStaging
    host_kv: HostKV | None = None


def build_replay(
    workload: Workload, config: ReplayConfig, progress: Callable[[int, int], None] | None = None, *,
    vamp_coefficients: VampParams | None = None,
) -> BuiltReplay:
    """The replay's parts. ``vamp_coefficients`` replaces the perf model's ``vamp_params`` (a differential test
    gives both drivers the same ones)."""
    model, gpu = get_model(config.model), get_gpu(config.gpu)
    config = resolve_config(config, model, gpu)
    dtype_bytes = DTYPE_BYTES[config.dtype]
    shard = weights_per_gpu(model, tp=config.tp, dtype_bytes=dtype_bytes).expert_shard_bytes
    residency = expert_residency(config, num_layers=model.num_moe_layers, num_experts=model.num_experts,
                                 expert_bytes=shard)
    budget = memory_budget(
        model, gpu, tp=config.tp, block_size=config.block_size, dtype_bytes=dtype_bytes, kv_dtype_bytes=dtype_bytes,
        gpu_memory_utilization=config.gpu_memory_utilization,
        max_num_batched_tokens=config.max_num_batched_tokens, kv_cache_memory=config.kv_cache_memory,
        staging_room_bytes=_staging_room(residency, config), ssm_dtype_bytes=ssm_bytes(config),
    )
    host_kv = build_host_kv(model, gpu, config, budget)
    kv = _kv_manager(model, config, budget, host_kv)
    pool = kv.pool
    step_model = StepTimeModel(model, gpu, tp=config.tp, dtype_bytes=dtype_bytes, kv_dtype_bytes=dtype_bytes,
                               efficiency=step_efficiency_for_gpu(config.gpu, config.engine_profile))
    line = ExpertLine(residency, ByteLayout(pool, block_bytes=budget.charged_block_bytes,
                                            kv_bytes_per_expert=residency.config.expert_bytes,
                                            first_block_id=budget.num_blocks))
    staging = StagingModel(model, gpu, tp=config.tp, dtype_bytes=dtype_bytes, config=staging_config(config, model))
    priced = policy_entry(config.policy).needs_costs
    record = RecordSteps(EngineCosts(**config.vamp_costs), residency, model.num_experts_per_tok) \
        if priced and config.vamp_costs is not None else None
    step_time = StepTimeWithStaging(step_model, staging, line, model.num_layers,
                                    mix_tau_s=config.vamp_horizon_s * STAGING_MIX_HORIZONS,
                                    reference_step=reference_decode(config, step_model),
                                    track_mix=priced and record is None, record=record)
    policy = make_policy(config, lambda: vamp_coefficients or (
        engine_vamp_params(record, block_size=config.block_size, chunk_tokens=config.max_num_batched_tokens,
                           horizon_s=config.vamp_horizon_s)
        if record is not None else vamp_params(config, step_model, step_time)))
    try:
        scheduler = build_scheduler(
            config, kv, line, policy, scheduler_reserve_full_isl=bool(config.scheduler_reserve_full_isl),
            threshold_caps_lone_request=config.vllm_version == "0.15",
            max_host_blocks_held=active_host_blocks(config, budget) if host_kv is not None else None)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    replay = Replay(workload, scheduler, step_time, progress=progress,
                    offloaded_ratio=lambda: line.residency.offloaded_ratio, host_kv=host_kv,
                    request_overhead_s=step_model.request_overhead_s)
    return BuiltReplay(replay, budget, config, line, step_time, host_kv)


def resolve_config(config: ReplayConfig, model: ModelSpec, gpu: HardwareSpec) -> ReplayConfig:
    """Every ``None`` of the config resolved as vLLM resolves it for this model and GPU (the result's config
    records what was used)."""
    config = replace(config, dtype=resolve_dtype(config.dtype, gpu))
    uses_host = bool(config.kv_host_memory) or config.cold_experts == CPU
    if config.cpu is None and (uses_host or gpu.host):  # the GPU's host; an error only where one is used
        config = replace(config, cpu=host_for(None, gpu))
    if config.block_size is None:
        config = replace(config, block_size=default_block_size(model, tp=config.tp, ssm_dtype_bytes=ssm_bytes(config)))
    config = vllm_defaults(config, model)
    batched, seqs = vllm_serving_defaults(gpu)
    return replace(config, max_num_batched_tokens=batched if config.max_num_batched_tokens is None
                   else config.max_num_batched_tokens, max_num_seqs=seqs if config.max_num_seqs is None
                   else config.max_num_seqs)


def _kv_manager(model: ModelSpec, config: ReplayConfig, budget: MemoryBudget, host_kv: HostKV | None
                ) -> KVCacheManager:
    if host_kv is None:
        pool = BlockPool(range(budget.num_blocks), enable_caching=config.enable_prefix_caching)
    else:  # device ids first (the ring's share of the budget left out), then the host tier's (sim.host_kv)
        pool = BlockPool(range(host_kv.num_device_blocks), enable_caching=config.enable_prefix_caching,
                         host_tier=host_kv.tier)
    mamba = mamba_states(model, config, pool, budget, host_kv)
    return KVCacheManager(pool, config.block_size,
                          num_state_blocks_per_request=0 if mamba else budget.state_blocks_per_request,
                          evict_device_prefixes=host_kv is not None and config.evict_device_prefixes, mamba=mamba)


def resolve_dtype(dtype: str, gpu: HardwareSpec) -> str:
    """The dtype a replay runs at: ``auto`` is the device's matmul dtype; an explicit one must be what the device's
    matmul rate is quoted at, since that rate is the only compute figure the step model has."""
    if dtype == "auto":
        return next(name for name, mm in _MATMUL_DTYPE.items() if mm == gpu.matmul_dtype)
    if _MATMUL_DTYPE[dtype] != gpu.matmul_dtype:
        raise ValueError(f"ReplayConfig.dtype {dtype}: {gpu.name}'s matmul rate is quoted at {gpu.matmul_dtype}, and "
                         f"there is no {_MATMUL_DTYPE[dtype]} rate to model it with; use ReplayConfig.dtype auto or a "
                         f"device file whose matmul_dtype is {_MATMUL_DTYPE[dtype]}")
    return dtype


def _staging_room(residency: ExpertResidency, config: ReplayConfig) -> int:
    """Device bytes the staging buffers need beside the KV budget, when the policy can offload."""
    if not policy_entry(config.policy).offloads_experts:
        return 0
    return staging_room_bytes(residency.config, residency.max_num_offloaded)


def run_replay(
    workload: Workload, config: ReplayConfig, progress: Callable[[int, int], None] | None = None
) -> tuple[dict[str, object], MetricsCollector]:
    """Replay; return ``{"config": …, "metrics": …}`` (times in seconds, MODELED by the roofline) and the raw
    collector (per-request samples, for plots)."""
    built = build_replay(workload, config, progress)
    metrics = built.replay.run()
    metrics.staged_bytes = built.step_time.staged_bytes
    metrics.offloads = built.expert_line.num_offloads
    metrics.reclaims = built.expert_line.num_reclaims
    result = {"config": describe_config(workload, built), "metrics": metrics.to_dict()}
    if built.host_kv is not None:
        sched = built.replay.scheduler
        result["metrics"]["host_kv"] = {**built.host_kv.counters.as_dict(built.host_kv.stepper),
                                        "active_bound_blocks": sched.config.max_host_blocks_held,
                                        "bound_waits": sched.num_host_bound_waits,
                                        "host_hits_recomputed_blocks": sched.num_host_hits_dropped,
                                        "host_hits_promoted_blocks": sched.num_host_hits_promoted}
    return result, metrics


def describe_config(workload: Workload, built: BuiltReplay) -> dict[str, object]:
    budget = built.budget
    return {
        **asdict(built.config),
        "workload": {"name": workload.name, "source": workload.source, "mode": workload.mode,
                     "sessions": workload.num_sessions, "requests": workload.num_requests,
                     "key_block_size": workload.key_block_size},
        "memory": {"weights_bytes_per_gpu": budget.weights_bytes_per_gpu, "kv_budget_bytes": budget.kv_budget_bytes,
                   "block_bytes": budget.block_bytes, "num_blocks": budget.num_blocks,
                   "state_blocks_per_request": budget.state_blocks_per_request, "max_tokens": budget.max_tokens,
                   **_host_memory(built)},
        "times": "modeled (roofline step-time model, docs/perf.md); not measured",
    }


def _host_memory(built: BuiltReplay) -> dict[str, int]:
    if built.host_kv is None:
        return {}
    host = built.host_kv
    return {"device_kv_blocks": host.num_device_blocks, "ring_blocks": built.budget.num_blocks - host.num_device_blocks,
            "host_kv_blocks": host.num_host_blocks}
