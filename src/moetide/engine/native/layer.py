"""A decoder layer's halves for a pure decode step, one native call each (``layer.c``): the attention half
(norms, projections, RoPE, paged attention, residual adds) and, in fp32, the MoE half (gate, top-k, grouped
experts); and, where every layer of a model takes both, all its layers in one call (``run_layers``). They run the
same kernels in the same order as the op-by-op path, so the same bits, and pay the per-call cost once instead of
once per op.

A half's arguments are checked once, where they are gathered (``attention_weights`` and ``attention_step``,
``moe_args``), into the ctypes mirror of its C struct, which keeps the tensors it points into alive;
``run_attention``, ``run_moe`` and ``run_layers`` then check only the activations they are handed.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

import torch
from torch import Tensor

from moetide.engine.native.library import EXPERT_DTYPES, experts_readable, load, ptr, require_f32

if TYPE_CHECKING:
    from moetide.engine.models.hooks import DecodeRows

_ATTENTION_POINTERS = ("in_w", "qkv_w", "q_w", "k_w", "o_w", "post_w", "cos_t", "sin_t", "k_base", "v_base",
                       "key_rows", "lengths")
_ATTENTION_INTS = ("Hq", "Hkv", "D", "qk_norm", "rotary", "num_rows", "row_stride", "head_stride", "L")


class AttentionArgs(ctypes.Structure):
    """``struct moetide_attention_args`` (``layer.c``), field for field, checked by ``attention_args``: a layer's
    attention half for one step of ``T`` tokens of width ``H`` in ``dtype``."""

    _fields_ = ([(name, ctypes.c_void_p) for name in _ATTENTION_POINTERS]
                + [(name, ctypes.c_int64) for name in _ATTENTION_INTS]
                + [(name, ctypes.c_float) for name in ("in_eps", "qk_eps", "scale", "post_eps")])
    T: int
    H: int
    dtype: torch.dtype
    scratch_floats: int
    tensors: tuple[Tensor, ...]  # what the pointers point into, kept alive


class MoEArgs(ctypes.Structure):
    """``struct moetide_moe_args`` (``layer.c``), field for field, checked by ``moe_args``: a layer's fp32 MoE half
    for tokens of width ``H``."""

    _fields_ = ([(name, ctypes.c_void_p) for name in ("gate_w", "gate_up", "down")]
                + [(name, ctypes.c_int64) for name in ("E", "K", "renorm", "gu_stride", "dn_stride", "I")])
    H: int
    tensors: tuple[Tensor, ...]


Args = TypeVar("Args", AttentionArgs, MoEArgs)

_registrations = 0  # parameters, buffers and submodules registered on any torch module since import


def _registered(module: torch.nn.Module, name: str, value: object) -> None:
    global _registrations
    _registrations += 1


# Assigning a parameter, buffer or submodule (``module.weight = nn.Parameter(...)``, ``load_state_dict(...,
# assign=True)``) runs these hooks, so a kept argument record can tell that a module it read may have changed
# without reading every module again.
torch.nn.modules.module.register_module_parameter_registration_hook(_registered)
torch.nn.modules.module.register_module_buffer_registration_hook(_registered)
torch.nn.modules.module.register_module_module_registration_hook(_registered)


@dataclass(frozen=True)
class KeptArgs(Generic[Args]):
    """A layer's checked arguments (None: the layer does not take the native half for such inputs) and what they
    were checked for (``keep_checked``)."""

    key: tuple
    live: tuple[Tensor, ...]
    registrations: int
    pointers: tuple
    args: Args | None


class KeepsNativeArgs(Protocol):
    """What ``keep_checked`` keeps a layer's checked arguments in; None before the first check."""

    native_weights: KeptArgs | None


def _pointers(args: AttentionArgs | MoEArgs | None) -> tuple:
    return () if args is None else tuple((t.data_ptr(), t.stride()) for t in args.tensors)


def keep_checked(owner: KeepsNativeArgs, key: tuple, live: Sequence[Tensor],
                 check: Callable[[], Args | None]) -> Args | None:
    """A layer's checked arguments, or None where it does not take the native half, kept from step to step in
    ``owner.native_weights``. At decode sizes the checks, and reading the modules' parameters they check, cost as
    much as a kernel; so ``check()`` runs again only when something it read may have changed:

    - ``key``, the plain values it depends on (device, dtype and shape of the input), or torch's grad mode or thread
      count (``worth_it`` reads them);
    - ``live``, tensors handed in each step (K/V views, the experts' views), not the same objects;
    - a parameter, buffer or submodule was assigned on any torch module since (a registration hook counts them);
    - a tensor the arguments point into has another data pointer or strides (``param.data = ...``).

    The owner is written only when the record changes: on a torch module every assignment runs
    ``nn.Module.__setattr__``, slow enough to count at decode sizes."""
    key = (*key, torch.is_grad_enabled(), torch.get_num_threads())
    kept = owner.native_weights
    if (kept is None or kept.registrations != _registrations or kept.key != key or len(kept.live) != len(live)
            or any(a is not b for a, b in zip(kept.live, live)) or kept.pointers != _pointers(kept.args)):
        args = check()
        kept = KeptArgs(key, tuple(live), _registrations, _pointers(args), args)
        owner.native_weights = kept
    return kept.args


