"""Building blocks shared by the engine's MoE models, in gpt-fast style: small modules, shape comments, no cache.

Each block reproduces the arithmetic of its transformers 5.19 counterpart (same op order, same fp32 upcasts), so
an engine model and ``AutoModelForCausalLM`` on one checkpoint agree to fp32 round-off. What differs is the data
flow: the tokens of several sequences are packed into one [T, H] tensor (no batch axis, no padding), attention
goes through ``StepContext.attention``, and the MoE block (``moe``) runs only the experts its router selected,
with explicit expert ids, reaching their weights through ``StepContext.experts`` (see ``hooks``). Per step, the
work that does not depend on the layer (positions, RoPE tables) is done once, in ``MoECausalLM.forward``.

Parameter names follow transformers' in-memory (v5) names without the ``model.`` prefix: ``layers.3.mlp.experts.
gate_up_proj`` [E, 2I, H] — except attention's q/k/v, fused into ``layers.3.self_attn.qkv_proj.weight``.
``MoECausalLM.checkpoint_targets`` maps them to the names on disk, which for transformers 5.19 checkpoints are
the older per-expert ones and the three attention projections (see ``loader``).
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import Tensor, nn

from moetide.engine import native
from moetide.engine.models.hooks import (
    ContiguousKVCache,
    DecodeRows,
    DictLinearStateStore,
    ExpertProvider,
    LinearStateShape,
    ModuleExpertProvider,
    StepBatch,
    StepContext,
)
from moetide.engine.models.ops import linear, native_linear_takes
from moetide.engine.models.moe import MLP, SparseMoE  # MLP re-exported: the model files import it from here
from moetide.engine.models.norm_rope import Rope, RMSNorm, RopeCache, apply_rope, rms_normalize
from moetide.specs.hf_config import ConfigReader

# ---- config helpers ----------------------------------------------------------------------------------------


def read_rope_params(r: ConfigReader) -> tuple[dict[str, Any], str, float]:
    """(the RoPE parameters, v5's ``rope_parameters`` over the older ``rope_scaling``; the rope type; a validated
    ``rope_theta``, from ``rope_parameters`` or the top level)."""
    params = r.data.get("rope_parameters") or {}
    scaling = r.data.get("rope_scaling") or {}
    rope_type = params.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
    theta = params.get("rope_theta", r.data.get("rope_theta"))
    if not isinstance(theta, (int, float)) or isinstance(theta, bool) or theta <= 0:
        raise r.fail("rope_theta", f"expected a positive number (in rope_parameters or top level), got {theta!r}")
    return {**scaling, **params}, rope_type, float(theta)


def read_rope(r: ConfigReader, head_dim: int, default_partial_factor: float = 1.0) -> tuple[float, int]:
    """(rope_theta, rotary_dim) from v5's ``rope_parameters`` or the older top-level keys; only plain RoPE."""
    params, rope_type, theta = read_rope_params(r)
    if rope_type != "default":
        raise r.fail("rope_parameters", f"rope_type {rope_type!r} is not supported (only 'default')")
    factor = params.get("partial_rotary_factor", r.data.get("partial_rotary_factor", default_partial_factor))
    rotary_dim = int(head_dim * factor)
    if not 0 < rotary_dim <= head_dim or rotary_dim % 2:
        raise r.fail("partial_rotary_factor", f"{factor!r} x head_dim {head_dim} must give an even rotary width")
    return theta, rotary_dim


def read_float(r: ConfigReader, key: str) -> float:
    value = r.data.get(key)
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise r.fail(key, f"expected a number, got {value!r}")
    return float(value)


def require_silu(r: ConfigReader) -> None:
    if r.data.get("hidden_act", "silu") != "silu":
        raise r.fail("hidden_act", f"only 'silu' is supported, got {r.data['hidden_act']!r}")


# ---- layers ------------------------------------------------------------------------------------------------


