"""Model facts: what a Mixture-of-Experts checkpoint holds, and what serving it costs in bytes.

Invariant: every figure is either *read* from a checkpoint's config (an HF ``config.json``) or computed from
read figures by the formula the reference implementation (HF transformers) uses to build its parameters.
Nothing is guessed: ``head_dim`` is a field, never ``hidden_size // num_attention_heads`` (Qwen3-30B-A3B has
head_dim 128 with hidden 2048 and 32 heads); which layers keep a growing KV cache (full attention) and which
keep a fixed-size state (linear attention: Gated DeltaNet in Qwen3-Next) is an explicit per-layer list, because
a KV budget computed over all layers would be 4x wrong for Qwen3-Next. Parameter counts are pinned in the tests
against transformers' own modules built on the meta device, so "exact" means exact.

Counts never depend on precision; byte figures take ``dtype_bytes`` (default 2 = bf16) because the same model
is served at different precisions. The dataclasses do no I/O; ``ModelSpec.from_hf_config`` delegates to
``moetide.specs.hf_config``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

FULL_ATTENTION = "full_attention"
LINEAR_ATTENTION = "linear_attention"
LAYER_TYPES = (FULL_ATTENTION, LINEAR_ATTENTION)
BF16_BYTES = 2


def _require_positive(owner: str, **values: int | None) -> None:
    for field_name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{owner}: {field_name} must be a positive integer, got {value!r}")


def _require_non_negative(owner: str, **values: int) -> None:
    for field_name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{owner}: {field_name} must be an integer >= 0, got {value!r}")


def _require_dtype_bytes(dtype_bytes: int) -> None:
    if isinstance(dtype_bytes, bool) or not isinstance(dtype_bytes, int) or dtype_bytes <= 0:
        raise ValueError(f"dtype_bytes must be a positive integer (2 = bf16), got {dtype_bytes!r}")


@dataclass(frozen=True)
class MLASpec:
    """Multi-head latent attention (DeepSeek-V2). The KV cache holds one latent of ``kv_lora_rank`` plus the
    shared rotary key of ``qk_rope_head_dim`` per token and layer, not per-head keys and values."""

    kv_lora_rank: int
    q_lora_rank: int | None  # None: queries are projected directly from the hidden state (V2-Lite)
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    def __post_init__(self) -> None:
        _require_positive("MLASpec", kv_lora_rank=self.kv_lora_rank, qk_nope_head_dim=self.qk_nope_head_dim,
                          qk_rope_head_dim=self.qk_rope_head_dim, v_head_dim=self.v_head_dim)
        if self.q_lora_rank is not None:
            _require_positive("MLASpec", q_lora_rank=self.q_lora_rank)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_cache_dim(self) -> int:
        """Elements cached per token per layer: the compressed latent plus the decoupled rotary key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class LinearAttentionSpec:
    """Gated DeltaNet (Qwen3-Next linear-attention layers). Per sequence and layer it keeps a fixed-size state,
    shaped as in transformers' ``Qwen3NextGatedDeltaNet`` and its cache: a conv state of
    (conv_dim, conv_kernel_size) with conv_dim = 2 * key_dim + value_dim, and a recurrent state of
    (num_value_heads, key_head_dim, value_head_dim)."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel_size: int

    def __post_init__(self) -> None:
        _require_positive("LinearAttentionSpec", num_key_heads=self.num_key_heads,
                          num_value_heads=self.num_value_heads, key_head_dim=self.key_head_dim,
                          value_head_dim=self.value_head_dim, conv_kernel_size=self.conv_kernel_size)
        if self.num_value_heads % self.num_key_heads:
            raise ValueError(f"LinearAttentionSpec: num_value_heads ({self.num_value_heads}) must be a multiple "
                             f"of num_key_heads ({self.num_key_heads})")

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    @property
    def conv_numel_per_seq(self) -> int:
        return self.conv_dim * self.conv_kernel_size

    @property
    def recurrent_numel_per_seq(self) -> int:
        return self.num_value_heads * self.key_head_dim * self.value_head_dim

    def params(self, hidden_size: int) -> int:
        in_proj = hidden_size * (2 * self.key_dim + 2 * self.value_dim)  # in_proj_qkvz
        in_proj += hidden_size * 2 * self.num_value_heads  # in_proj_ba
        conv = self.conv_dim * self.conv_kernel_size  # depthwise conv1d, no bias
        per_head = 2 * self.num_value_heads  # dt_bias, A_log
        norm = self.value_head_dim  # gated RMSNorm over one value head
        return in_proj + conv + per_head + norm + self.value_dim * hidden_size  # + out_proj


@dataclass(frozen=True)
class ModelSpec:
    """One MoE decoder-only model. SwiGLU MLPs throughout (gate, up, down; no biases); RMSNorm before
    attention and before the MLP of each layer, plus a final norm."""

    name: str
    model_type: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    tie_word_embeddings: bool
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int  # query/key head size of full attention; for MLA, qk_nope + qk_rope
    layer_types: tuple[str, ...]  # per layer: "full_attention" (growing KV) or "linear_attention" (fixed state)
    num_experts: int  # routed experts per MoE layer
    num_experts_per_tok: int  # top-k
    moe_intermediate_size: int  # width of one routed expert
    intermediate_size: int = 0  # width of the dense MLP in dense_mlp_layer_ids
    dense_mlp_layer_ids: tuple[int, ...] = ()  # layers with a dense MLP instead of experts
    num_shared_experts: int = 0
    shared_expert_intermediate_size: int = 0  # width of one shared expert
    shared_expert_gate: bool = False  # Qwen3-Next: sigmoid(hidden @ w) scales the shared expert's output
    attention_output_gate: bool = False  # Qwen3-Next: q_proj is 2x wide; half of it gates the output
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on queries and keys
    mla: MLASpec | None = None
    linear_attention: LinearAttentionSpec | None = None
    source: str = ""  # where the numbers came from (URL or file path)

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        object.__setattr__(self, "dense_mlp_layer_ids", tuple(self.dense_mlp_layer_ids))
        owner = f"ModelSpec {self.name!r}"
        if not isinstance(self.name, str) or not self.name:
            raise ValueError("ModelSpec: name must be a non-empty string")
        _require_positive(owner, num_layers=self.num_layers, hidden_size=self.hidden_size,
                          vocab_size=self.vocab_size, num_attention_heads=self.num_attention_heads,
                          num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, num_experts=self.num_experts,
                          num_experts_per_tok=self.num_experts_per_tok,
                          moe_intermediate_size=self.moe_intermediate_size)
        _require_non_negative(owner, intermediate_size=self.intermediate_size,
                              num_shared_experts=self.num_shared_experts,
                              shared_expert_intermediate_size=self.shared_expert_intermediate_size)
        self._validate_attention(owner)
        self._validate_mlp(owner)

    def _validate_attention(self, owner: str) -> None:
        if self.num_attention_heads % self.num_kv_heads:
            raise ValueError(f"{owner}: num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads})")
        if len(self.layer_types) != self.num_layers:
            raise ValueError(f"{owner}: layer_types has {len(self.layer_types)} entries, num_layers is "
                             f"{self.num_layers}")
        unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if unknown:
            raise ValueError(f"{owner}: unknown layer_types {unknown}; use {list(LAYER_TYPES)}")
        has_linear = LINEAR_ATTENTION in self.layer_types
        if has_linear != (self.linear_attention is not None):
            raise ValueError(f"{owner}: linear_attention must be given exactly when some layer is "
                             f"'{LINEAR_ATTENTION}' (linear layers: {has_linear})")

    def _validate_mlp(self, owner: str) -> None:
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"{owner}: num_experts_per_tok ({self.num_experts_per_tok}) exceeds num_experts "
                             f"({self.num_experts})")
        ids = self.dense_mlp_layer_ids
        if list(ids) != sorted(set(ids)) or any(not 0 <= i < self.num_layers for i in ids):
            raise ValueError(f"{owner}: dense_mlp_layer_ids must be sorted, unique and in [0, {self.num_layers})"
                             f", got {list(ids)}")
        if len(ids) == self.num_layers:
            raise ValueError(f"{owner}: every layer is dense; a MoE model needs at least one expert layer")
        if ids and self.intermediate_size <= 0:
            raise ValueError(f"{owner}: dense MLP layers {list(ids)} need intermediate_size > 0")
        if (self.num_shared_experts > 0) != (self.shared_expert_intermediate_size > 0):
            raise ValueError(f"{owner}: num_shared_experts and shared_expert_intermediate_size must both be 0 or "
                             f"both positive")
        if self.shared_expert_gate and self.num_shared_experts == 0:
            raise ValueError(f"{owner}: shared_expert_gate needs at least one shared expert")

    @classmethod
    def from_hf_config(cls, path: str | Path) -> ModelSpec:
        """Read an HF ``config.json`` (qwen3_moe, qwen3_next, mixtral, deepseek_v2); raises UserError."""
        from moetide.specs.hf_config import model_from_hf_config_file

        return model_from_hf_config_file(path)

    # ---- layers -------------------------------------------------------------------------------------------

    @property
    def full_attention_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL_ATTENTION)

    @property
    def linear_attention_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR_ATTENTION)

    @property
    def moe_layer_ids(self) -> tuple[int, ...]:
        dense = set(self.dense_mlp_layer_ids)
        return tuple(i for i in range(self.num_layers) if i not in dense)

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - len(self.dense_mlp_layer_ids)

    # ---- parameter counts -----------------------------------------------------------------------------------

    def _full_attention_params(self) -> int:
        h, n = self.hidden_size, self.num_attention_heads
        if self.mla is not None:
            return self._mla_params()
        q_out = n * self.head_dim * (2 if self.attention_output_gate else 1)
        params = h * q_out + 2 * h * self.num_kv_heads * self.head_dim + n * self.head_dim * h
        return params + (2 * self.head_dim if self.qk_norm else 0)

    def _mla_params(self) -> int:
        m, h, n = self.mla, self.hidden_size, self.num_attention_heads
        assert m is not None
        if m.q_lora_rank is None:
            q = h * n * m.qk_head_dim
        else:  # q_a_proj, q_a_layernorm, q_b_proj
            q = h * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * n * m.qk_head_dim
        kv = h * m.kv_cache_dim + m.kv_lora_rank  # kv_a_proj_with_mqa, kv_a_layernorm
        kv += m.kv_lora_rank * n * (m.qk_nope_head_dim + m.v_head_dim)  # kv_b_proj
        return q + kv + n * m.v_head_dim * h  # + o_proj

    def attention_params(self, layer_id: int) -> int:
        """Parameters of one layer's token mixer (full, MLA or linear attention)."""
        if self.layer_types[layer_id] == LINEAR_ATTENTION:
            assert self.linear_attention is not None
            return self.linear_attention.params(self.hidden_size)
        return self._full_attention_params()

    @property
    def params_per_expert(self) -> int:
        return 3 * self.hidden_size * self.moe_intermediate_size

    def mlp_params_non_expert(self, layer_id: int) -> int:
        """A dense layer's MLP; or a MoE layer's router, shared experts and shared-expert gate."""
        h = self.hidden_size
        if layer_id in self.dense_mlp_layer_ids:
            return 3 * h * self.intermediate_size
        shared = self.num_shared_experts * 3 * h * self.shared_expert_intermediate_size
        return self.num_experts * h + shared + (h if self.shared_expert_gate else 0)

    @property
    def params_embedding(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def params_non_expert(self) -> int:
        """Everything but routed experts: embeddings, lm_head (if untied), norms, attention, dense MLPs,
        routers, shared experts."""
        lm_head = 0 if self.tie_word_embeddings else self.params_embedding
        per_layer = sum(2 * self.hidden_size + self.attention_params(i) + self.mlp_params_non_expert(i)
                        for i in range(self.num_layers))
        return self.params_embedding + lm_head + self.hidden_size + per_layer

    @property
    def params_routed_experts(self) -> int:
        return self.num_moe_layers * self.num_experts * self.params_per_expert

    @property
    def params_total(self) -> int:
        return self.params_non_expert + self.params_routed_experts

    @property
    def params_active(self) -> int:
        """Parameters one token touches: all non-expert parameters plus top-k routed experts per MoE layer."""
        return self.params_non_expert + self.num_moe_layers * self.num_experts_per_tok * self.params_per_expert

    # ---- bytes ------------------------------------------------------------------------------------------------

    def expert_bytes(self, dtype_bytes: int = BF16_BYTES) -> int:
        """Bytes of one routed expert's weights (gate, up, down) in one layer."""
        _require_dtype_bytes(dtype_bytes)
        return self.params_per_expert * dtype_bytes

    def routed_expert_bytes_total(self, dtype_bytes: int = BF16_BYTES) -> int:
        _require_dtype_bytes(dtype_bytes)
        return self.params_routed_experts * dtype_bytes

    def non_expert_bytes(self, dtype_bytes: int = BF16_BYTES) -> int:
        _require_dtype_bytes(dtype_bytes)
        return self.params_non_expert * dtype_bytes

    def kv_bytes_per_token_per_layer(self, dtype_bytes: int = BF16_BYTES) -> int:
        """KV bytes one token adds to one full-attention layer (MLA: the latent plus the rotary key)."""
        _require_dtype_bytes(dtype_bytes)
        if self.mla is not None:
            return self.mla.kv_cache_dim * dtype_bytes
        return 2 * self.num_kv_heads * self.head_dim * dtype_bytes

    def kv_bytes_per_token(self, dtype_bytes: int = BF16_BYTES) -> int:
        """KV bytes one token adds over the layers that keep a growing cache (full attention only)."""
        return len(self.full_attention_layer_ids) * self.kv_bytes_per_token_per_layer(dtype_bytes)

    def linear_state_bytes_per_seq(self, dtype_bytes: int = BF16_BYTES, ssm_dtype_bytes: int | None = None) -> int:
        """Fixed bytes one sequence holds over all linear-attention layers (conv + recurrent state); 0 if none.
        ``ssm_dtype_bytes``: the recurrent state's element size where it differs (vLLM's
        ``mamba_ssm_cache_dtype=float32``: 4); None: ``dtype_bytes``."""
        _require_dtype_bytes(dtype_bytes)
        if self.linear_attention is None:
            return 0
        la = self.linear_attention
        per_layer = la.conv_numel_per_seq * dtype_bytes + la.recurrent_numel_per_seq * (ssm_dtype_bytes or dtype_bytes)
        return len(self.linear_attention_layer_ids) * per_layer

    # ---- FLOPs (for the roofline step-time model) ---------------------------------------------------------

    @property
    def matmul_flops_per_token(self) -> int:
        """2 x active parameters, less the embedding lookup (a gather, not a matmul). Norm and conv weights are
        included; they are < 0.01% of the total."""
        return 2 * (self.params_active - self.params_embedding)

    def attention_flops_per_token(self, context_tokens: int) -> int:
        """Score and value FLOPs of one query token attending to ``context_tokens`` cached tokens, summed over
        full-attention layers (QK^T and PV; MLA counted unabsorbed). Linear layers cost O(1) per token and
        their projections are already in matmul_flops_per_token."""
        _require_non_negative("attention_flops_per_token", context_tokens=context_tokens)
        if self.mla is not None:
            per_head = self.mla.qk_head_dim + self.mla.v_head_dim
        else:
            per_head = 2 * self.head_dim
        per_layer = 2 * self.num_attention_heads * per_head * context_tokens
        return len(self.full_attention_layer_ids) * per_layer
