"""Mixtral (8x7B, 8x22B) as compact PyTorch over packed steps.

Follows transformers 5.19's ``modeling_mixtral.py``: GQA attention without q/k norms, full RoPE, a MoE block in
every layer. The router picks the top-k experts and weighs them by a softmax over the k logits; transformers
computes that as softmax over all experts, top-k, renormalize, which is the same numbers (softmax is monotonic
and the renormalization cancels the other experts' mass), and the engine follows transformers' order and keeps
the k weights in fp32 as it does. ``head_dim`` is ``hidden_size // num_attention_heads`` when the config has none.
On disk, transformers 5.19 writes Mixtral's experts under the original names: ``block_sparse_moe.gate`` and
``block_sparse_moe.experts.{e}.w1`` (gate) / ``w3`` (up) / ``w2`` (down).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from moetide.engine.models.common import (
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
class MixtralEngineConfig:
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
    moe_intermediate_size: int  # Mixtral's config calls the expert width intermediate_size

    @classmethod
    def from_hf(cls, data: dict[str, Any], origin: str) -> MixtralEngineConfig:
        spec = model_from_hf_dict(data, name="engine", origin=origin)
        r = ConfigReader(data, origin)
        require_silu(r)
        if data.get("sliding_window") is not None:
            raise UserError(f"{origin}: field 'sliding_window': {data['sliding_window']!r} is not supported "
                            f"(only null: full causal attention)")
        rope_theta, rotary_dim = read_rope(r, spec.head_dim)
        return cls(vocab_size=spec.vocab_size, hidden_size=spec.hidden_size, num_layers=spec.num_layers,
                   num_attention_heads=spec.num_attention_heads, num_kv_heads=spec.num_kv_heads,
                   head_dim=spec.head_dim, rope_theta=rope_theta, rotary_dim=rotary_dim,
                   rms_norm_eps=read_float(r, "rms_norm_eps"), tie_word_embeddings=spec.tie_word_embeddings,
                   num_experts=spec.num_experts, num_experts_per_tok=spec.num_experts_per_tok,
                   moe_intermediate_size=spec.moe_intermediate_size)


class MixtralForCausalLM(MoECausalLM):
    config_class = MixtralEngineConfig
    legacy_moe_module = "block_sparse_moe"
    legacy_expert_projs = ("w1", "w3", "w2")
    tiny_dense_layers = False

    @staticmethod
    def tiny_hf_config(args, common):
        from transformers import MixtralConfig

        return MixtralConfig(**common, num_local_experts=args.num_experts, intermediate_size=args.moe_intermediate_size)

    def __init__(self, config: MixtralEngineConfig) -> None:
        super().__init__(config, [self._layer(config, i) for i in range(config.num_layers)])

    @staticmethod
    def _layer(config: MixtralEngineConfig, layer_id: int) -> DecoderLayer:
        attn = Attention(config, layer_id, qk_norm=False)
        moe = SparseMoE(config, layer_id, norm_topk_prob=True, cast_weights=False)
        return DecoderLayer("self_attn", attn, moe, config.hidden_size, config.rms_norm_eps)
