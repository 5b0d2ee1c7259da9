"""Build a replay from user-facing settings: specs → memory budget → pool, scheduler, policy, step-time model.

This is the one place where ``perf`` figures become the plain numbers ``core`` consumes (block counts, state
blocks per request), so ``core`` never imports ``perf``. Everything a replay's result depends on is in
``ReplayConfig`` and is written into the result's ``config``, so a JSON file says how it was made.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

from moetide.core.blocks import BlockPool
from moetide.core.kv_manager import KVCacheManager
from moetide.core.pressure import get_policy
from moetide.core.scheduler import Scheduler, SchedulerConfig
from moetide.errors import UserError
from moetide.perf import MemoryBudget, StepTimeModel, memory_budget
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
    block_size: int = 16
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    gpu_memory_utilization: float = 0.9
    kv_budget_gib: float | None = None  # per GPU; None: utilization × HBM − weights − activation reserve
    enable_prefix_caching: bool = True
    state_checkpoints: bool = False  # hybrid models: charge a state checkpoint per cached block (vLLM's option)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.tp <= 0:
            raise UserError(f"--tp must be a positive integer, got {self.tp}")
        if self.block_size <= 0:
            raise UserError(f"--block-size must be positive, got {self.block_size}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise UserError(f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_budget_gib is not None and self.kv_budget_gib <= 0:
            raise UserError(f"--kv-budget-gib must be positive, got {self.kv_budget_gib}")


@dataclass
class BuiltReplay:
    replay: Replay
    budget: MemoryBudget
    config: ReplayConfig


def build_replay(
    workload: Workload, config: ReplayConfig, progress: Callable[[int, int], None] | None = None
) -> BuiltReplay:
    model, gpu = get_model(config.model), get_gpu(config.gpu)
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
        policy = get_policy(config.policy)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    pool = BlockPool(range(budget.num_blocks), enable_caching=config.enable_prefix_caching)
    kv = KVCacheManager(pool, config.block_size, num_state_blocks_per_request=budget.state_blocks_per_request)
    scheduler = Scheduler(scheduler_config, kv, policy)
    step_model = StepTimeModel(model, gpu, tp=config.tp)
    replay = Replay(workload, scheduler, step_model.step_time_s, progress=progress)
    return BuiltReplay(replay, budget, config)


def run_replay(
    workload: Workload, config: ReplayConfig, progress: Callable[[int, int], None] | None = None
) -> tuple[dict[str, object], MetricsCollector]:
    """Replay; return ``{"config": …, "metrics": …}`` (times in seconds, MODELED by the roofline) and the raw
    collector (per-request samples, for plots)."""
    built = build_replay(workload, config, progress)
    metrics = built.replay.run()
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