def _rows_error(status: int, num_rows: int, L: int) -> ValueError:
    """The kernels' key-row check (``rows_status``), which runs before anything is written, as an error."""
    return ValueError(f"key_rows must lie in [0, {num_rows})" if status == 1 else f"lengths must lie in [0, {L}]")


def attention_weights(H: int, dtype: torch.dtype, input_norm: tuple[Tensor, float], qkv_weight: Tensor,
                      num_heads: int, qk_norm: tuple[Tensor, Tensor, float] | None, scale: float, o_weight: Tensor,
                      post_norm: tuple[Tensor, float], k_rows: Tensor, v_rows: Tensor) -> AttentionArgs:
    """The part of a layer's attention half that stays from step to step, for tokens of width H in ``dtype`` (fp32
    or bf16, every tensor in it): the input RMSNorm (``input_norm``: weight [H], eps), the fused q/k/v projection
    ``qkv_weight`` [(Hq + 2 Hkv) D, H], the q/k RMSNorms (``qk_norm``: q and k weights [D], eps; None for none),
    ``o_weight`` [H, Hq D], the post-attention RMSNorm (``post_norm``), all contiguous, and the cache's K/V rows
    [rows, Hkv, D] (``models.DecodeRows``). ``attention_step`` adds a step's RoPE tables and key rows."""
    lib = load()
    Hkv, D = k_rows.shape[1:]
    W = (num_heads + 2 * Hkv) * D
    if lib is None or dtype not in EXPERT_DTYPES:
        raise ValueError("attention_block needs the native library and fp32 or bf16 CPU tensors")
    weights = [input_norm[0], qkv_weight, o_weight, post_norm[0], *(qk_norm[:2] if qk_norm else ())]
    tensors = [*weights, k_rows, v_rows]
    if any(t.dtype != dtype or t.device.type != "cpu" for t in tensors):
        dtypes = sorted({str(t.dtype) for t in tensors})
        raise ValueError(f"attention_block takes CPU tensors of one dtype, got {dtypes}")
    if any(not t.is_contiguous() for t in weights):
        raise ValueError("attention_block: the input, the residual, the weights and the RoPE tables must be contiguous")
    shapes = [(input_norm[0], (H,)), (post_norm[0], (H,)), (qkv_weight, (W, H)), (o_weight, (H, num_heads * D)),
              *((w, (D,)) for w in (qk_norm[:2] if qk_norm else ()))]
    bad = [(list(t.shape), list(shape)) for t, shape in shapes if tuple(t.shape) != shape]
    if bad or num_heads % Hkv:
        raise ValueError(f"attention_block: shapes disagree with H {H}, {num_heads} heads over {Hkv} KV heads of "
                         f"{D} (got, expected): {bad}")
    if k_rows.stride() != v_rows.stride() or k_rows.stride(2) != 1 or v_rows.shape[1:] != (Hkv, D):
        raise ValueError("attention_block: K/V rows need equal strides and unit head-dim stride")
    q_w, k_w, qk_eps = qk_norm if qk_norm else (None, None, 0.0)
    args = AttentionArgs(in_w=input_norm[0].data_ptr(), qkv_w=qkv_weight.data_ptr(), q_w=ptr(q_w), k_w=ptr(k_w),
                         o_w=o_weight.data_ptr(), post_w=post_norm[0].data_ptr(), k_base=k_rows.data_ptr(),
                         v_base=v_rows.data_ptr(), Hq=num_heads, Hkv=Hkv, D=D, qk_norm=qk_norm is not None,
                         num_rows=min(k_rows.shape[0], v_rows.shape[0]), row_stride=k_rows.stride(0),
                         head_stride=k_rows.stride(1), in_eps=input_norm[1], qk_eps=qk_eps, scale=scale,
                         post_eps=post_norm[1])
    args.T, args.H, args.dtype, args.tensors, args.scratch_floats = 0, H, dtype, tuple(tensors), 0
    return args


