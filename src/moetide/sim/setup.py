"""Build a replay from user-facing settings: specs → memory budget → pool, scheduler, policy, step-time model.

This is the one place where ``perf`` figures become the plain numbers ``core`` consumes (block counts, state
blocks per request), so ``core`` never imports ``perf``. Everything a replay's result depends on is in
``ReplayConfig`` and is written into the result's ``config``, so a JSON file says how it was made.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

from moetide.core.blocks import BlockPool
from moetide.core.kv_manager import KVCacheManager
from moetide.core.expert_line import ExpertLine
from moetide.core.experts import ExpertResidency, ExpertResidencyConfig
from moetide.core.pressure import NEEDS_VAMP_PARAMS, VampParams, get_policy
from moetide.core.scheduler import Scheduler, SchedulerConfig
from moetide.errors import UserError
from moetide.perf import MemoryBudget, StepTimeModel, default_block_size, memory_budget, weights_per_gpu
from moetide.perf.staging import StagingConfig, StagingModel
from moetide.sim.metrics import MetricsCollector
from moetide.sim.replay import Replay
from moetide.specs import get_gpu, get_model
from moetide.workloads.base import Workload


@dataclass(frozen=True)
class ReplayConfig:
    model: str = "qwen3-30b-a3b"
    gpu: str = "h100"
    tp: int = 1
    policy: str = "vllm"
    block_size: int | None = None  # None: vLLM's (16, or the hybrid page-aligned size; perf.budget)
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    gpu_memory_utilization: float = 0.9
    kv_budget_gib: float | None = None  # per GPU; None: utilization × HBM − weights − activation reserve
    enable_prefix_caching: bool = True
    state_checkpoints: bool = False  # hybrid models: charge a state checkpoint per cached block (vLLM's option)
    max_offload_ratio: float = 0.15  # cap on the offloaded share of routed-expert bytes (vamp, static-offload)
    staging_mode: str = "touched"  # "touched" experts per step, or the whole offloaded "segment" (the paper)
    routing_zipf_s: float = 0.0  # expert popularity skew for staging (0: uniform routing, the pessimistic case)
    vamp_horizon_s: float = 60.0
    vamp_reuse_tau_s: float = 300.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.tp <= 0:
            raise UserError(f"--tp must be a positive integer, got {self.tp}")
        if self.block_size is not None and self.block_size <= 0:
            raise UserError(f"--block-size must be positive, got {self.block_size}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise UserError(f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_budget_gib is not None and self.kv_budget_gib <= 0:
            raise UserError(f"--kv-budget-gib must be positive, got {self.kv_budget_gib}")
        if not 0 <= self.max_offload_ratio <= 1:
            raise UserError(f"--max-offload-ratio must be in [0, 1], got {self.max_offload_ratio}")
        if self.routing_zipf_s < 0:
            raise UserError(f"--routing-zipf-s must be >= 0, got {self.routing_zipf_s}")
        if self.staging_mode not in ("touched", "segment"):
            raise UserError(f"--staging must be 'touched' or 'segment', got {self.staging_mode!r}")


@dataclass
class BuiltReplay:
    replay: Replay
    budget: MemoryBudget
    config: ReplayConfig
    expert_line: ExpertLine
    step_time: StepTimeWithStaging


def build_replay(
    workload: Workload, config: ReplayConfig, progress: Callable[[int, int], None] | None = None
) -> BuiltReplay:
    model, gpu = get_model(config.model), get_gpu(config.gpu)
    if config.block_size is None:  # the result's config records the size used
        config = replace(config, block_size=default_block_size(model, tp=config.tp))
    budget = memory_budget(
        model, gpu, tp=config.tp, block_size=config.block_size, gpu_memory_utilization=config.gpu_memory_utilization,
        max_num_batched_tokens=config.max_num_batched_tokens, kv_budget_gib=config.kv_budget_gib,
        state_checkpoints=config.state_checkpoints,
    )
    try:
        scheduler_config = SchedulerConfig(
            max_num_batched_tokens=config.max_num_batched_tokens, max_num_seqs=config.max_num_seqs,
            enable_prefix_caching=config.enable_prefix_caching,
        )
    except ValueError as exc:
        raise UserError(str(exc)) from None
    pool = BlockPool(range(budget.num_blocks), enable_caching=config.enable_prefix_caching)
    kv = KVCacheManager(pool, config.block_size, num_state_blocks_per_request=budget.state_blocks_per_request)
    step_model = StepTimeModel(model, gpu, tp=config.tp)
    line = _expert_line(model, config, pool, budget)
    staging = StagingModel(model, gpu, tp=config.tp,
                           config=StagingConfig(mode=config.staging_mode, routing_zipf_s=config.routing_zipf_s))
    policy = _policy(config, step_model, staging, line)
    if getattr(policy, "offload_at_start", False):
        line.offload(line.residency.next_offload_region(max_experts=line.residency.max_num_offloaded))
    scheduler = Scheduler(scheduler_config, kv, policy, expert_line=line)
    step_time = StepTimeWithStaging(step_model, staging, line, model.num_layers)
    replay = Replay(workload, scheduler, step_time, progress=progress,
                    offloaded_ratio=lambda: line.residency.offloaded_ratio)
    return BuiltReplay(replay, budget, config, line, step_time)


class StepTimeWithStaging:
    """Modeled step time plus the exposed staging of the experts offloaded at that moment; counts staged bytes."""

    def __init__(self, step_model: StepTimeModel, staging: StagingModel, line: ExpertLine, num_layers: int) -> None:
        self.step_model, self.staging, self.line, self.num_layers = step_model, staging, line, num_layers
        self.staged_bytes = 0.0

    def __call__(self, num_tokens: int, num_seqs: int, num_decode: int, kv_read: int, pairs: int) -> float:
        base = self.step_model.step_time_s(num_tokens, num_seqs, num_decode, kv_read, pairs)
        if not self.line.residency.num_offloaded:
            return base
        staged, exposed = self.staging.step(num_tokens, self.line.offloaded_per_layer, base / self.num_layers)
        self.staged_bytes += staged
        return base + exposed


def _expert_line(model, config: ReplayConfig, pool: BlockPool, budget: MemoryBudget) -> ExpertLine:
    shard = weights_per_gpu(model, tp=config.tp).expert_shard_bytes
    residency = ExpertResidency(ExpertResidencyConfig(
        num_layers=model.num_moe_layers, num_experts=model.num_experts, expert_bytes=shard,
        max_offload_ratio=config.max_offload_ratio))
    return ExpertLine(residency, pool, block_bytes=budget.charged_block_bytes, first_block_id=budget.num_blocks)


def _policy(config: ReplayConfig, step_model: StepTimeModel, staging: StagingModel, line: ExpertLine):
    if config.policy.lower() not in NEEDS_VAMP_PARAMS:
        try:
            return get_policy(config.policy)
        except ValueError as exc:
            raise UserError(str(exc)) from None
    return get_policy(config.policy, params=vamp_params(config, step_model, staging, line))


REFERENCE_CONTEXT_TOKENS = 16384  # context at which re-prefill and decode costs are priced for the policy
REFERENCE_DECODE_BATCH = 32


def vamp_params(config: ReplayConfig, step_model: StepTimeModel, staging: StagingModel, line: ExpertLine):
    """VAMP's coefficients from the perf model (modeled seconds)."""
    chunk, ctx = config.max_num_batched_tokens, REFERENCE_CONTEXT_TOKENS
    prefill_s = step_model.step_time_s(chunk, 1, 0, ctx + chunk, chunk * ctx + chunk * (chunk + 1) // 2) / chunk
    batch = min(config.max_num_seqs, REFERENCE_DECODE_BATCH)
    decode_s = step_model.step_time_s(batch, batch, batch, batch * (ctx + 1), batch * (ctx + 1))
    num_layers = len(line.offloaded_per_layer)
    per_layer_compute_s = decode_s / max(num_layers, 1)

    def staging_s_per_step(num_offloaded: int, num_tokens: int) -> float:
        base, extra = divmod(num_offloaded, num_layers)
        per_layer = [base + (1 if i < extra else 0) for i in range(num_layers)]
        return staging.step(num_tokens, per_layer, per_layer_compute_s)[1]

    return VampParams(prefill_s_per_token=prefill_s, decode_step_s=decode_s, staging_s_per_step=staging_s_per_step,
                      block_size=config.block_size, horizon_s=config.vamp_horizon_s, reference_step_tokens=batch,
                      reuse_tau_s=config.vamp_reuse_tau_s)


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
    return {"config": describe_config(workload, built), "metrics": metrics.to_dict()}, metrics


def describe_config(workload: Workload, built: BuiltReplay) -> dict[str, object]:
    budget = built.budget
    return {
        **asdict(built.config),
        "workload": {"name": workload.name, "source": workload.source, "mode": workload.mode,
                     "sessions": workload.num_sessions, "requests": workload.num_requests,
                     "key_block_size": workload.key_block_size},
        "memory": {"weights_bytes_per_gpu": budget.weights_bytes_per_gpu, "kv_budget_bytes": budget.kv_budget_bytes,
                   "block_bytes": budget.block_bytes, "num_blocks": budget.num_blocks,
                   "state_blocks_per_request": budget.state_blocks_per_request, "max_tokens": budget.max_tokens},
        "times": "modeled (roofline step-time model, docs/perf.md); not measured",
    }
