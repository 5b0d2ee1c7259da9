"""Building blocks shared by the engine's MoE models, in gpt-fast style: small modules, shape comments, no cache.

Each block reproduces the arithmetic of its transformers 5.19 counterpart (same op order, same fp32 upcasts), so
an engine model and ``AutoModelForCausalLM`` on one checkpoint agree to fp32 round-off. What differs is the data
flow: the tokens of several sequences are packed into one [T, H] tensor (no batch axis, no padding), attention
goes through ``StepContext.attention``, and the MoE block runs only the experts its router selected, with explicit
expert ids, fetching each one's weights from ``StepContext.experts`` (see ``hooks``).

Parameter names follow transformers' in-memory (v5) names without the ``model.`` prefix: ``layers.3.self_attn.
q_proj.weight``, ``layers.3.mlp.experts.gate_up_proj`` [E, 2I, H]. ``MoECausalLM.checkpoint_targets`` maps them
to the names on disk, which for transformers 5.19 checkpoints are the older per-expert ones (see ``loader``).
"""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moetide.engine.models.hooks import (
    ContiguousKVCache,
    DictLinearStateStore,
    ExpertProvider,
    LinearStateShape,
    ModuleExpertProvider,
    StepBatch,
    StepContext,
)
from moetide.specs.hf_config import ConfigReader

Rope = tuple[Tensor, Tensor]  # cos, sin: [T, rotary_dim] each


# ---- config helpers ----------------------------------------------------------------------------------------


def read_rope(r: ConfigReader, head_dim: int, default_partial_factor: float = 1.0) -> tuple[float, int]:
    """(rope_theta, rotary_dim) from v5's ``rope_parameters`` or the older top-level keys; only plain RoPE."""
    params = r.data.get("rope_parameters") or {}
    scaling = r.data.get("rope_scaling") or {}
    rope_type = params.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
    if rope_type != "default":
        raise r.fail("rope_parameters", f"rope_type {rope_type!r} is not supported (only 'default')")
    theta = params.get("rope_theta", r.data.get("rope_theta"))
    if not isinstance(theta, (int, float)) or isinstance(theta, bool) or theta <= 0:
        raise r.fail("rope_theta", f"expected a positive number (in rope_parameters or top level), got {theta!r}")
    factor = params.get("partial_rotary_factor", r.data.get("partial_rotary_factor", default_partial_factor))
    rotary_dim = int(head_dim * factor)
    if not 0 < rotary_dim <= head_dim or rotary_dim % 2:
        raise r.fail("partial_rotary_factor", f"{factor!r} x head_dim {head_dim} must give an even rotary width")
    return float(theta), rotary_dim


def read_float(r: ConfigReader, key: str) -> float:
    value = r.data.get(key)
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise r.fail(key, f"expected a number, got {value!r}")
    return float(value)


def require_silu(r: ConfigReader) -> None:
    if r.data.get("hidden_act", "silu") != "silu":
        raise r.fail("hidden_act", f"only 'silu' is supported, got {r.data['hidden_act']!r}")


