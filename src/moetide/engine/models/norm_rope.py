"""The norms and rotary embeddings the engine's models share: RMSNorm (plain and zero-centered, with the residual
add fused in) and RoPE (tables cached per position, the halves convention), each with transformers 5.19's
arithmetic and the native CPU kernel where it gives the same bits (see ``models.common``)."""

from __future__ import annotations

import math
from dataclasses import dataclass

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


def default_inv_freq(rotary_dim: int, theta: float) -> Tensor:
    """transformers' default RoPE frequencies [rotary_dim / 2] (fp32, on the CPU)."""
    return 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim))


@dataclass(frozen=True)
class Yarn:
    """YaRN's parameters as a config's ``rope_parameters`` (or older ``rope_scaling``) give them."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    @staticmethod
    def mscale_of(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    def cos_sin_factor(self) -> float:
        """What the cos and sin tables are multiplied by (transformers' ``attention_factor``)."""
        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return self.mscale_of(self.factor, self.mscale) / self.mscale_of(self.factor, self.mscale_all_dim)
        return self.mscale_of(self.factor)

    def inv_freq(self, rotary_dim: int, theta: float) -> Tensor:
        """transformers 5.19's ``_compute_yarn_parameters`` frequencies: each dimension between interpolation
        (``1 / (factor · base^(2i/d))``) and extrapolation, by a linear ramp over the correction range."""
        def correction_dim(rotations: float) -> float:
            return (rotary_dim * math.log(self.original_max_position_embeddings / (rotations * 2 * math.pi))
                    / (2 * math.log(theta)))

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, rotary_dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        pos_freqs = theta ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim)
        extrapolation = 1 - ramp
        return 1.0 / (self.factor * pos_freqs) * (1 - extrapolation) + 1.0 / pos_freqs * extrapolation


def rope_tables(positions: Tensor, rotary_dim: int, theta: float, dtype: torch.dtype, *,
                inv_freq: Tensor | None = None, factor: float = 1.0) -> Rope:
    """cos and *signed* sin [T, rotary_dim] for LongTensor[T] positions (transformers' default RoPE, or the
    given ``inv_freq``, tables times ``factor``; inv_freq on the CPU); the sin table's first half is negated, so
    ``apply_rope`` swaps halves without negating them."""
    if inv_freq is None:
        inv_freq = default_inv_freq(rotary_dim, theta)
    freqs = positions[:, None].float() * inv_freq.to(positions.device)  # [T, R/2]
    cos, sin = torch.cat([freqs, freqs], dim=-1).cos(), freqs.sin()
    if factor != 1.0:
        cos, sin = cos * factor, sin * factor
    return cos.to(dtype), torch.cat([-sin, sin], dim=-1).to(dtype)


class RopeCache:
    """``rope_tables`` for positions [0, N), computed once and regrown (doubling) when a sequence gets longer; a
    step gathers its rows by position. Elementwise the same numbers as computing them per step. ``yarn``: YaRN's
    frequencies and table factor instead of the default RoPE's."""

    def __init__(self, rotary_dim: int, theta: float, yarn: Yarn | None = None) -> None:
        self.rotary_dim, self.theta, self.yarn = rotary_dim, theta, yarn
        self._tables: dict[tuple[torch.device, torch.dtype], Rope] = {}

    def lookup(self, positions: Tensor, max_position: int, dtype: torch.dtype) -> Rope:
        """cos, sin [T, rotary_dim] for ``positions`` (each at most ``max_position``)."""
        key = (positions.device, dtype)
        tables = self._tables.get(key)
        if tables is None or tables[0].shape[0] <= max_position:
            size = max(256, max_position + 1, 2 * (0 if tables is None else tables[0].shape[0]))
            with torch.inference_mode(False):  # normal tensors, usable in and out of inference mode
                yarn = self.yarn  # its frequencies made here, not where the model was built (maybe on meta)
                inv_freq = None if yarn is None else yarn.inv_freq(self.rotary_dim, self.theta)
                tables = rope_tables(torch.arange(size, device=positions.device), self.rotary_dim, self.theta,
                                     dtype, inv_freq=inv_freq, factor=1.0 if yarn is None else yarn.cos_sin_factor())
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


def apply_rope_interleaved(x: Tensor, rope: Rope) -> Tensor:
    """x [T, h, R] rotated in adjacent pairs (x[2i], x[2i+1]) by frequency i — DeepSeek's convention, which
    transformers 5.19 writes as a complex product in fp32 — from ``rope_tables``' halves-convention tables; computed
    in fp32 and cast back to x's dtype, as transformers does."""
    half = rope[0].shape[-1] // 2
    cos, sin = rope[0][:, None, :half].float(), rope[1][:, None, half:].float()  # [T, 1, R/2]
    pairs = x.float().unflatten(-1, (-1, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2).to(x.dtype)