def attention_step(weights: AttentionArgs, rope: tuple[Tensor, Tensor], rows: DecodeRows) -> AttentionArgs:
    """``weights`` (``attention_weights``) for one decode step: RoPE (``rope``: cos, signed sin [T, rotary], the
    weights' dtype, contiguous) and attention over ``rows``, whose K/V rows must be the ones ``weights`` holds."""
    k_rows, key_rows, lengths = rows.k_rows, rows.key_rows, rows.lengths
    cos, sin = rope
    T, rotary = cos.shape
    L = key_rows.shape[1] if key_rows.dim() == 2 else -1
    if (k_rows.data_ptr() != weights.k_base or rows.v_rows.data_ptr() != weights.v_base
            or k_rows.stride(0) != weights.row_stride):
        raise ValueError("attention_block: the step's K/V rows are not the ones its weights were gathered with")
    if (tuple(sin.shape) != (T, rotary) or rotary > weights.D or rotary % 2 or key_rows.shape != (T, L)
            or lengths.shape != (T,)):
        raise ValueError(f"attention_block: shapes disagree with T {T}, {weights.Hq} heads of {weights.D}: rope "
                         f"tables {list(cos.shape)} / {list(sin.shape)}, key_rows {list(key_rows.shape)}, lengths "
                         f"{list(lengths.shape)}")
    if any(t.dtype != weights.dtype or t.device.type != "cpu" or not t.is_contiguous() for t in rope):
        raise ValueError(f"attention_block: the RoPE tables must be contiguous CPU {weights.dtype}")
    if (key_rows.dtype != torch.int64 or lengths.dtype != torch.int64 or not key_rows.is_contiguous()
            or not lengths.is_contiguous()):
        raise ValueError("attention_block: key_rows and lengths must be contiguous int64")
    args = AttentionArgs.from_buffer_copy(weights)
    args.cos_t, args.sin_t, args.rotary = cos.data_ptr(), sin.data_ptr(), rotary
    args.key_rows, args.lengths, args.L = key_rows.data_ptr(), lengths.data_ptr(), L
    args.T, args.H, args.dtype, args.tensors = T, weights.H, weights.dtype, (*weights.tensors, cos, sin, key_rows,
                                                                               lengths)
    args.scratch_floats = load().moetide_attention_block_scratch(T, weights.H, weights.Hq, weights.Hkv, weights.D, L)
    return args


def _check_activations(name: str, args: AttentionArgs, *tensors: Tensor | None) -> None:
    if any(t is not None and (tuple(t.shape) != (args.T, args.H) or t.dtype != args.dtype or t.device.type != "cpu"
                              or not t.is_contiguous()) for t in tensors):
        raise ValueError(f"{name}: the input and the residual must be contiguous CPU [{args.T}, {args.H}] tensors "
                         f"of {args.dtype}")


def run_attention(args: AttentionArgs, x: Tensor | None, residual: Tensor) -> Tensor:
    """The attention half of ``args`` (``attention_weights`` then ``attention_step``) in one call: ``residual``
    += x (x None in the first layer, where the residual is the input), the input norm, ..., the post-attention add
    into ``residual`` and its norm -> the MLP's input [T, H]. x, residual [T, H] contiguous in the args' dtype."""
    _check_activations("attention_block", args, x, residual)
    lib = load()
    h = torch.empty(args.T, args.H, dtype=args.dtype)
    scratch = torch.empty(args.scratch_floats, dtype=torch.float32)
    pointers = torch.empty(args.T, dtype=torch.int64)
    status = lib.moetide_attention_block(ctypes.addressof(args), ptr(x), residual.data_ptr(), args.T, args.H,
                                         args.dtype == torch.bfloat16, h.data_ptr(), scratch.data_ptr(),
                                         pointers.data_ptr())
    if status:
        raise _rows_error(status, args.num_rows, args.L)
    return h


