"""Native CPU kernels for decode-sized steps: the router's top-k and the routed experts of a few tokens, decode
attention read in place from the paged arena, and RMSNorm with RoPE (``kernels.c``). On the CPU, at decode sizes,
torch's per-op dispatch costs more than the arithmetic: a MoE layer is ~20 ops, a paged attention ~10 (write,
gather, mask, SDPA), q/k norms with RoPE ~10; each kernel here is one call. vLLM's CPU build does the same with
its C++ kernels. At decode sizes a decoder layer's attention half, and in fp32 its MoE half, are one call each
(``native.layer``), as those kernels in the same order, so that the per-call cost is paid once per half,
and where every layer takes both, all of a step's layers are one call.

Built on first use with the system C compiler (``native.library``; no torch headers, so the build takes about a
second). Where no compiler works, or with ``MOETIDE_NATIVE=0``, ``available()`` is False and the engine keeps its
torch paths — the same results to fp32 round-off (tested), only slower; the reason is in ``unavailable_reason()``.

CPU tensors in fp32 (most kernels also bf16), without autograd; the kernels are single-threaded, so
``worth_it`` keeps torch (which may use several threads) for work large enough to gain from them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from moetide.engine.native.layer import (AttentionArgs, KeptArgs, MoEArgs, attention_step, attention_weights,
                                         keep_checked, moe_args, run_attention, run_layers, run_moe)
from moetide.engine.native.library import (EXPERT_DTYPES, available, experts_readable, load, ptr, require_f32,
                                           unavailable_reason)

if TYPE_CHECKING:
    from moetide.engine.models.hooks import StateBlocks

__all__ = ["EXPERT_DTYPES", "AttentionArgs", "KeptArgs", "MoEArgs", "attention_step", "attention_weights",
           "available", "copy_blocks", "decode_macs", "decode_worth_it", "experts_readable", "gdn_forward",
           "keep_checked", "linear", "linear_isa", "load", "moe_args", "moe_experts", "moe_route",
           "paged_decode_attention", "rms_norm", "rms_norm_rope", "run_attention", "run_layers", "run_moe",
           "unavailable_reason", "worth_it"]
_SINGLE_THREAD_MACS = 4_000_000  # with several torch threads, work above this (≈0.3 ms on one core) goes to torch


def worth_it(x: Tensor, macs: int, dtypes: tuple[torch.dtype, ...] = (torch.float32,)) -> bool:
    """Whether a native kernel should take work of ``macs`` multiply-adds on tensors like ``x``: CPU tensors of
    one of the kernel's ``dtypes``, with autograd off (the kernels have no backward; the engine runs under
    ``torch.inference_mode``)."""
    if not x.is_cpu or x.dtype not in dtypes or torch.is_grad_enabled() or load() is None:
        return False
    return macs <= _SINGLE_THREAD_MACS or torch.get_num_threads() == 1


def decode_macs(num_query_values: int, num_keys: int) -> int:
    """The multiply-adds of decode attention: each of a step's query values (b · Hq · D) against ``num_keys`` keys,
    once for the scores and once for the values."""
    return 2 * num_query_values * num_keys


def decode_worth_it(q: Tensor, num_keys: int, dtypes: tuple[torch.dtype, ...] = (torch.float32,)) -> bool:
    """``worth_it`` for decode attention of one query per sequence (q [b, (1,) Hq, D]) over ``num_keys`` keys each
    (``dtypes``: also ``EXPERT_DTYPES`` where a bf16 KV cache is read the same way)."""
    return worth_it(q, decode_macs(q.numel(), num_keys), dtypes)


def moe_experts(x: Tensor, weights: Tensor, expert_ids: Tensor, gate_up: Tensor, down: Tensor) -> Tensor:
    """Like ``moe.grouped_experts``: x [T, H] fp32 or bf16 (the experts' dtype); weights, expert_ids [T, K];
    gate_up [E, 2I, H] and down [E, H, I] with unit column stride and packed rows (the arena's or a module's
    stacked experts) -> [T, H]. Each expert's weights are read once for all the tokens routed to it (``moe.c``)."""
    lib = load()
    E, two_i, H = gate_up.shape
    I = two_i // 2  # noqa: E741 (the expert width, as everywhere in the engine)
    if lib is None or not experts_readable(gate_up, down):
        raise ValueError("moe_experts needs the native library and [E, 2I, H] / [E, H, I] expert views with "
                         "packed rows")
    for t in (x, gate_up, down):
        if t.dtype not in EXPERT_DTYPES or t.dtype != gate_up.dtype or t.device.type != "cpu":
            raise ValueError(f"moe_experts takes fp32 or bf16 CPU tensors of one dtype, got {t.dtype} on {t.device}")
    x = x.contiguous()
    ids, w = expert_ids.to(torch.int64).contiguous(), weights.to(torch.float32).contiguous()
    T, K = ids.shape
    if ids.shape[0] != x.shape[0] or w.shape != ids.shape or x.shape[1] != H:
        raise ValueError(f"moe_experts: x {list(x.shape)}, weights {list(w.shape)} and expert_ids "
                         f"{list(ids.shape)} disagree with [T, {H}] and [T, K]")
    out = torch.empty_like(x)
    iscratch = torch.empty(E + 1 + 2 * T * K, dtype=torch.int64)
    fscratch = torch.empty(T * K * (2 * I + H) + T * H, dtype=torch.float32)
    kernel = lib.moetide_moe_grouped_f32 if x.dtype == torch.float32 else lib.moetide_moe_grouped_bf16
    status = kernel(x.data_ptr(), T, K, ids.data_ptr(), w.data_ptr(), gate_up.data_ptr(), gate_up.stride(0),
                    down.data_ptr(), down.stride(0), E, H, I, out.data_ptr(), iscratch.data_ptr(),
                    fscratch.data_ptr())
    if status:  # the kernel checks the indices before it touches memory
        raise ValueError(f"expert_ids must lie in [0, {E})")
    return out


def moe_route(logits: Tensor, top_k: int, renormalize: bool) -> tuple[Tensor, Tensor]:
    """``models.moe.SparseMoE.route`` after the gate, in one call: logits [T, E] fp32 or bf16 (rows of E
    contiguous) -> (weights [T, K] fp32, expert ids [T, K] int64): softmax in fp32, the top ``top_k`` in
    descending order, renormalized to sum 1 if asked. Equal to torch's softmax and topk to fp32 round-off (expf
    and the sum's order are the kernel's); of equal probabilities the lower expert id comes first, where torch's
    order is its own (the engine routes bf16 logits, which tie, through torch)."""
    lib = load()
    T, E = logits.shape
    if lib is None or logits.dtype not in EXPERT_DTYPES or logits.device.type != "cpu" or logits.stride(1) != 1:
        raise ValueError("moe_route needs the native library and CPU fp32 or bf16 logits with contiguous rows")
    if not 0 < top_k <= E:
        raise ValueError(f"moe_route: top_k {top_k} must lie in [1, {E}]")
    weights = torch.empty(T, top_k, dtype=torch.float32)
    ids = torch.empty(T, top_k, dtype=torch.int64)
    lib.moetide_moe_route(logits.data_ptr(), T, E, logits.stride(0), logits.dtype == torch.bfloat16, top_k,
                          int(renormalize), weights.data_ptr(), ids.data_ptr())
    return weights, ids


def linear_isa() -> str:
    """The vector path the native linear and experts run: ``amx`` (bf16 on AMX tiles, fp32 on AVX-512),
    ``avx512-bf16`` (AVX-512 with AVX512-BF16 dot products for bf16 weights), ``avx512``, ``avx2``, ``c`` (plain
    C), or "" without the library."""
    lib = load()
    return "" if lib is None else lib.linear_isa


def linear(x: Tensor, weight: Tensor) -> Tensor:
    """``F.linear(x, weight)`` without bias for x [T, K] and weight [N, K] (packed rows), both fp32 or both bf16
    (``moe.c``: fp32 sums, rounded once in bf16, as torch's): at decode sizes a weight-streaming GEMV that reads
    the weights near the core's memory bandwidth, where torch's one-thread GEMV reaches about half of it."""
    lib = load()
    T, K = x.shape
    N = weight.shape[0]
    if (lib is None or x.dtype not in EXPERT_DTYPES or weight.dtype != x.dtype or weight.shape != (N, K)
            or weight.stride() != (K, 1) or x.device.type != "cpu" or weight.device.type != "cpu"):
        raise ValueError("linear needs the native library and fp32 or bf16 CPU tensors of one dtype, packed rows")
    x = x.contiguous()
    y = torch.empty(T, N, dtype=x.dtype)
    bf16 = x.dtype == torch.bfloat16
    scratch = torch.empty(T * (K + N), dtype=torch.float32) if bf16 else None
    pointers = torch.empty(T, dtype=torch.int64)
    lib.moetide_linear(x.data_ptr(), T, K, bf16, weight.data_ptr(), N, y.data_ptr(), ptr(scratch),
                       pointers.data_ptr())
    return y


def copy_blocks(scratch: Tensor, blocks: Tensor, index: tuple[Tensor, Tensor], to_blocks: bool) -> None:
    """Gather ``blocks[index]`` (``blocks`` [G, S, nbytes] uint8, rows contiguous; ``index`` (groups, slots) int64 of
    one shape) into ``scratch`` (contiguous uint8, one row of nbytes per indexed block, in index order), or with
    ``to_blocks`` scatter it back: ``moetide_copy_blocks``, one memcpy per block."""
    lib = load()
    groups, slots = index
    G, S, nbytes = blocks.shape
    if (lib is None or blocks.dtype != torch.uint8 or scratch.dtype != torch.uint8 or blocks.stride(-1) != 1
            or not scratch.is_contiguous() or scratch.numel() != groups.numel() * nbytes
            or blocks.device.type != "cpu" or scratch.device.type != "cpu"):
        raise ValueError("copy_blocks needs the native library and uint8 CPU tensors: blocks [G, S, n] with "
                         "contiguous rows, a contiguous scratch of one row per indexed block")
    if groups.numel() and (int(groups.min()) < 0 or int(groups.max()) >= G or int(slots.min()) < 0
                           or int(slots.max()) >= S):
        raise ValueError(f"copy_blocks: a block index is outside the {G} x {S} blocks")
    addrs = (groups.reshape(-1) * blocks.stride(0) + slots.reshape(-1) * blocks.stride(1)) + blocks.data_ptr()
    lib.moetide_copy_blocks(scratch.data_ptr(), addrs.data_ptr(), groups.numel(), nbytes, int(to_blocks))


GDN_PIECE = 64  # tokens a sequence's prefill goes through at a time in ``gdn_forward`` (conv and norms, then each head)


def gdn_forward(mixed: Tensor, conv_weight: Tensor, blocks: StateBlocks, layer_id: int,
                fresh: Sequence[bool] | Tensor, g: Tensor, beta: Tensor, num_k_heads: int, head_k_dim: int,
                head_v_dim: int) -> Tensor:
    """Gated DeltaNet over B sequences with T new tokens each (``gdn.c``; T = 1 is a decode step): mixed [B T, C]
    (q | k | v before the conv, rows sequence-major) fp32 or bf16; conv_weight [C, kernel] (or [C, 1, kernel]) of
    that dtype; ``blocks`` (``models.StateBlocks``, B rows) where the sequences' states lie, layer ``layer_id``'s
    conv [C, kernel-1] of that dtype and recurrent [Hv, Dk, Dv] fp32 updated there in place, read as zeros where
    ``fresh`` (B flags, or a CPU tensor of B 0/1 flags, which a step's layers can share); g, beta [B T, Hv] -> the
    rule's output [B T, Hv, Dv] in mixed's dtype."""
    lib = load()
    rows_in, C = mixed.shape
    B = blocks.addresses.shape[0]
    w = conv_weight.reshape(C, -1).contiguous()
    g, beta = g.float().contiguous(), beta.float().contiguous()
    Hv = g.shape[1]
    if (lib is None or mixed.dtype not in EXPERT_DTYPES or w.dtype != mixed.dtype or len(fresh) != B or B == 0
            or rows_in % B or g.shape[0] != rows_in or beta.shape != g.shape):
        raise ValueError("gdn_forward needs the native library, fp32 or bf16 activations and conv weights of one "
                         "dtype, one fresh flag per sequence, and the same tokens for each (g, beta a row each)")
    T = rows_in // B
    conv, recurrent = blocks.layout.fields[layer_id]
    addresses = blocks.addresses
    if (conv.dtype != mixed.dtype or conv.shape != (C, w.shape[1] - 1) or recurrent.dtype != torch.float32
            or recurrent.shape != (Hv, head_k_dim, head_v_dim)):
        raise ValueError(f"gdn_forward: layer {layer_id}'s state must be conv [{C}, {w.shape[1] - 1}] in "
                         f"{mixed.dtype} and recurrent [{Hv}, {head_k_dim}, {head_v_dim}] fp32, the layout has "
                         f"{list(conv.shape)} {conv.dtype} and {list(recurrent.shape)} {recurrent.dtype}")
    if (addresses.dtype != torch.int64 or addresses.shape != (B, blocks.layout.num_blocks(blocks.block_bytes))
            or blocks.block_bytes % 4):
        raise ValueError(f"gdn_forward: StateBlocks.addresses must be int64 [{B}, blocks per state] and blocks a "
                         f"multiple of 4 bytes, got {addresses.dtype} {list(addresses.shape)}, {blocks.block_bytes}")
    mixed, addresses = mixed.contiguous(), addresses.contiguous()
    fresh_t = (fresh.to('cpu', torch.int64).contiguous() if isinstance(fresh, Tensor)
               else torch.tensor(fresh, dtype=torch.int64))
    out = torch.empty(rows_in, Hv, head_v_dim, dtype=mixed.dtype)
    piece = min(T, GDN_PIECE)
    scratch = torch.empty(piece * C + 3 * head_v_dim + head_k_dim * head_v_dim + C * (2 * w.shape[1] - 1)
                          + (w.shape[1] - 1 + piece) * C,
                          dtype=torch.float32)
    rows = torch.empty(head_k_dim, dtype=torch.int64)
    lib.moetide_gdn_forward(mixed.data_ptr(), B, T, piece, C, mixed.dtype == torch.bfloat16, w.data_ptr(),
                            w.shape[1], addresses.data_ptr(), addresses.shape[1], blocks.block_bytes, conv.offset,
                            recurrent.offset, fresh_t.data_ptr(), g.data_ptr(), beta.data_ptr(), num_k_heads, Hv,
                            head_k_dim, head_v_dim, out.data_ptr(), scratch.data_ptr(), rows.data_ptr())
    return out


def paged_decode_attention(q: Tensor, k_rows: Tensor, v_rows: Tensor, key_rows: Tensor, lengths: Tensor,
                           scale: float, new_kv: tuple[Tensor, Tensor] | None = None,
                           lse: Tensor | None = None, fp32_out: bool = False) -> Tensor:
    """q [b, Hq, D] fp32 or bf16, one query per sequence at the end of its context; k_rows, v_rows [rows, Hkv, D]
    views (same strides; unit stride along D; fp32, or bf16 with a bf16 q: rows widened to fp32 as they are read,
    the output rounded to bf16 once); key_rows [b, L] int64 rows of each sequence's keys, the first
    ``lengths[s]`` of them valid -> [b, Hq, D]. ``new_kv`` ([b, Hkv, D] each): written first into each
    sequence's last row (its decode token's slot), all of them before any sequence attends. ``lse`` ([b, Hq]
    fp32, contiguous): filled with each row's log-sum-exp (natural log, -inf for a sequence with no key; a split
    merge's input). ``fp32_out``: with a bf16 q, return the fp32 output unrounded (a split merge rounds once,
    after it)."""
    lib = load()
    b, Hq, D = q.shape
    Hkv = k_rows.shape[1]
    if lib is None or k_rows.stride() != v_rows.stride() or k_rows.stride(2) != 1 or Hq % Hkv:
        raise ValueError("paged_decode_attention needs the native library and K/V row views of equal strides")
    if k_rows.shape[1:] != (Hkv, D) or v_rows.shape[1:] != (Hkv, D):
        raise ValueError(f"K/V rows {list(k_rows.shape)} / {list(v_rows.shape)} do not match q's head dim {D}")
    num_rows = min(k_rows.shape[0], v_rows.shape[0])  # a row index must be valid in both views
    bf16 = k_rows.dtype == torch.bfloat16 and v_rows.dtype == torch.bfloat16 and q.dtype == torch.bfloat16
    dtype = q.dtype
    if bf16:
        q = q.float()
    require_f32("paged_decode_attention", q, *(() if bf16 else (k_rows, v_rows)))
    if k_rows.device.type != "cpu" or v_rows.device.type != "cpu":
        raise ValueError(f"paged_decode_attention takes CPU tensors, got K/V rows on {k_rows.device}")
    q, key_rows, lengths = q.contiguous(), key_rows.to(torch.int64).contiguous(), lengths.to(torch.int64).contiguous()
    L = key_rows.shape[1]
    if key_rows.shape[0] != b or lengths.shape != (b,):
        raise ValueError(f"key_rows {list(key_rows.shape)} and lengths {list(lengths.shape)} must be [b, L] and [b]")
    k_new = v_new = None
    if new_kv is not None:  # read in place where each token's heads are packed (views of the projection)
        k_new, v_new = (t if t.dtype == k_rows.dtype and t.stride()[1:] == (D, 1) else t.to(k_rows.dtype).contiguous()
                        for t in new_kv)
        if k_new.shape != (b, Hkv, D) or v_new.shape != (b, Hkv, D):
            raise ValueError(f"new_kv must be [b, Hkv, D] = {[b, Hkv, D]}, got {list(k_new.shape)}")
    if lse is not None and (lse.shape != (b, Hq) or not lse.is_contiguous()):
        raise ValueError(f"lse must be a contiguous [b, Hq] = {[b, Hq]} tensor, got {list(lse.shape)}")
    require_f32("paged_decode_attention", lse)
    out, scratch = torch.empty_like(q), q.new_empty(Hq * (L + D + 3) + 5 * Hkv * D)
    status = lib.moetide_paged_decode_attention(q.data_ptr(), b, Hq, Hkv, D, k_rows.data_ptr(), v_rows.data_ptr(),
                                                num_rows, k_rows.stride(0), k_rows.stride(1), key_rows.data_ptr(),
                                                lengths.data_ptr(), L, scale, ptr(k_new),
                                                0 if k_new is None else k_new.stride(0), ptr(v_new),
                                                0 if v_new is None else v_new.stride(0), out.data_ptr(), ptr(lse),
                                                bf16, scratch.data_ptr())
    if status:  # the kernel checks the indices before it touches memory
        raise ValueError(f"key_rows must lie in [0, {num_rows})" if status == 1
                         else f"lengths must lie in [0, {L}]")
    return out if out.dtype == dtype or fp32_out else out.to(dtype)


def rms_norm(x: Tensor, eps: float, weight: Tensor, zero_centered: bool, gate: Tensor | None = None,
             residual: Tensor | None = None) -> Tensor:
    """x [T, D] fp32 or bf16 (rows of D contiguous; any row stride) -> [T, D] in x's dtype: ``models.common``'s
    ``RMSNorm`` (``zero_centered``: scaled by 1 + weight) or, with ``gate`` [T, D], Qwen3-Next's gated norm, in one
    call (``gdn.c``; equal to the torch forms to fp32 round-off before their roundings to the model dtype). With
    ``residual`` ([T, D] contiguous, x's dtype), x is first added into it in place (the sum rounded as torch's add
    rounds) and the sum is normalized: vLLM's fused_add_rms_norm."""
    lib = load()
    T, D = x.shape
    x, w = (x if x.stride(1) == 1 else x.contiguous()), weight.contiguous()
    gate = gate if gate is None or gate.stride(-1) == 1 else gate.contiguous()
    if (lib is None or x.dtype not in EXPERT_DTYPES or w.dtype != x.dtype or w.shape != (D,)
            or x.device.type != "cpu"):
        raise ValueError(f"rms_norm needs the native library, CPU rows of {D} contiguous fp32 or bf16 values and "
                         f"a [{D}] weight of their dtype")
    if gate is not None and (gate.shape != (T, D) or gate.dtype != x.dtype):
        raise ValueError(f"rms_norm: the gate must be [{T}, {D}] rows of {x.dtype}")
    if residual is not None and (residual.shape != (T, D) or residual.dtype != x.dtype or not residual.is_contiguous()
                                 or residual.device.type != "cpu"):
        raise ValueError(f"rms_norm: the residual must be a contiguous CPU [{T}, {D}] tensor of {x.dtype}")
    out = torch.empty(T, D, dtype=x.dtype)
    lib.moetide_rms_norm(x.data_ptr(), T, x.stride(0), D, x.dtype == torch.bfloat16, eps, w.data_ptr(),
                         zero_centered, ptr(gate), 0 if gate is None else gate.stride(0), ptr(residual),
                         out.data_ptr())
    return out


def rms_norm_rope(x: Tensor, eps: float | None, weights: tuple[Tensor | None, Tensor | None] = (None, None),
                  split: int = 1, rope: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """x [T, heads, D] fp32 or bf16 (rows of D contiguous; any token stride) -> [T, heads, D]: RMSNorm over D
    unless ``eps`` is None, scaled by ``weights[0]`` for the first ``split`` heads and ``weights[1]`` for the
    others (either may be None), then RoPE with ``engine.models.common``'s (cos, signed sin) tables [T, rotary] if
    given; weights and tables in x's dtype. The same as ``RMSNorm``/``rms_normalize`` then ``apply_rope``, to fp32
    round-off before each of their roundings to bf16."""
    lib = load()
    T, heads, D = x.shape
    if lib is None or x.stride(2) != 1 or x.stride(1) != D:
        raise ValueError("rms_norm_rope needs the native library and rows of D contiguous floats")
    w1, w2 = (None if w is None else w.contiguous() for w in weights)
    tensors = [t for t in (x, w1, w2, *(rope or ())) if t is not None]
    if x.dtype not in EXPERT_DTYPES or any(t.dtype != x.dtype or t.device.type != "cpu" for t in tensors):
        raise ValueError(f"rms_norm_rope takes CPU tensors of one dtype, fp32 or bf16, got "
                         f"{sorted({str(t.dtype) for t in tensors})} on {sorted({str(t.device) for t in tensors})}")
    if any(w is not None and w.shape != (D,) for w in (w1, w2)) or not 0 <= split <= heads:
        raise ValueError(f"rms_norm_rope: weights must be [{D}] and split within [0, {heads}]")
    rotary = 0
    cos = sin = None
    if rope is not None:
        cos, sin = (t.contiguous() for t in rope)
        rotary = cos.shape[1]
        if cos.shape != (T, rotary) or sin.shape != (T, rotary) or rotary > D or rotary % 2:
            raise ValueError(f"rope tables must be [T, rotary] with an even rotary <= {D}")
    out = torch.empty(T, heads, D, dtype=x.dtype)
    scratch = torch.empty(2 * D, dtype=torch.float32)  # a row widened, and normed before it is rotated
    lib.moetide_rms_norm_rope(x.data_ptr(), T, x.stride(0), heads, D, eps is not None, eps or 0.0, ptr(w1), split,
                              ptr(w2), ptr(cos), ptr(sin), rotary, out.data_ptr(), scratch.data_ptr(),
                              x.dtype == torch.bfloat16)
    return out
