"""A decoder layer's halves for a pure decode step, one native call each (``layer.c``): the attention half
(norms, projections, RoPE, paged attention, residual adds) and, in fp32, the MoE half (gate, top-k, grouped
experts). They run the same kernels in the same order as the op-by-op path, so the same bits, and pay the per-call
cost once per half instead of once per op."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from moetide.engine.native.library import EXPERT_DTYPES, experts_readable, load, ptr, require_f32

if TYPE_CHECKING:
    from moetide.engine.models.hooks import DecodeRows


def attention_block(x: Tensor | None, residual: Tensor, input_norm: tuple[Tensor, float], qkv_weight: Tensor,
                    num_heads: int, qk_norm: tuple[Tensor, Tensor, float] | None, rope: tuple[Tensor, Tensor],
                    rows: DecodeRows, scale: float, o_weight: Tensor, post_norm: tuple[Tensor, float]) -> Tensor:
    """A decoder layer's attention half for a pure decode step in one call (``layer.c``): ``residual`` += x (x
    None in the first layer, where the residual is the input), then the input RMSNorm (``input_norm``: weight [H],
    eps), the fused q/k/v projection ``qkv_weight`` [(Hq + 2 Hkv) D, H], the q/k RMSNorms (``qk_norm``: q and k
    weights [D], eps; None for none) with RoPE (``rope``: cos, signed sin [T, rotary]), attention over ``rows``
    (``models.DecodeRows``) after each sequence's new K/V is written into its last row, ``o_weight`` [H, Hq D],
    and the post-attention add into ``residual`` and RMSNorm (``post_norm``) -> the MLP's input [T, H]. x,
    residual [T, H] contiguous; everything in one dtype, fp32 or bf16. The same kernels in the same order as
    ``models.common``'s op-by-op native path, so the same bits."""
    lib = load()
    T, H = residual.shape
    k_rows, v_rows, key_rows, lengths = rows.k_rows, rows.v_rows, rows.key_rows, rows.lengths
    Hkv, D = k_rows.shape[1:]
    W, L = (num_heads + 2 * Hkv) * D, key_rows.shape[1]
    if lib is None or residual.dtype not in EXPERT_DTYPES or residual.device.type != "cpu":
        raise ValueError("attention_block needs the native library and fp32 or bf16 CPU tensors")
    weights = [input_norm[0], qkv_weight, o_weight, post_norm[0], *(qk_norm[:2] if qk_norm else ()), *rope]
    tensors = [t for t in (x, residual, *weights, k_rows, v_rows) if t is not None]
    if any(t.dtype != residual.dtype or t.device.type != "cpu" for t in tensors):
        dtypes = sorted({str(t.dtype) for t in tensors})
        raise ValueError(f"attention_block takes CPU tensors of one dtype, got {dtypes}")
    if any(not t.is_contiguous() for t in (residual, *weights)) or (x is not None and not x.is_contiguous()):
        raise ValueError("attention_block: the input, the residual, the weights and the RoPE tables must be contiguous")
    shapes = [(x, (T, H)), (input_norm[0], (H,)), (post_norm[0], (H,)), (qkv_weight, (W, H)),
              (o_weight, (H, num_heads * D)), *((w, (D,)) for w in (qk_norm[:2] if qk_norm else ())),
              (rope[1], tuple(rope[0].shape)), (key_rows, (T, L)), (lengths, (T,))]
    bad = [(list(t.shape), list(shape)) for t, shape in shapes if t is not None and tuple(t.shape) != shape]
    rotary = rope[0].shape[1]
    if bad or rope[0].shape[0] != T or rotary > D or rotary % 2 or num_heads % Hkv:
        raise ValueError(f"attention_block: shapes disagree with T {T}, H {H}, {num_heads} heads over {Hkv} KV "
                         f"heads of {D} (got, expected): {bad}; rope tables {list(rope[0].shape)}")
    if (k_rows.stride() != v_rows.stride() or k_rows.stride(2) != 1 or v_rows.shape[1:] != (Hkv, D)
            or key_rows.dtype != torch.int64
            or lengths.dtype != torch.int64 or not key_rows.is_contiguous() or not lengths.is_contiguous()):
        raise ValueError("attention_block: K/V rows need equal strides and unit head-dim stride; key_rows and "
                         "lengths contiguous int64")
    h = torch.empty(T, H, dtype=residual.dtype)
    scratch = torch.empty(lib.moetide_attention_block_scratch(T, H, num_heads, Hkv, D, L), dtype=torch.float32)
    pointers = torch.empty(T, dtype=torch.int64)
    q_w, k_w, qk_eps = qk_norm if qk_norm else (None, None, 0.0)
    status = lib.moetide_attention_block(
        ptr(x), residual.data_ptr(), T, H, residual.dtype == torch.bfloat16, input_norm[0].data_ptr(),
        input_norm[1], qkv_weight.data_ptr(), num_heads, Hkv, D, qk_norm is not None, qk_eps, ptr(q_w), ptr(k_w),
        rope[0].data_ptr(), rope[1].data_ptr(), rotary, k_rows.data_ptr(), v_rows.data_ptr(),
        min(k_rows.shape[0], v_rows.shape[0]), k_rows.stride(0), k_rows.stride(1), key_rows.data_ptr(),
        lengths.data_ptr(), L, scale, o_weight.data_ptr(), post_norm[0].data_ptr(), post_norm[1], h.data_ptr(),
        scratch.data_ptr(), pointers.data_ptr())
    if status:  # checked before anything is written
        raise ValueError(f"key_rows must lie in [0, {min(k_rows.shape[0], v_rows.shape[0])})" if status == 1
                         else f"lengths must lie in [0, {L}]")
    return h