def moe_args(H: int, gate_weight: Tensor, top_k: int, renormalize: bool, gate_up: Tensor, down: Tensor) -> MoEArgs:
    """A MoE block's router and routed experts in fp32 for tokens of width H: logits x gate_weight^T
    (gate_weight [E, H] contiguous), ``moe_route``'s top-k, then ``moe_experts`` over the stacked views."""
    lib = load()
    E, two_i, _ = gate_up.shape
    if lib is None or not experts_readable(gate_up, down) or gate_up.shape[2] != H:
        raise ValueError(f"moe_block needs the native library and [E, 2I, {H}] / [E, {H}, I] expert views with "
                         f"packed rows")
    require_f32("moe_block", gate_weight, gate_up, down)
    if gate_weight.shape != (E, H) or not gate_weight.is_contiguous():
        raise ValueError(f"moe_block: x must be contiguous and the gate a contiguous [{E}, {H}], got "
                         f"{list(gate_weight.shape)}")
    if not 0 < top_k <= E:
        raise ValueError(f"moe_block: top_k {top_k} must lie in [1, {E}]")
    args = MoEArgs(gate_weight.data_ptr(), gate_up.data_ptr(), down.data_ptr(), E, top_k, int(renormalize),
                   gate_up.stride(0), down.stride(0), two_i // 2)
    args.H, args.tensors = H, (gate_weight, gate_up, down)
    return args


def _moe_scratch(args: MoEArgs, T: int) -> tuple[int, int]:
    """(floats, int64s) of one ``run_moe`` call's scratch."""
    return load().moetide_moe_block_scratch(T, args.H, args.E, args.K, args.I), args.E + 1 + 2 * T * args.K


def run_moe(args: MoEArgs, x: Tensor) -> tuple[Tensor, Tensor]:
    """``moe_args``' block in one call (``layer.c``): x [T, H] fp32 contiguous -> (out [T, H], expert ids [T, K]
    int64). The gate's sums are the native kernel's (fp32 round-off from torch's)."""
    require_f32("moe_block", x)
    if x.dim() != 2 or x.shape[1] != args.H or not x.is_contiguous():
        raise ValueError(f"moe_block: x must be contiguous [T, {args.H}], got {list(x.shape)}")
    T = x.shape[0]
    out, weights = torch.empty_like(x), torch.empty(T, args.K, dtype=torch.float32)
    ids = torch.empty(T, args.K, dtype=torch.int64)
    floats, ints = _moe_scratch(args, T)
    scratch, iscratch = torch.empty(floats, dtype=torch.float32), torch.empty(ints, dtype=torch.int64)
    load().moetide_moe_block(ctypes.addressof(args), x.data_ptr(), T, args.H, out.data_ptr(), weights.data_ptr(),
                             ids.data_ptr(), scratch.data_ptr(), iscratch.data_ptr())
    return out, ids


def run_layers(attention: Sequence[AttentionArgs], moe: Sequence[MoEArgs], x: Tensor | None,
               residual: Tensor) -> tuple[Tensor, Tensor, list[Tensor]]:
    """A decode step's decoder layers in one fp32 call: layer l's ``attention[l]`` half then its ``moe[l]`` half,
    the next layer reading its output, as ``run_attention`` and ``run_moe`` one after the other (the same bits) ->
    (the last layer's MoE output [T, H], ``residual`` (updated in place), each layer's expert ids [T, K]). x and
    residual as ``run_attention`` takes them. Every layer's key rows are checked before any layer runs."""
    if not attention or len(attention) != len(moe):
        raise ValueError(f"run_layers takes one MoE half per attention half, got {len(attention)} and {len(moe)}")
    first = attention[0]
    if any(a.T != first.T or a.H != first.H or a.dtype != torch.float32 for a in attention) or any(
            m.H != first.H for m in moe):
        raise ValueError("run_layers: every layer's halves must be fp32 for the same tokens")
    _check_activations("run_layers", first, x, residual)
    T, H, n = first.T, first.H, len(attention)
    h, out = torch.empty(T, H), torch.empty(T, H)
    ks = [m.K for m in moe]
    weights, ids = torch.empty(T * sum(ks), dtype=torch.float32), torch.empty(T * sum(ks), dtype=torch.int64)
    moe_scratch = [_moe_scratch(m, T) for m in moe]
    scratch = torch.empty(max(max(a.scratch_floats for a in attention), max(f for f, _ in moe_scratch)))
    iscratch = torch.empty(max(i for _, i in moe_scratch), dtype=torch.int64)
    pointers = torch.empty(T, dtype=torch.int64)
    attention_array, moe_array = (AttentionArgs * n)(*attention), (MoEArgs * n)(*moe)  # copies, for the call
    status = load().moetide_decode_layers(n, ctypes.addressof(attention_array), ctypes.addressof(moe_array), ptr(x),
                                          residual.data_ptr(), T, H, h.data_ptr(), out.data_ptr(),
                                          weights.data_ptr(), ids.data_ptr(), scratch.data_ptr(),
                                          iscratch.data_ptr(), pointers.data_ptr())
    if status:
        raise _rows_error(status, first.num_rows, first.L)
    if len(set(ks)) == 1:  # every layer's top-k alike: one view
        return out, residual, list(ids.view(n, T, ks[0]).unbind(0))
    return out, residual, [part.view(T, k) for part, k in zip(ids.split([T * k for k in ks]), ks)]