class Attention(nn.Module):
    """GQA attention over the step's packed tokens. Options: per-head q/k RMSNorm (Qwen3), and Qwen3-Next's output
    gate: q_proj emits [q | gate] per head and the attention output is multiplied by sigmoid(gate).

    q, k and v come from one fused projection, ``qkv_proj`` (rows: q_proj's, then k_proj's, then v_proj's; the
    checkpoint's three tensors load into its row slices, ``checkpoint_slices``). Without the output gate, the q
    and k heads are adjacent in its output, so their RMSNorm and RoPE run once over [T, Hq + Hkv, D]."""

    def __init__(self, config: Any, layer_id: int, *, qk_norm: bool, output_gate: bool = False,
                 zero_centered_norm: bool = False) -> None:
        super().__init__()
        self.layer_id, self.output_gate, self.qk_norm = layer_id, output_gate, qk_norm
        self.num_heads, self.num_kv_heads, self.head_dim = (config.num_attention_heads, config.num_kv_heads,
                                                            config.head_dim)
        hidden, q_width = config.hidden_size, self.num_heads * self.head_dim
        kv_width = self.num_kv_heads * self.head_dim
        self.widths = (q_width * (2 if output_gate else 1), kv_width, kv_width)  # q (| gate), k, v rows
        self.qkv_proj = nn.Linear(hidden, sum(self.widths), bias=False)
        self.o_proj = nn.Linear(q_width, hidden, bias=False)
        if qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, zero_centered_norm)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, zero_centered_norm)
        self.joint_qk = not output_gate and not zero_centered_norm

    def checkpoint_slices(self) -> dict[str, slice]:
        """Checkpoint projection name -> its rows of ``qkv_proj.weight``."""
        q, kv, _ = self.widths
        return {"q_proj": slice(0, q), "k_proj": slice(q, q + kv), "v_proj": slice(q + kv, q + 2 * kv)}

    def forward(self, x: Tensor, ctx: StepContext, rope: Rope) -> Tensor:
        T, Hq, Hkv, D = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = linear(x, self.qkv_proj.weight)  # [T, (Hq (·2) + 2·Hkv) · D]
        gate = None
        if self.joint_qk:
            heads = qkv.view(T, Hq + 2 * Hkv, D)
            qk, v = heads[:, : Hq + Hkv], heads[:, Hq + Hkv :]  # [T, Hq + Hkv, D], [T, Hkv, D]
            if (native.worth_it(x, qk.numel(), native.EXPERT_DTYPES) and rope[0].dtype == x.dtype
                    and (not self.qk_norm or self.q_norm.weight.dtype == self.k_norm.weight.dtype == x.dtype)):
                # q/k norms and RoPE in one call (same to fp32 round-off before each bf16 rounding)
                if self.qk_norm:
                    qk = native.rms_norm_rope(qk, self.q_norm.eps, (self.q_norm.weight, self.k_norm.weight), Hq, rope)
                else:
                    qk = native.rms_norm_rope(qk, None, rope=rope)
            else:
                qk = apply_rope(self._norm_qk(qk) if self.qk_norm else qk, rope)
            q, k = qk[:, :Hq], qk[:, Hq:]
        else:
            q, k, v = qkv.split(self.widths, dim=-1)
            if self.output_gate:
                q, gate = q.view(T, Hq, 2 * D).chunk(2, dim=-1)
                gate = gate.reshape(T, -1)  # [T, Hq * D]
            q, k, v = q.reshape(T, Hq, D), k.view(T, Hkv, D), v.view(T, Hkv, D)
            if self.qk_norm:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = apply_rope(q, rope), apply_rope(k, rope)
        out = ctx.attention.attend(self.layer_id, q, k, v, ctx.batch, D**-0.5).reshape(T, -1)  # [T, Hq * D]
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return linear(out, self.o_proj.weight)

    def _norm_qk(self, qk: Tensor) -> Tensor:
        """q_norm on the q heads and k_norm on the k heads of [T, Hq + Hkv, D], in one pass (plain RMSNorm)."""
        normed = rms_normalize(qk, self.q_norm.eps)  # a new tensor: scaled in place, weight * x as RMSNorm does
        normed[:, : self.num_heads] *= self.q_norm.weight
        normed[:, self.num_heads :] *= self.k_norm.weight
        return normed


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
        self.native_weights: native.KeptArgs | None = None  # native_attention_args' own

    @property
    def mixer(self) -> nn.Module:
        """The token mixer, under its checkpoint name (``mixer_name``), so its weights load as transformers
        names them."""
        return getattr(self, self.mixer_name)

    @property
    def is_full_attention(self) -> bool:
        """Whether the mixer is softmax attention over the paged KV cache (``self_attn``); else it keeps a
        per-sequence state (``linear_attn``)."""
        return self.mixer_name == "self_attn"

    def forward(self, x: Tensor, residual: Tensor | None, ctx: StepContext, rope: Rope,
                experts: ExpertProvider) -> tuple[Tensor, Tensor]:
        """(the MLP's output, the running sum before it) for the layer's input x + residual (x alone in the first
        layer: residual None), so the next layer's add and norm run together (``RMSNorm.add_forward``)."""
        block = self.attention_block(x, residual, ctx, rope)
        if block is not None:
            h, residual = block
        else:
            if residual is None:
                h, residual = self.input_layernorm(x), x
            else:
                h, residual = self.input_layernorm.add_forward(x, residual)
            mixed = self.mixer(h, ctx, rope)
            h, residual = self.post_attention_layernorm.add_forward(mixed, residual)
        return self.mlp(h, experts), residual

    def native_attention_args(self, x: Tensor, ctx: StepContext, rope: Rope) -> native.AttentionArgs | None:
        """The layer's attention half as ``native.attention_step`` arguments for inputs like x, where every op of it
        would take its native kernel op by op (a decode step whose attention backend hands out its key rows,
        ``decode_rows``), so that one call gives the same bits; else None. What holds for every step like this one
        is checked once and kept (``native_attention_weights``)."""
        if (not self.is_full_attention or not self.self_attn.joint_qk or x.dim() != 2 or not x.is_contiguous()
                or rope[0].dtype != x.dtype):
            return None
        attn = self.self_attn
        rows = ctx.attention.decode_rows(attn.layer_id, attn.num_heads, x)
        if rows is None:
            return None
        weights = native.keep_checked(self, (x.device, x.dtype, *x.shape), (rows.k_rows, rows.v_rows),
                                      lambda: self.native_attention_weights(x, rows))
        return None if weights is None else native.attention_step(weights, rope, rows)

    def native_attention_weights(self, x: Tensor, rows: DecodeRows) -> native.AttentionArgs | None:
        """``native.attention_weights`` for the layer and inputs like x where its attention half takes the native
        kernels (fused q/k projection, one dtype throughout, projections the native linear takes); else None."""
        attn, norms = self.self_attn, (self.input_layernorm, self.post_attention_layernorm)
        T = x.shape[0]
        if (not attn.joint_qk or not native.worth_it(x, x.numel(), native.EXPERT_DTYPES)
                or any(n.weight.dtype != x.dtype or n.zero_centered for n in norms)
                or (attn.qk_norm and not attn.q_norm.weight.dtype == attn.k_norm.weight.dtype == x.dtype)
                or not native_linear_takes(x, T, attn.qkv_proj.weight)
                or not native_linear_takes(x, T, attn.o_proj.weight)):
            return None
        qk = (attn.q_norm.weight, attn.k_norm.weight, attn.q_norm.eps) if attn.qk_norm else None
        return native.attention_weights(x.shape[1], x.dtype, (norms[0].weight, norms[0].eps), attn.qkv_proj.weight,
                                        attn.num_heads, qk, attn.head_dim**-0.5, attn.o_proj.weight,
                                        (norms[1].weight, norms[1].eps), rows.k_rows, rows.v_rows)

    def attention_block(self, x: Tensor, residual: Tensor | None, ctx: StepContext,
                        rope: Rope) -> tuple[Tensor, Tensor] | None:
        """(the MLP's input, the running sum) from one ``native.run_attention`` call for the layer's norms,
        projections and attention (``native_attention_args``); else None."""
        if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype
                                     or not residual.is_contiguous()):
            return None
        args = self.native_attention_args(x, ctx, rope)
        if args is None:
            return None
        if residual is None:  # the first layer: the input is the running sum
            x, residual = None, x
        return native.run_attention(args, x, residual), residual


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
    # make-test-model (engine.testmodel): layers of a tiny checkpoint by default, and whether it may hold dense
    # MLP layers between the MoE ones
    tiny_num_layers = 2
    tiny_dense_layers = True

    @staticmethod
    def tiny_hf_config(args: Any, common: dict[str, Any]) -> Any:
        """The transformers config of a tiny random checkpoint of this architecture (``engine.testmodel``):
        ``common`` holds the fields every architecture shares, ``args`` the ``TinyModelArgs``."""
        raise NotImplementedError

    def __init__(self, config: Any, layers: list[DecoderLayer]) -> None:
        super().__init__()
        self.config = config
        # ``_weight`` skips the random init (every weight is loaded next); on the meta device torch 2.13's
        # ``normal_`` would import torch._dynamo: ~70 MiB of RSS and a second of start-up, measured
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.empty(config.vocab_size, config.hidden_size))
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, self.zero_centered_norm)
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size,
                                                                         bias=False)
        self.rope = RopeCache(config.rotary_dim, config.rope_theta)
        self.rope_dtype: torch.dtype | None = None  # the tables' dtype; None: the activations'
        self.own_experts = ModuleExpertProvider({i: layer.mlp.experts for i, layer in enumerate(layers)
                                                 if isinstance(layer.mlp, SparseMoE)})

    def forward(self, token_ids: Tensor, ctx: StepContext, *, all_logits: bool = False) -> Tensor:
        """token_ids LongTensor[T] (the step's tokens, packed in ``ctx.batch`` order) -> logits [B, V] for each
        sequence's last new token, or [T, V] for every token with ``all_logits``."""
        if token_ids.shape != (ctx.batch.num_tokens,):
            raise ValueError(f"token_ids has shape {tuple(token_ids.shape)}, the step has {ctx.batch.num_tokens}")
        x = self.embed_tokens(token_ids)  # [T, H]
        batch = ctx.batch
        max_position = max(c + n for c, n in zip(batch.num_computed_tokens, batch.num_new_tokens)) - 1
        rope = self.rope.lookup(batch.positions(x.device), max_position,  # once per step, for all layers
                                self.rope_dtype or x.dtype)
        experts = ctx.experts if ctx.experts is not None else self.own_experts
        stacked = self.decode_layers(x, ctx, rope, experts)
        if stacked is not None:
            x, residual = stacked
        else:
            residual = None
            for layer in self.layers:
                x, residual = layer(x, residual, ctx, rope, experts)
        if not all_logits and ctx.batch.num_tokens != len(ctx.batch.seq_ids):  # else each token is a last one
            last = ctx.batch.last_token_indices(x.device)
            x, residual = x[last], residual[last]  # [B, H]
        x = self.norm(x) if residual is None else self.norm.add_forward(x, residual)[0]
        return linear(x, self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight)

    def decode_layers(self, x: Tensor, ctx: StepContext, rope: Rope,
                      experts: ExpertProvider) -> tuple[Tensor, Tensor] | None:
        """(the last layer's output, the running sum) from one ``native.run_layers`` call, where every layer would
        run both of its halves as one native call each (``DecoderLayer.native_attention_args``,
        ``SparseMoE.native_args``: a pure decode step in fp32, every expert resident, no shared expert): the same
        kernels in the same order, so the same bits, without a layer's Python between them. Each layer's routing
        is announced after the call; else None."""
        attention, moe = [], []
        for layer in self.layers:
            mlp = layer.mlp
            if not isinstance(mlp, SparseMoE) or mlp.has_shared_expert:
                return None
            moe_half = mlp.native_args(x, experts)  # first: None at once in bf16, before the attention's work
            attention_half = None if moe_half is None else layer.native_attention_args(x, ctx, rope)
            if attention_half is None:
                return None
            attention.append(attention_half)
            moe.append(moe_half)
        out, residual, ids = native.run_layers(attention, moe, None, x)
        for layer, layer_ids in zip(self.layers, ids):
            experts.route(layer.mlp.layer_id, layer_ids)
        return out, residual

    def kv_cache_shape(self) -> tuple[int, int, bool]:
        """(KV heads, head dim, values_in_keys) of what one token stores per full-attention layer
        (``engine.storage.KVLayout``): K and V of ``num_kv_heads`` heads here; MLA stores one latent instead."""
        return self.config.num_kv_heads, self.config.head_dim, False

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
            if name.endswith(".qkv_proj.weight"):  # one fused parameter, three checkpoint tensors
                attention = self.get_submodule(name.removesuffix(".qkv_proj.weight"))
                for proj, rows in attention.checkpoint_slices().items():
                    targets[self.hf_name(name.replace(".qkv_proj.", f".{proj}."))] = param.detach()[rows]
                continue
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
