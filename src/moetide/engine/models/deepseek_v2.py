"""DeepSeek-V2 (V2-Lite, V2, V2.5) as compact PyTorch over packed steps.

Follows transformers 5.19's ``modeling_deepseek_v2.py`` for the arithmetic, with one change of form: attention is
multi-head *latent* attention computed in the absorbed form. Per token and layer the KV cache holds one vector,
the RMS-normalized compressed latent ``c`` [kv_lora_rank] followed by the rotary key ``k_pe`` [qk_rope_head_dim]
shared by every head — not per-head K and V. Since head h's key is ``[W_UK_h · c, k_pe]`` and its value
``W_UV_h · c`` (``kv_b_proj``'s rows), the query is absorbed instead: ``q_h' = [W_UK_hᵀ · q_nope_h, q_pe_h]`` so
that ``q_h' · [c, k_pe]`` is head h's score, and the attention-weighted sum of latents is projected by ``W_UV_h``
afterwards. That is multi-query attention of ``Hq`` heads over one KV head whose values are the first
``kv_lora_rank`` elements of its keys, which every attention backend of the engine already computes: the model
passes the latent vector as both key and value (``KVLayout.values_in_keys`` stores it once) and keeps the first
``kv_lora_rank`` dims of the output. The numbers are transformers' to fp32 round-off (the sums run in another
order), not bit for bit.

The rest as transformers: the first ``first_k_dense_replace`` layers are dense SwiGLU MLPs, the others route with
a softmax over all experts in fp32 (from an fp32 router), top-k — over the best ``topk_group`` of ``n_group``
expert groups for ``group_limited_greedy`` — times ``routed_scaling_factor``, and add ungated shared experts. Two
config keys transformers 5.19 ignores are read as DeepSeek's own modeling code and vLLM read them:
``moe_layer_freq`` (a layer is MoE when its index is a multiple of it) and ``norm_topk_prob`` (renormalize the top-k
weights); the released V2 configs set neither away from its default.
RoPE rotates adjacent pairs (not halves), with YaRN's frequencies where the config asks for them (V2-Lite does).
Refused in one line: ``scoring_func`` other than softmax and ``topk_method`` other than the two above (V3's
sigmoid router and bias), attention or MLP biases, and a ``num_key_value_heads`` other than the head count (with
which transformers' own attention would not run).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from moetide.engine.models.common import (
    MLP,
    DecoderLayer,
    MoECausalLM,
    SparseMoE,
    read_float,
    read_rope_params,
    require_silu,
)
from moetide.engine.models.hooks import ExpertProvider, StepContext
from moetide.engine.models.norm_rope import RMSNorm, Rope, RopeCache, Yarn, apply_rope_interleaved
from moetide.engine.models.ops import linear
from moetide.errors import UserError
from moetide.specs.hf_config import ConfigReader, model_from_hf_dict

TOPK_METHODS = ("greedy", "group_limited_greedy")


@dataclass(frozen=True, kw_only=True)
class DeepseekV2EngineConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_theta: float
    yarn: Yarn | None
    rms_norm_eps: float
    tie_word_embeddings: bool
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    intermediate_size: int
    dense_mlp_layer_ids: tuple[int, ...]
    num_shared_experts: int
    routed_scaling_factor: float
    topk_method: str
    n_group: int
    topk_group: int
    norm_topk_prob: bool

    @property
    def rotary_dim(self) -> int:
        return self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """transformers' ``yarn_apply_mscale``: qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)² for YaRN."""
        scale = (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5
        if self.yarn is not None and self.yarn.mscale_all_dim:
            scale *= Yarn.mscale_of(self.yarn.factor, self.yarn.mscale_all_dim) ** 2
        return scale

    @classmethod
    def from_hf(cls, data: dict[str, Any], origin: str) -> DeepseekV2EngineConfig:
        spec = model_from_hf_dict(data, name="engine", origin=origin)
        r, mla = ConfigReader(data, origin), spec.mla
        require_silu(r)
        r.reject_true("attention_bias")
        if data.get("scoring_func", "softmax") != "softmax":
            raise r.fail("scoring_func", f"only 'softmax' (DeepSeek-V2) is supported, got {data['scoring_func']!r}")
        method = data.get("topk_method") or "greedy"
        if method not in TOPK_METHODS:
            raise r.fail("topk_method", f"{method!r} is not supported; expected one of {', '.join(TOPK_METHODS)}")
        if spec.num_kv_heads != spec.num_attention_heads:
            raise r.fail("num_key_value_heads", f"must equal num_attention_heads ({spec.num_attention_heads}) "
                                                f"for MLA, got {spec.num_kv_heads}")
        n_group, topk_group = (r.int("n_group"), r.int("topk_group")) if method != "greedy" else (1, 1)
        if method != "greedy" and (spec.num_experts % n_group or topk_group > n_group):
            raise r.fail("n_group", f"{spec.num_experts} experts in {n_group} groups, {topk_group} of them kept: "
                                    f"the groups must divide the experts and outnumber the kept ones")
        return cls(vocab_size=spec.vocab_size, hidden_size=spec.hidden_size, num_layers=spec.num_layers,
                   num_attention_heads=spec.num_attention_heads, q_lora_rank=mla.q_lora_rank,
                   kv_lora_rank=mla.kv_lora_rank, qk_nope_head_dim=mla.qk_nope_head_dim,
                   qk_rope_head_dim=mla.qk_rope_head_dim, v_head_dim=mla.v_head_dim,
                   **read_rope_yarn(r, mla.qk_rope_head_dim), rms_norm_eps=read_float(r, "rms_norm_eps"),
                   tie_word_embeddings=spec.tie_word_embeddings, num_experts=spec.num_experts,
                   num_experts_per_tok=spec.num_experts_per_tok, moe_intermediate_size=spec.moe_intermediate_size,
                   intermediate_size=spec.intermediate_size, dense_mlp_layer_ids=tuple(spec.dense_mlp_layer_ids),
                   num_shared_experts=spec.num_shared_experts,
                   routed_scaling_factor=read_float(r, "routed_scaling_factor") if "routed_scaling_factor" in data
                   else 1.0, topk_method=method,
                   n_group=n_group, topk_group=topk_group, norm_topk_prob=r.bool("norm_topk_prob", False))


def read_rope_yarn(r: ConfigReader, rotary_dim: int) -> dict[str, Any]:
    """``rope_theta`` and ``yarn`` (None for the default RoPE) from v5's ``rope_parameters`` or the older
    ``rope_scaling`` plus top-level ``rope_theta``; other RoPE types are refused."""
    params, rope_type, theta = read_rope_params(r)
    if rotary_dim % 2:
        raise r.fail("qk_rope_head_dim", f"must be even, got {rotary_dim}")
    if rope_type == "default":
        return dict(rope_theta=theta, yarn=None)
    if rope_type != "yarn":
        raise r.fail("rope_parameters", f"rope_type {rope_type!r} is not supported (only 'default' and 'yarn')")
    try:
        yarn = Yarn(factor=float(params["factor"]),
                    original_max_position_embeddings=int(params["original_max_position_embeddings"]),
                    beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
                    mscale=_optional_float(params, "mscale"), mscale_all_dim=_optional_float(params, "mscale_all_dim"),
                    attention_factor=_optional_float(params, "attention_factor"),
                    truncate=bool(params.get("truncate", True)))
    except (KeyError, TypeError, ValueError) as err:
        raise r.fail("rope_parameters", f"a yarn RoPE needs a numeric factor and original_max_position_embeddings "
                                        f"({err})") from None
    return dict(rope_theta=theta, yarn=yarn)


def _optional_float(params: dict[str, Any], key: str) -> float | None:
    return None if params.get(key) is None else float(params[key])


class MLAttention(nn.Module):
    """Multi-head latent attention in the absorbed form (module docstring). Parameters carry transformers'
    names, so the checkpoint loads as it is."""

    joint_qk = False  # not the fused q/k path of ``DecoderLayer.native_attention_args``

    def __init__(self, config: DeepseekV2EngineConfig, layer_id: int) -> None:
        super().__init__()
        self.layer_id, self.num_heads = layer_id, config.num_attention_heads
        self.nope, self.rope_dim, self.rank = config.qk_nope_head_dim, config.qk_rope_head_dim, config.kv_lora_rank
        self.v_head_dim, self.scale = config.v_head_dim, config.softmax_scale
        hidden, q_width = config.hidden_size, self.num_heads * (self.nope + self.rope_dim)
        if config.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, q_width, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, config.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, 1e-6)  # transformers' DeepseekV2RMSNorm default
            self.q_b_proj = nn.Linear(config.q_lora_rank, q_width, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, self.rank + self.rope_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(self.rank, 1e-6)
        self.kv_b_proj = nn.Linear(self.rank, self.num_heads * (self.nope + self.v_head_dim), bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.v_head_dim, hidden, bias=False)
        self._uv_t: Tensor | None = None  # W_UV transposed per head (``uv_transposed``), and the weight it is of
        self._uv_of: tuple | None = None

    def uv_transposed(self) -> Tensor:
        """Each head's W_UV transposed, [Hq, r, v_head_dim] contiguous: the batched GEMM after attention reads it
        as stored (on the CPU 2-5x faster than an einsum over kv_b_proj's rows at decode sizes). A copy of
        kv_b_proj's W_UV rows, redone when that weight is replaced or written."""
        w = self.kv_b_proj.weight
        of = (w.data_ptr(), w.dtype, w.device, w._version)
        if self._uv_of != of:
            kv_b = w.detach().view(self.num_heads, self.nope + self.v_head_dim, self.rank)
            self._uv_t, self._uv_of = kv_b[:, self.nope :].transpose(1, 2).contiguous(), of
        return self._uv_t

    def query(self, x: Tensor) -> Tensor:
        if hasattr(self, "q_proj"):
            return linear(x, self.q_proj.weight)
        return linear(self.q_a_layernorm(linear(x, self.q_a_proj.weight)), self.q_b_proj.weight)

    def forward(self, x: Tensor, ctx: StepContext, rope: Rope) -> Tensor:
        T, Hq, r = x.shape[0], self.num_heads, self.rank
        q = self.query(x).view(T, Hq, self.nope + self.rope_dim)
        q_nope, q_pe = q.split([self.nope, self.rope_dim], dim=-1)
        latent, k_pe = linear(x, self.kv_a_proj_with_mqa.weight).split([r, self.rope_dim], dim=-1)
        kv_b = self.kv_b_proj.weight.view(Hq, self.nope + self.v_head_dim, r)  # rows: head h's W_UK, then W_UV
        q_latent = torch.bmm(q_nope.transpose(0, 1), kv_b[:, : self.nope]).transpose(0, 1)  # [T, Hq, r]
        q_abs = torch.cat([q_latent, apply_rope_interleaved(q_pe, rope)], dim=-1)  # [T, Hq, r + rope]
        kv = torch.cat([self.kv_a_layernorm(latent), apply_rope_interleaved(k_pe[:, None], rope)[:, 0]], dim=-1)
        kv = kv[:, None]  # [T, 1, r + rope]: the one vector a token caches, read as key and as value
        out = ctx.attention.attend(self.layer_id, q_abs, kv, kv, ctx.batch, self.scale)[..., :r]  # [T, Hq, r]
        out = torch.bmm(out.transpose(0, 1), self.uv_transposed()).transpose(0, 1)  # [T, Hq, v_head_dim]
        return linear(out.reshape(T, -1), self.o_proj.weight)


class DeepseekMoE(SparseMoE):
    """DeepSeek-V2's MoE block: its router (fp32 logits, softmax, optional group-limited top-k, scaled weights
    kept in fp32 until each product is added, as Mixtral's) and ungated shared experts added to the routed sum."""

    def __init__(self, config: DeepseekV2EngineConfig, layer_id: int) -> None:
        super().__init__(config, layer_id, norm_topk_prob=config.norm_topk_prob, cast_weights=False)
        self.scaling, self.method = config.routed_scaling_factor, config.topk_method
        self.n_group, self.topk_group = config.n_group, config.topk_group
        self.has_shared_expert = config.num_shared_experts > 0
        if self.has_shared_expert:
            self.shared_experts = MLP(config.hidden_size, config.moe_intermediate_size * config.num_shared_experts)

    def native_routes(self, x: Tensor) -> bool:
        """Never: the native router knows neither expert groups nor the scaling factor."""
        return False

    def route(self, x: Tensor) -> tuple[Tensor, Tensor]:
        logits = torch.nn.functional.linear(x.float(), self.gate.weight.float())  # [T, E], fp32 as transformers
        scores = logits.softmax(dim=-1)
        if self.method == "group_limited_greedy":
            groups = scores.view(-1, self.n_group, scores.shape[-1] // self.n_group)  # [T, G, E/G]
            kept = torch.topk(groups.max(dim=-1).values, self.topk_group, dim=-1, sorted=False).indices
            mask = torch.zeros_like(groups[..., 0]).scatter_(1, kept, 1.0).bool()  # [T, G]
            scores = groups.masked_fill(~mask[..., None], 0.0).view_as(scores)
        weights, expert_ids = torch.topk(scores, self.top_k, dim=-1, sorted=False)  # [T, K] each
        if self.norm_topk_prob and self.top_k > 1:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scaling, expert_ids

    def forward(self, x: Tensor, experts: ExpertProvider) -> Tensor:
        out = self.routed_experts(x, experts)
        return out + self.shared_experts(x) if self.has_shared_expert else out


class DeepseekV2ForCausalLM(MoECausalLM):
    config_class = DeepseekV2EngineConfig
    tiny_num_layers = 3

    @staticmethod
    def tiny_hf_config(args, common):
        from transformers import DeepseekV2Config

        dense = args.dense_layer_ids or (0,)  # DeepSeek's dense layers come first: first_k_dense_replace
        if tuple(sorted(dense)) != tuple(range(len(dense))):
            raise UserError(f"deepseek_v2's dense layers are its first ones (first_k_dense_replace); "
                            f"{list(dense)} is not 0..k-1")
        fields = {**common, "num_key_value_heads": args.num_attention_heads}
        fields.pop("head_dim")
        return DeepseekV2Config(
            **fields, kv_lora_rank=args.kv_lora_rank or 2 * args.head_dim, q_lora_rank=None,
            qk_nope_head_dim=args.head_dim, qk_rope_head_dim=args.qk_rope_head_dim or args.head_dim // 2,
            v_head_dim=args.head_dim, n_routed_experts=args.num_experts,
            n_shared_experts=1, moe_intermediate_size=args.moe_intermediate_size,
            intermediate_size=2 * args.hidden_size, first_k_dense_replace=len(dense),
            topk_method="group_limited_greedy", n_group=2, topk_group=1, routed_scaling_factor=1.5,
            rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                 original_max_position_embeddings=args.max_position_embeddings // 4,
                                 mscale=0.707, mscale_all_dim=0.707, beta_fast=32, beta_slow=1))

    def __init__(self, config: DeepseekV2EngineConfig) -> None:
        super().__init__(config, [self._layer(config, i) for i in range(config.num_layers)])
        self.rope = RopeCache(config.rotary_dim, config.rope_theta, config.yarn)
        self.rope_dtype = torch.float32  # transformers rotates in fp32 from fp32 tables

    def kv_cache_shape(self) -> tuple[int, int, bool]:
        """One latent plus the rope key per token and layer, read as key and as value (``KVLayout``)."""
        return 1, self.config.kv_lora_rank + self.config.qk_rope_head_dim, True

    @staticmethod
    def _layer(config: DeepseekV2EngineConfig, layer_id: int) -> DecoderLayer:
        attn = MLAttention(config, layer_id)
        if layer_id in config.dense_mlp_layer_ids:
            mlp = MLP(config.hidden_size, config.intermediate_size)
        else:
            mlp = DeepseekMoE(config, layer_id)
        return DecoderLayer("self_attn", attn, mlp, config.hidden_size, config.rms_norm_eps)
