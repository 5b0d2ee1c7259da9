"""Qwen3-Next (80B-A3B): hybrid Gated DeltaNet / gated full attention MoE, as compact PyTorch over packed steps.

Follows transformers 5.19's ``modeling_qwen3_next.py`` (its PyTorch fallback, which is what runs without the
flash-linear-attention and causal-conv1d kernels):

- ``layer_types`` (default: every 4th layer full attention, the rest linear attention).
- Full attention: q_proj emits [q | gate] per head, q/k RMSNorm, partial RoPE (``partial_rotary_factor``, 0.25:
  only the first quarter of each head rotates), output multiplied by sigmoid(gate) before o_proj.
- Gated DeltaNet: in_proj_qkvz / in_proj_ba grouped per key head; a depthwise causal conv1d + SiLU over
  [q, k, v] carrying a (kernel-1)-wide conv state; q, k L2-normalized (fp32) and q scaled by Dk^-0.5; decay
  g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b); the gated delta rule carries a fp32 recurrent
  state [Hv, Dk, Dv]; output RMSNorm-ed per value head and gated by SiLU(z) (``GatedRMSNorm``), then out_proj.
  The rule runs chunked (transformers' ``torch_chunk_gated_delta_rule``) for multi-token pieces and recurrent
  (``torch_recurrent_gated_delta_rule``) for one-token pieces; sequences with the same number of new tokens in a
  step are batched together. On the CPU (fp32 or bf16) a group runs conv, norms and the rule token by token in
  one native call that updates each sequence's state where it lies (``engine.native.gdn_forward``; equal to
  fp32 round-off), instead of stacking the states, padding to a chunk and copying them back.
- Every RMSNorm except the gated one is zero-centered: it scales by (1 + weight).
- MoE as Qwen3-MoE plus a shared expert scaled by sigmoid(shared_expert_gate(x)).
Released checkpoints also carry multi-token-prediction weights (``mtp.*``); inference ignores them, like
transformers.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moetide.engine import native
from moetide.engine.models.common import (
    MLP,
    Attention,
    DecoderLayer,
    MoECausalLM,
    SparseMoE,
)
from moetide.engine.models.hooks import LinearStateShape, StepBatch, StepContext
from moetide.engine.models.norm_rope import Rope
from moetide.engine.models.ops import linear
from moetide.engine.models.qwen3_moe import Qwen3MoeEngineConfig, tiny_qwen_fields
from moetide.specs import LINEAR_ATTENTION
from moetide.specs.hf_config import ConfigReader, model_from_hf_dict

CHUNK_SIZE = 64  # transformers' default chunk for the chunked gated delta rule


@dataclass(frozen=True, kw_only=True)
class Qwen3NextEngineConfig(Qwen3MoeEngineConfig):
    layer_types: tuple[str, ...]
    shared_expert_intermediate_size: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int

    default_partial_rotary_factor: ClassVar[float] = 0.25
    default_norm_topk_prob: ClassVar[bool] = True

    @classmethod
    def from_hf(cls, data: dict[str, Any], origin: str) -> Qwen3NextEngineConfig:
        spec = model_from_hf_dict(data, name="engine", origin=origin)
        linear = spec.linear_attention
        if linear is not None and linear.conv_kernel_size < 2:
            raise ConfigReader(data, origin).fail("linear_conv_kernel_dim", "must be >= 2")
        return cls(**cls.fields_from_hf(data, origin), layer_types=spec.layer_types,
                   shared_expert_intermediate_size=spec.shared_expert_intermediate_size,
                   linear_num_key_heads=linear.num_key_heads if linear else 1,
                   linear_num_value_heads=linear.num_value_heads if linear else 1,
                   linear_key_head_dim=linear.key_head_dim if linear else 1,
                   linear_value_head_dim=linear.value_head_dim if linear else 1,
                   linear_conv_kernel_dim=linear.conv_kernel_size if linear else 2)


# ---- the gated delta rule ----------------------------------------------------------------------------------


def l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def recurrent_gated_delta(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                          state: Tensor) -> tuple[Tensor, Tensor]:
    """Token by token. q, k [B, Hv, T, Dk]; v [B, Hv, T, Dv]; g, beta [B, Hv, T]; state [B, Hv, Dk, Dv] (fp32)."""
    out = torch.empty_like(v)
    for t in range(q.shape[2]):
        state = state * g[:, :, t].exp()[..., None, None]
        k_t = k[:, :, t, :, None]  # [B, Hv, Dk, 1]
        delta = (v[:, :, t] - (state * k_t).sum(dim=-2)) * beta[:, :, t, None]  # [B, Hv, Dv]
        state = state + k_t * delta[:, :, None, :]
        out[:, :, t] = (state * q[:, :, t, :, None]).sum(dim=-2)
    return out, state


def chunked_gated_delta(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                        state: Tensor, chunk_size: int = CHUNK_SIZE) -> tuple[Tensor, Tensor]:
    """Same contract as ``recurrent_gated_delta``, in chunks: within a chunk the delta-rule updates are condensed
    by a unit-lower-triangular (UT) solve; across chunks the state is carried sequentially."""
    B, Hv, T, _ = k.shape
    pad = (-T) % chunk_size
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    q, k, v = (x.reshape(B, Hv, -1, chunk_size, x.shape[-1]) for x in (q, k, v))  # [B, Hv, N, C, D]
    beta = beta.reshape(B, Hv, -1, chunk_size, 1)
    k_beta, v_beta = k * beta, v * beta
    decay = g.reshape(B, Hv, -1, chunk_size).cumsum(dim=-1)  # log of the decay from the chunk start
    future = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)
    pairwise = (decay[..., :, None] - decay[..., None, :]).masked_fill(future, float("-inf")).exp()  # [.., C, C]
    ut = (k_beta @ k.transpose(-1, -2)) * pairwise
    intra = (q @ k.transpose(-1, -2)) * pairwise
    new_values = torch.linalg.solve_triangular(ut, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(ut, k_beta * decay.exp()[..., None], upper=False,
                                               unitriangular=True)
    q = q * decay.exp()[..., None]
    k = k * (decay[..., -1:] - decay).exp()[..., None]
    chunk_decay = decay[..., -1].exp()[..., None, None]  # [B, Hv, N, 1, 1]
    out = torch.empty_like(new_values)
    for i in range(new_values.shape[2]):
        v_new = new_values[:, :, i] - k_cumdecay[:, :, i] @ state
        out[:, :, i] = q[:, :, i] @ state + intra[:, :, i] @ v_new
        state = state * chunk_decay[:, :, i] + k[:, :, i].transpose(-1, -2) @ v_new
    return out.reshape(B, Hv, -1, out.shape[-1])[:, :, :T], state


def gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                     state: Tensor) -> tuple[Tensor, Tensor]:
    """q, k [B, T, Hv, Dk]; v [B, T, Hv, Dv]; g, beta [B, T, Hv]; state [B, Hv, Dk, Dv] ->
    (out [B, T, Hv, Dv] in q's dtype, new fp32 state). All arithmetic in fp32, as transformers does."""
    dtype = q.dtype
    q, k, v, g, beta = (x.transpose(1, 2).float().contiguous() for x in (q, k, v, g, beta))
    q, k = l2norm(q), l2norm(k)
    q = q * q.shape[-1] ** -0.5
    rule = recurrent_gated_delta if q.shape[2] == 1 else chunked_gated_delta
    out, state = rule(q, k, v, g, beta, state.float())
    return out.transpose(1, 2).to(dtype), state


# ---- the linear-attention layer ----------------------------------------------------------------------------


class GatedRMSNorm(nn.Module):
    """RMSNorm (plain weight, not zero-centered) then multiplied by SiLU(gate) in fp32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps

    def forward(self, x: Tensor, gate: Tensor) -> Tensor:
        if native.worth_it(x, x.numel(), native.EXPERT_DTYPES) and self.weight.dtype == x.dtype == gate.dtype:
            return native.rms_norm(x, self.eps, self.weight, False, gate)
        x32 = x.float()
        normed = self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return (normed * F.silu(gate.float())).to(x.dtype)


class LengthGroup(NamedTuple):
    """Sequences of a step with equal new-token counts: their token indices, in order; [(seq_id, computed)]; and
    int64 [B] flags, 1 where a sequence starts from an empty state (what ``native.gdn_forward`` reads)."""

    token_idx: Tensor
    seqs: list[tuple[int, int]]
    fresh: Tensor


@functools.lru_cache(maxsize=2)
def _groups_by_length(batch: StepBatch, device: torch.device) -> list[LengthGroup]:
    """The step's ``LengthGroup``s. Every linear layer of a step asks the same; the step's batch is the cache key
    (read-only results)."""
    groups: dict[int, tuple[list[Tensor], list[tuple[int, int]]]] = {}
    for seq_id, sl, computed in zip(batch.seq_ids, batch.token_slices(), batch.num_computed_tokens):
        idx, seqs = groups.setdefault(sl.stop - sl.start, ([], []))
        idx.append(torch.arange(sl.start, sl.stop, device=device))
        seqs.append((seq_id, computed))
    return [LengthGroup(torch.cat(idx), seqs, torch.tensor([computed == 0 for _, computed in seqs], dtype=torch.int64))
            for idx, seqs in groups.values()]


class GatedDeltaNet(nn.Module):
    def __init__(self, config: Qwen3NextEngineConfig, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_k_heads, self.num_v_heads = config.linear_num_key_heads, config.linear_num_value_heads
        self.head_k_dim, self.head_v_dim = config.linear_key_head_dim, config.linear_value_head_dim
        self.key_dim, self.value_dim = self.num_k_heads * self.head_k_dim, self.num_v_heads * self.head_v_dim
        self.conv_dim, self.kernel = 2 * self.key_dim + self.value_dim, config.linear_conv_kernel_dim
        hidden = config.hidden_size
        self.in_proj_qkvz = nn.Linear(hidden, 2 * self.key_dim + 2 * self.value_dim, bias=False)
        self.in_proj_ba = nn.Linear(hidden, 2 * self.num_v_heads, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.kernel, groups=self.conv_dim, bias=False,
                                padding=self.kernel - 1)
        self.dt_bias = nn.Parameter(torch.empty(self.num_v_heads))
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads))
        self.norm = GatedRMSNorm(self.head_v_dim, config.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, hidden, bias=False)

    def state_shape(self) -> LinearStateShape:
        return LinearStateShape((self.conv_dim, self.kernel - 1), (self.num_v_heads, self.head_k_dim, self.head_v_dim))

    def _project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """x [T, H] -> mixed [q|k|v] [T, C], z [T, Hv, Dv], b [T, Hv], a [T, Hv]. The projections are grouped
        per key head: [q (Dk), k (Dk), v (r*Dv), z (r*Dv)] and [b (r), a (r)] with r = Hv / Hk."""
        T, r = x.shape[0], self.num_v_heads // self.num_k_heads
        qkvz = linear(x, self.in_proj_qkvz.weight).view(T, self.num_k_heads, -1)
        q, k, v, z = torch.split(qkvz, [self.head_k_dim, self.head_k_dim, r * self.head_v_dim,
                                        r * self.head_v_dim], dim=-1)
        b, a = torch.split(linear(x, self.in_proj_ba.weight).view(T, self.num_k_heads, 2 * r), [r, r], dim=-1)
        mixed = torch.cat([q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)], dim=-1)
        return mixed, z.reshape(T, self.num_v_heads, self.head_v_dim), b.reshape(T, -1), a.reshape(T, -1)

    def forward(self, x: Tensor, ctx: StepContext, rope: Rope) -> Tensor:
        if ctx.linear_states is None:
            raise ValueError("Qwen3-Next linear-attention layers need StepContext.linear_states")
        T = x.shape[0]
        mixed, z, b, a = self._project(x)
        beta = b.sigmoid()  # [T, Hv]
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)  # [T, Hv] log decay, fp32
        groups = _groups_by_length(ctx.batch, x.device)
        if len(groups) == 1:  # one group holds every token, in order
            core = self._run_group(mixed, beta, g, groups[0], ctx)
        else:
            core = x.new_empty(T, self.num_v_heads, self.head_v_dim)
            for group in groups:
                idx = group.token_idx
                core[idx] = self._run_group(mixed[idx], beta[idx], g[idx], group, ctx)
        out = self.norm(core.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
        return linear(out.view(T, -1), self.out_proj.weight)

    def _run_group(self, mixed: Tensor, beta: Tensor, g: Tensor, group: LengthGroup, ctx: StepContext) -> Tensor:
        """B sequences with Ts new tokens each (rows sequence-major) -> core output [B*Ts, Hv, Dv]."""
        seqs = group.seqs
        B, Ts, r = len(seqs), mixed.shape[0] // len(seqs), self.num_v_heads // self.num_k_heads
        if native.worth_it(mixed, B * Ts * self.num_v_heads * self.head_k_dim * self.head_v_dim * 3,
                           native.EXPERT_DTYPES):
            blocks = ctx.linear_states.state_blocks([seq_id for seq_id, _ in seqs])
            if blocks is not None:
                return native.gdn_forward(mixed, self.conv1d.weight, blocks, self.layer_id, group.fresh, g, beta,
                                          self.num_k_heads, self.head_k_dim, self.head_v_dim)
        states = [ctx.linear_states.state(self.layer_id, seq_id) for seq_id, _ in seqs]
        conv0 = torch.stack([s.conv if computed else torch.zeros_like(s.conv)
                             for s, (_, computed) in zip(states, seqs)])  # [B, C, kernel-1]
        rec0 = torch.stack([s.recurrent if computed else torch.zeros_like(s.recurrent)
                            for s, (_, computed) in zip(states, seqs)])  # [B, Hv, Dk, Dv]
        window = torch.cat([conv0.to(mixed.dtype), mixed.view(B, Ts, -1).transpose(1, 2)], dim=-1)  # [B, C, k-1+Ts]
        conv = F.silu(F.conv1d(window, self.conv1d.weight, groups=self.conv_dim)).transpose(1, 2)  # [B, Ts, C]
        q, k, v = torch.split(conv, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(B, Ts, self.num_k_heads, self.head_k_dim).repeat_interleave(r, dim=2)  # [B, Ts, Hv, Dk]
        k = k.reshape(B, Ts, self.num_k_heads, self.head_k_dim).repeat_interleave(r, dim=2)
        v = v.reshape(B, Ts, self.num_v_heads, self.head_v_dim)
        out, rec = gated_delta_rule(q, k, v, g.view(B, Ts, -1), beta.view(B, Ts, -1), rec0)
        for state, conv_tail, rec_state in zip(states, window[..., -(self.kernel - 1):], rec):
            state.conv.copy_(conv_tail)
            state.recurrent.copy_(rec_state)
        return out.reshape(B * Ts, self.num_v_heads, self.head_v_dim)


# ---- the model ---------------------------------------------------------------------------------------------


class Qwen3NextForCausalLM(MoECausalLM):
    config_class = Qwen3NextEngineConfig
    zero_centered_norm = True
    ignored_checkpoint_prefixes = ("mtp.",)
    tiny_num_layers = 4  # its default layer types put full attention on every 4th layer

    @staticmethod
    def tiny_hf_config(args, common):
        from transformers import Qwen3NextConfig

        return Qwen3NextConfig(**common, **tiny_qwen_fields(args),
                               shared_expert_intermediate_size=args.moe_intermediate_size,
                               linear_num_key_heads=args.linear_num_key_heads,
                               linear_num_value_heads=args.linear_num_value_heads,
                               linear_key_head_dim=args.linear_head_dim, linear_value_head_dim=args.linear_head_dim)

    def __init__(self, config: Qwen3NextEngineConfig) -> None:
        super().__init__(config, [self._layer(config, i) for i in range(config.num_layers)])

    @staticmethod
    def _layer(config: Qwen3NextEngineConfig, layer_id: int) -> DecoderLayer:
        if config.layer_types[layer_id] == LINEAR_ATTENTION:
            name, mixer = "linear_attn", GatedDeltaNet(config, layer_id)
        else:
            name, mixer = "self_attn", Attention(config, layer_id, qk_norm=True, output_gate=True,
                                                 zero_centered_norm=True)
        if layer_id in config.dense_mlp_layer_ids:
            mlp: nn.Module = MLP(config.hidden_size, config.intermediate_size)
        else:
            mlp = SparseMoE(config, layer_id, norm_topk_prob=config.norm_topk_prob, cast_weights=True,
                            shared_intermediate_size=config.shared_expert_intermediate_size)
        return DecoderLayer(name, mixer, mlp, config.hidden_size, config.rms_norm_eps, zero_centered_norm=True)

    def linear_state_shapes(self) -> dict[int, LinearStateShape]:
        return {i: layer.mixer.state_shape() for i, layer in enumerate(self.layers)
                if isinstance(layer.mixer, GatedDeltaNet)}
