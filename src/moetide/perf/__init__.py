"""Performance models: roofline step time (``step``) and the per-GPU memory budget (``budget``).

Stdlib only, like ``core``: the simulator evaluates the step-time model on every simulated step. ``perf`` knows
specs and step shapes, never the scheduler's or a policy's decisions. Every figure is MODELED, not measured.
"""

from moetide.perf.budget import (
    MemoryBudget,
    WeightsPerGpu,
    block_bytes_per_gpu,
    check_tp,
    default_activation_reserve_bytes,
    kv_budget_bytes,
    kv_bytes_per_token_per_gpu,
    kv_heads_per_gpu,
    default_block_size,
    memory_budget,
    num_kv_blocks,
    state_bytes_per_seq_per_gpu,
    weights_per_gpu,
)
from moetide.perf.step import (
    Efficiency,
    StepShape,
    StepTimeModel,
    expected_distinct_experts,
    expected_distinct_experts_from_probs,
)

__all__ = [
    "Efficiency",
    "MemoryBudget",
    "StepShape",
    "StepTimeModel",
    "WeightsPerGpu",
    "block_bytes_per_gpu",
    "check_tp",
    "default_activation_reserve_bytes",
    "expected_distinct_experts",
    "expected_distinct_experts_from_probs",
    "kv_budget_bytes",
    "kv_bytes_per_token_per_gpu",
    "kv_heads_per_gpu",
    "default_block_size",
    "memory_budget",
    "num_kv_blocks",
    "state_bytes_per_seq_per_gpu",
    "weights_per_gpu",
]