# ---- layers ------------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """RMSNorm over the last dim. ``zero_centered`` (Qwen3-Next) scales by ``1 + weight`` in fp32 and casts last;
    the plain form (Qwen3-MoE, Mixtral) casts the normalized input back first, then scales by ``weight``."""

    def __init__(self, dim: int, eps: float, zero_centered: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps, self.zero_centered = eps, zero_centered

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.zero_centered:
            return (normed * (1.0 + self.weight.float())).type_as(x)
        return self.weight * normed.to(x.dtype)


def rope_tables(positions: Tensor, rotary_dim: int, theta: float, dtype: torch.dtype) -> Rope:
    """cos, sin [T, rotary_dim] for LongTensor[T] positions (transformers' default RoPE, inv_freq on the CPU)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim))
    freqs = positions[:, None].float() * inv_freq.to(positions.device)  # [T, R/2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [T, R]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: Tensor, rope: Rope) -> Tensor:
    """x [T, h, D]: rotate the first rotary_dim dims (halves convention), pass the rest through."""
    cos, sin = rope[0][:, None, :], rope[1][:, None, :]
    rotary_dim = cos.shape[-1]
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
    return torch.cat([rot * cos + rotated * sin, rest], dim=-1)


class Attention(nn.Module):
    """GQA attention over the step's packed tokens. Options: per-head q/k RMSNorm (Qwen3), and Qwen3-Next's output
    gate: q_proj emits [q | gate] per head and the attention output is multiplied by sigmoid(gate)."""

    def __init__(self, config: Any, layer_id: int, *, qk_norm: bool, output_gate: bool = False,
                 zero_centered_norm: bool = False) -> None:
        super().__init__()
        self.layer_id, self.output_gate = layer_id, output_gate
        self.num_heads, self.num_kv_heads, self.head_dim = (config.num_attention_heads, config.num_kv_heads,
                                                            config.head_dim)
        hidden, q_width = config.hidden_size, self.num_heads * self.head_dim
        kv_width = self.num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(hidden, q_width * (2 if output_gate else 1), bias=False)
        self.k_proj = nn.Linear(hidden, kv_width, bias=False)
        self.v_proj = nn.Linear(hidden, kv_width, bias=False)
        self.o_proj = nn.Linear(q_width, hidden, bias=False)
        if qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, zero_centered_norm)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, zero_centered_norm)
        self.qk_norm = qk_norm

    def forward(self, x: Tensor, ctx: StepContext, rope: Rope) -> Tensor:
        T = x.shape[0]
        q = self.q_proj(x)  # [T, Hq * D] (or [T, Hq * 2D] with the output gate)
        gate = None
        if self.output_gate:
            q, gate = q.view(T, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
            gate = gate.reshape(T, -1)  # [T, Hq * D]
        q = q.reshape(T, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = self.k_proj(x).view(T, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = self.v_proj(x).view(T, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        out = ctx.attention.attend(self.layer_id, q, k, v, ctx.batch, self.head_dim**-0.5)  # [T, Hq, D]
        out = out.reshape(T, -1)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.o_proj(out)


class MLP(nn.Module):
    """SwiGLU feed-forward (dense layers and Qwen3-Next's shared expert)."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: Tensor, experts: ExpertProvider | None = None) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Experts(nn.Module):
    """The routed experts' weights, stacked: gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I]."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))


class SparseMoE(nn.Module):
    """Router, then a loop over only the experts the step selected. Routing is transformers 5.19's: softmax over
    all experts in fp32, top-k, optional renormalization of the k weights (``norm_topk_prob``; Mixtral always, which
    equals its original top-k-then-softmax). ``cast_weights`` casts the k weights to the activation dtype before
    use (Qwen3); Mixtral keeps them fp32 until the product is added. Optional shared expert with a sigmoid gate."""

    def __init__(self, config: Any, layer_id: int, *, norm_topk_prob: bool, cast_weights: bool,
                 shared_intermediate_size: int = 0) -> None:
        super().__init__()
        self.layer_id, self.top_k = layer_id, config.num_experts_per_tok
        self.norm_topk_prob, self.cast_weights = norm_topk_prob, cast_weights
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = Experts(config.num_experts, config.hidden_size, config.moe_intermediate_size)
        self.has_shared_expert = shared_intermediate_size > 0
        if self.has_shared_expert:
            self.shared_expert = MLP(config.hidden_size, shared_intermediate_size)
            self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)

    def route(self, x: Tensor) -> tuple[Tensor, Tensor]:
        logits = self.gate(x)  # [T, E]
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, expert_ids = torch.topk(probs, self.top_k, dim=-1)  # [T, K], [T, K]
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return (weights.to(logits.dtype) if self.cast_weights else weights), expert_ids

    def forward(self, x: Tensor, experts: ExpertProvider) -> Tensor:
        weights, expert_ids = self.route(x)  # [T, K], [T, K]
        experts.route(self.layer_id, expert_ids)
        out = torch.zeros_like(x)  # [T, H]
        for expert_id in expert_ids.unique().tolist():  # ascending, like transformers
            token_idx, rank = torch.where(expert_ids == expert_id)  # tokens routed here, and at which of their k
            w = experts.expert_weights(self.layer_id, expert_id)
            gate, up = F.linear(x.index_select(0, token_idx), w.gate_up).chunk(2, dim=-1)  # [t, I] each
            y = F.linear(F.silu(gate) * up, w.down) * weights[token_idx, rank, None]  # [t, H]
            out.index_add_(0, token_idx, y.to(out.dtype))
        if self.has_shared_expert:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


class DecoderLayer(nn.Module):
    """Pre-norm residual block: token mixer (``self_attn`` or ``linear_attn``), then MLP or MoE (``mlp``)."""

    def __init__(self, mixer_name: str, mixer: nn.Module, mlp: nn.Module, hidden_size: int, eps: float,
                 zero_centered_norm: bool = False) -> None:
        super().__init__()
        self.mixer_name = mixer_name
        self.add_module(mixer_name, mixer)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(hidden_size, eps, zero_centered_norm)
        self.post_attention_layernorm = RMSNorm(hidden_size, eps, zero_centered_norm)

    def forward(self, x: Tensor, ctx: StepContext, rope: Rope, experts: ExpertProvider) -> Tensor:
        x = x + getattr(self, self.mixer_name)(self.input_layernorm(x), ctx, rope)
        return x + self.mlp(self.post_attention_layernorm(x), experts)


# ---- the model ---------------------------------------------------------------------------------------------

_EXPERT_PARAM = re.compile(r"layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)")
_ROUTER_PARAM = re.compile(r"layers\.\d+\.mlp\.gate\.weight")


class MoECausalLM(nn.Module):
    """Embedding, decoder layers, final norm, LM head; ``forward`` runs one packed step.

    Subclasses build the layers and say how their checkpoints name experts: ``legacy_moe_module`` (the module
    holding router and experts on disk) and ``legacy_expert_projs`` (gate, up, down projection names)."""

    legacy_moe_module = "mlp"
    legacy_expert_projs = ("gate_proj", "up_proj", "down_proj")
    ignored_checkpoint_prefixes: tuple[str, ...] = ()  # tensors a checkpoint may carry that inference never uses
    zero_centered_norm = False

    def __init__(self, config: Any, layers: list[DecoderLayer]) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, self.zero_centered_norm)
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size,
                                                                         bias=False)
        self.own_experts = ModuleExpertProvider({i: layer.mlp.experts for i, layer in enumerate(layers)
                                                 if isinstance(layer.mlp, SparseMoE)})

    def forward(self, token_ids: Tensor, ctx: StepContext, *, all_logits: bool = False) -> Tensor:
        """token_ids LongTensor[T] (the step's tokens, packed in ``ctx.batch`` order) -> logits [B, V] for each
        sequence's last new token, or [T, V] for every token with ``all_logits``."""
        if token_ids.shape != (ctx.batch.num_tokens,):
            raise ValueError(f"token_ids has shape {tuple(token_ids.shape)}, the step has {ctx.batch.num_tokens}")
        x = self.embed_tokens(token_ids)  # [T, H]
        positions = ctx.batch.positions(x.device)
        rope = rope_tables(positions, self.config.rotary_dim, self.config.rope_theta, x.dtype)
        experts = ctx.experts if ctx.experts is not None else self.own_experts
        for layer in self.layers:
            x = layer(x, ctx, rope, experts)
        if not all_logits:
            x = x[ctx.batch.last_token_indices(x.device)]  # [B, H]
        x = self.norm(x)
        return F.linear(x, self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight)

    # ---- per-sequence state --------------------------------------------------------------------------------

    def linear_state_shapes(self) -> dict[int, LinearStateShape]:
        """Per linear-attention layer, the shapes of one sequence's state (empty for attention-only models)."""
        return {}

    def new_linear_state_store(self) -> DictLinearStateStore | None:
        shapes = self.linear_state_shapes()
        if not shapes:
            return None
        weight = self.embed_tokens.weight
        return DictLinearStateStore(shapes, conv_dtype=weight.dtype, device=weight.device)

    # ---- checkpoint names ----------------------------------------------------------------------------------

    @staticmethod
    def hf_name(name: str) -> str:
        return name if name.startswith("lm_head.") else "model." + name

    def checkpoint_targets(self, fused_experts: bool) -> dict[str, Tensor]:
        """On-disk tensor name -> the parameter (or view of one) it fills. ``fused_experts``: experts stored as
        transformers v5 holds them in memory ([E, 2I, H] gate_up_proj, [E, H, I] down_proj); otherwise one tensor
        per expert and projection, as transformers 5.19's ``save_pretrained`` writes them."""
        targets: dict[str, Tensor] = {}
        for name, param in self.named_parameters():
            match = _EXPERT_PARAM.fullmatch(name)
            if match and not fused_experts:
                targets.update(self._per_expert_targets(int(match[1]), match[2], param.detach()))
                continue
            if _ROUTER_PARAM.fullmatch(name) and not fused_experts:
                name = name.replace(".mlp.", f".{self.legacy_moe_module}.")
            targets[self.hf_name(name)] = param.detach()
        return targets

    def _per_expert_targets(self, layer_id: int, kind: str, param: Tensor) -> dict[str, Tensor]:
        prefix = f"model.layers.{layer_id}.{self.legacy_moe_module}.experts"
        gate, up, down = self.legacy_expert_projs
        targets = {}
        for e in range(param.shape[0]):
            if kind == "down_proj":
                targets[f"{prefix}.{e}.{down}.weight"] = param[e]
            else:
                width = param.shape[1] // 2
                targets[f"{prefix}.{e}.{gate}.weight"] = param[e, :width]
                targets[f"{prefix}.{e}.{up}.weight"] = param[e, width:]
        return targets


def greedy_generate(model: MoECausalLM, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy decoding of all prompts together, as ragged packed steps: one step prefills every prompt, each later
    step decodes one token per sequence. No stop tokens. Uses the reference KV cache and state store."""
    device = model.embed_tokens.weight.device
    ctx = StepContext(StepBatch.of([(i, len(p), 0) for i, p in enumerate(prompts)]), ContiguousKVCache(),
                      model.new_linear_state_store())
    tokens = torch.tensor([t for p in prompts for t in p], device=device)
    outputs: list[list[int]] = [[] for _ in prompts]
    lengths = [len(p) for p in prompts]
    with torch.no_grad():
        for _ in range(max_new_tokens):
            next_ids = model(tokens, ctx).argmax(dim=-1)  # [B]
            for out, token in zip(outputs, next_ids.tolist()):
                out.append(token)
            ctx.batch = StepBatch.of([(i, 1, n) for i, n in enumerate(lengths)])
            lengths = [n + 1 for n in lengths]
            tokens = next_ids
    return outputs
