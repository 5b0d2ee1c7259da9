"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B) as compact PyTorch over packed steps.

Follows transformers 5.19's ``modeling_qwen3_moe.py``: GQA attention with per-head q/k RMSNorm and full RoPE;
MoE in every layer unless ``mlp_only_layers`` or ``decoder_sparse_step`` make it a dense SwiGLU MLP; router
softmax -> top-k -> renormalize only if ``norm_topk_prob`` (false in the 30B/235B configs). The expert count is
read under either spelling: transformers 5.19 itself writes ``num_local_experts`` into a qwen3_moe config.json.
Sliding-window attention (``use_sliding_window``) is not supported; no released Qwen3-MoE uses it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from moetide.engine.models.common import (
    MLP,
    Attention,
    DecoderLayer,
    MoECausalLM,
    SparseMoE,
    read_float,
    read_rope,
    require_silu,
)
from moetide.errors import UserError
from moetide.specs.hf_config import ConfigReader, model_from_hf_dict


@dataclass(frozen=True, kw_only=True)
class Qwen3MoeEngineConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rotary_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    intermediate_size: int  # dense MLP width, used only by dense layers
    dense_mlp_layer_ids: tuple[int, ...]

    # transformers' defaults for keys a config.json may omit
    default_partial_rotary_factor: ClassVar[float] = 1.0
    default_norm_topk_prob: ClassVar[bool] = False

    @classmethod
    def fields_from_hf(cls, data: dict[str, Any], origin: str) -> dict[str, Any]:
        """Validated fields shared with Qwen3-Next; counts come from moetide's ModelSpec reader."""
        spec = model_from_hf_dict(data, name="engine", origin=origin)
        r = ConfigReader(data, origin)
        require_silu(r)
        rope_theta, rotary_dim = read_rope(r, spec.head_dim, cls.default_partial_rotary_factor)
        return dict(vocab_size=spec.vocab_size, hidden_size=spec.hidden_size, num_layers=spec.num_layers,
                    num_attention_heads=spec.num_attention_heads, num_kv_heads=spec.num_kv_heads,
                    head_dim=spec.head_dim, rope_theta=rope_theta, rotary_dim=rotary_dim,
                    rms_norm_eps=read_float(r, "rms_norm_eps"), tie_word_embeddings=spec.tie_word_embeddings,
                    num_experts=spec.num_experts, num_experts_per_tok=spec.num_experts_per_tok,
                    moe_intermediate_size=spec.moe_intermediate_size,
                    norm_topk_prob=r.bool("norm_topk_prob", cls.default_norm_topk_prob),
                    intermediate_size=spec.intermediate_size,
                    dense_mlp_layer_ids=tuple(spec.dense_mlp_layer_ids))

    @classmethod
    def from_hf(cls, data: dict[str, Any], origin: str) -> Qwen3MoeEngineConfig:
        if data.get("use_sliding_window"):
            raise UserError(f"{origin}: field 'use_sliding_window': true is not supported")
        return cls(**cls.fields_from_hf(data, origin))


def tiny_qwen_fields(args) -> dict:
    """The MoE fields of a tiny Qwen3 checkpoint (``engine.testmodel``), Qwen3-Next's too."""
    return dict(num_experts=args.num_experts, moe_intermediate_size=args.moe_intermediate_size,
                intermediate_size=2 * args.hidden_size, mlp_only_layers=list(args.dense_layer_ids))


class Qwen3MoeForCausalLM(MoECausalLM):
    config_class = Qwen3MoeEngineConfig

    @staticmethod
    def tiny_hf_config(args, common):
        from transformers import Qwen3MoeConfig

        return Qwen3MoeConfig(**common, **tiny_qwen_fields(args))

    def __init__(self, config: Qwen3MoeEngineConfig) -> None:
        super().__init__(config, [self._layer(config, i) for i in range(config.num_layers)])

    @staticmethod
    def _layer(config: Qwen3MoeEngineConfig, layer_id: int) -> DecoderLayer:
        attn = Attention(config, layer_id, qk_norm=True)
        if layer_id in config.dense_mlp_layer_ids:
            mlp = MLP(config.hidden_size, config.intermediate_size)
        else:
            mlp = SparseMoE(config, layer_id, norm_topk_prob=config.norm_topk_prob, cast_weights=True)
        return DecoderLayer("self_attn", attn, mlp, config.hidden_size, config.rms_norm_eps)
