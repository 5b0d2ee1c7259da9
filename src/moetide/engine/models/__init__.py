"""The engine's model architectures, by HF ``model_type`` (one registry dict, no if-chains).

Each class builds from its engine config dataclass (``config_class.from_hf(config_dict, origin)``), runs one packed
step per ``forward(token_ids, StepContext)``, and names its checkpoint tensors (``checkpoint_targets``).
"""

from __future__ import annotations

from moetide.engine.defaults import ENGINE_ARCHS
from moetide.engine.models.common import MoECausalLM, greedy_generate
from moetide.engine.models.hooks import (
    AttentionBackend,
    ContiguousKVCache,
    DecodeRows,
    DictLinearStateStore,
    ExpertProvider,
    ExpertWeights,
    LinearState,
    LinearStateShape,
    LinearStateStore,
    ModuleExpertProvider,
    StateBlocks,
    StateField,
    StateLayout,
    StepBatch,
    StepContext,
    causal_attention,
)
from moetide.engine.models.deepseek_v2 import DeepseekV2EngineConfig, DeepseekV2ForCausalLM
from moetide.engine.models.mixtral import MixtralEngineConfig, MixtralForCausalLM
from moetide.engine.models.qwen3_moe import Qwen3MoeEngineConfig, Qwen3MoeForCausalLM
from moetide.engine.models.qwen3_next import Qwen3NextEngineConfig, Qwen3NextForCausalLM

MODEL_CLASSES: dict[str, type[MoECausalLM]] = {
    "qwen3_moe": Qwen3MoeForCausalLM,
    "mixtral": MixtralForCausalLM,
    "qwen3_next": Qwen3NextForCausalLM,
    "deepseek_v2": DeepseekV2ForCausalLM,
}
if tuple(MODEL_CLASSES) != ENGINE_ARCHS:
    raise ImportError(f"engine.defaults.ENGINE_ARCHS {ENGINE_ARCHS} must name MODEL_CLASSES' architectures, "
                      f"{tuple(MODEL_CLASSES)}")

__all__ = [
    "MODEL_CLASSES",
    "AttentionBackend",
    "ContiguousKVCache",
    "DeepseekV2EngineConfig",
    "DeepseekV2ForCausalLM",
    "DecodeRows",
    "DictLinearStateStore",
    "ExpertProvider",
    "ExpertWeights",
    "LinearState",
    "LinearStateShape",
    "LinearStateStore",
    "MixtralEngineConfig",
    "MixtralForCausalLM",
    "MoECausalLM",
    "ModuleExpertProvider",
    "Qwen3MoeEngineConfig",
    "Qwen3MoeForCausalLM",
    "Qwen3NextEngineConfig",
    "Qwen3NextForCausalLM",
    "StateBlocks",
    "StateField",
    "StateLayout",
    "StepBatch",
    "StepContext",
    "causal_attention",
    "greedy_generate",
]
