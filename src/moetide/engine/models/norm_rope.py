"""The norms and rotary embeddings the engine's models share: RMSNorm (plain and zero-centered, with the residual
add fused in) and RoPE (tables cached per position, the halves convention), each with transformers 5.19's
arithmetic and the native CPU kernel where it gives the same bits (see ``models.common``)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from moetide.engine import native

Rope = tuple[Tensor, Tensor]  # cos, sin: [T, rotary_dim] each


def rms_normalize(x: Tensor, eps: float) -> Tensor:
    """x / rms(x) over the last dim, computed in fp32 and cast back to x's dtype (no weight), as transformers
    writes it. (``F.rms_norm`` gives the same bits in fp32 but is no faster on the CPU in torch 2.13: it is a
    composite of the same ops.)"""
    x32 = x.float()
    return (x32 * x32.pow(2).mean(-1, keepdim=True).add_(eps).rsqrt_()).to(x.dtype)


class RMSNorm(nn.Module):
    """RMSNorm over the last dim. ``zero_centered`` (Qwen3-Next) scales by ``1 + weight`` in fp32 and casts last;
    the plain form (Qwen3-MoE, Mixtral) casts the normalized input back first, then scales by ``weight`` — in one
    native call for fp32 and bf16 on the CPU without autograd (``engine.native.rms_norm``; equal to fp32
    round-off before the roundings)."""

    def __init__(self, dim: int, eps: float, zero_centered: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps, self.zero_centered = eps, zero_centered

    def forward(self, x: Tensor) -> Tensor:
        if native.worth_it(x, x.numel(), native.EXPERT_DTYPES) and self.weight.dtype == x.dtype:  # one call
            rows = x.reshape(-1, x.shape[-1])
            return native.rms_norm(rows, self.eps, self.weight, self.zero_centered).view(x.shape)
        if not self.zero_centered:
            return self.weight * rms_normalize(x, self.eps)
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).type_as(x)

    def add_forward(self, x: Tensor, residual: Tensor) -> tuple[Tensor, Tensor]:
        """(norm(x + residual), x + residual) for x, residual [T, D]: the decoder layer's residual add and the norm
        after it. Natively one call (vLLM's fused_add_rms_norm), the sum written into ``residual``'s memory (the
        layer's running sum, which nothing else holds); the same bits as the add, then ``self``."""
        if (native.worth_it(x, x.numel(), native.EXPERT_DTYPES) and self.weight.dtype == x.dtype == residual.dtype
                and x.dim() == 2 and residual.shape == x.shape and residual.is_contiguous()):
            return native.rms_norm(x, self.eps, self.weight, self.zero_centered, residual=residual), residual
        total = x + residual
        return self(total), total


def rope_tables(positions: Tensor, rotary_dim: int, theta: float, dtype: torch.dtype) -> Rope:
    """cos and *signed* sin [T, rotary_dim] for LongTensor[T] positions (transformers' default RoPE, inv_freq on
    the CPU); the sin table's first half is negated, so ``apply_rope`` swaps halves without negating them."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim))
    freqs = positions[:, None].float() * inv_freq.to(positions.device)  # [T, R/2]
    sin = freqs.sin()
    return torch.cat([freqs, freqs], dim=-1).cos().to(dtype), torch.cat([-sin, sin], dim=-1).to(dtype)


class RopeCache:
    """``rope_tables`` for positions [0, N), computed once and regrown (doubling) when a sequence gets longer; a
    step gathers its rows by position. Elementwise the same numbers as computing them per step."""

    def __init__(self, rotary_dim: int, theta: float) -> None:
        self.rotary_dim, self.theta = rotary_dim, theta
        self._tables: dict[tuple[torch.device, torch.dtype], Rope] = {}

    def lookup(self, positions: Tensor, max_position: int, dtype: torch.dtype) -> Rope:
        """cos, sin [T, rotary_dim] for ``positions`` (each at most ``max_position``)."""
        key = (positions.device, dtype)
        tables = self._tables.get(key)
        if tables is None or tables[0].shape[0] <= max_position:
            size = max(256, max_position + 1, 2 * (0 if tables is None else tables[0].shape[0]))
            with torch.inference_mode(False):  # normal tensors, usable in and out of inference mode
                tables = rope_tables(torch.arange(size, device=positions.device), self.rotary_dim, self.theta,
                                     dtype)
            self._tables[key] = tables
        return tables[0].index_select(0, positions), tables[1].index_select(0, positions)


def apply_rope(x: Tensor, rope: Rope) -> Tensor:
    """x [T, h, D]: rotate the first rotary_dim dims (halves convention), pass the rest through. Bit for bit
    transformers' ``x * cos + rotate_half(x) * sin``: (-a)·s and a·(-s) are the same float."""
    cos, sin = rope[0][:, None, :], rope[1][:, None, :]
    rotary_dim, half = cos.shape[-1], cos.shape[-1] // 2
    rot = x[..., :rotary_dim]
    out = rot * cos + torch.cat([rot[..., half:], rot[..., :half]], dim=-1) * sin
    return out if rotary_dim == x.shape[-1] else torch.cat([out, x[..., rotary_dim:]], dim=-1)