def moe_block(x: Tensor, gate_weight: Tensor, top_k: int, renormalize: bool, gate_up: Tensor,
              down: Tensor) -> tuple[Tensor, Tensor]:
    """A MoE block's router and routed experts in one fp32 call (``layer.c``): logits x gate_weight^T (gate_weight
    [E, H]), ``moe_route``'s top-k, then ``moe_experts`` over the stacked views -> (out [T, H], expert ids [T, K]
    int64). x [T, H] contiguous. The gate's sums are the native kernel's (fp32 round-off from torch's)."""
    lib = load()
    T, H = x.shape
    E, two_i, _ = gate_up.shape
    I = two_i // 2  # noqa: E741 (the expert width, as everywhere in the engine)
    if lib is None or not experts_readable(gate_up, down) or gate_up.shape[2] != H:
        raise ValueError(f"moe_block needs the native library and [E, 2I, {H}] / [E, {H}, I] expert views with "
                         f"packed rows")
    require_f32("moe_block", x, gate_weight, gate_up, down)
    if not x.is_contiguous() or gate_weight.shape != (E, H) or not gate_weight.is_contiguous():
        raise ValueError(f"moe_block: x must be contiguous and the gate a contiguous [{E}, {H}], got "
                         f"{list(gate_weight.shape)}")
    if not 0 < top_k <= E:
        raise ValueError(f"moe_block: top_k {top_k} must lie in [1, {E}]")
    out, weights = torch.empty_like(x), torch.empty(T, top_k, dtype=torch.float32)
    ids = torch.empty(T, top_k, dtype=torch.int64)
    scratch = torch.empty(lib.moetide_moe_block_scratch(T, H, E, top_k, I), dtype=torch.float32)
    iscratch = torch.empty(E + 1 + 2 * T * top_k, dtype=torch.int64)
    lib.moetide_moe_block(x.data_ptr(), T, H, gate_weight.data_ptr(), E, top_k, int(renormalize),
                          gate_up.data_ptr(), gate_up.stride(0), down.data_ptr(), down.stride(0), I, out.data_ptr(),
                          weights.data_ptr(), ids.data_ptr(), scratch.data_ptr(), iscratch.data_ptr())
    return out, ids
