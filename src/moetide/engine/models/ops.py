"""Dense projections of the engine's models: ``linear`` is ``F.linear`` without bias, taken at decode sizes on the
CPU by the native weight-streaming kernel (``engine.native.linear``).

Why: a decode step of a few tokens reads every projection's weights once and does little arithmetic with them,
so its cost is how fast the weights stream from memory. torch's one-thread GEMV reads them at about half the
core's bandwidth (measured on this AVX2 machine: 7.5 GB/s against 17-24 GB/s for a plain sum; bf16 less), the
native kernel near all of it. Past a few tokens the step is arithmetic, where torch's GEMM is faster: hence
``NATIVE_LINEAR_MAX_TOKENS`` (measured at hidden 512, 768 output rows, one thread). Results equal torch's to one
rounding of a sum taken in another order (fp32 round-off; bf16 as torch's bf16 linear: fp32 sums rounded once).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from moetide.engine import native

NATIVE_LINEAR_MAX_TOKENS = {torch.float32: 4, torch.bfloat16: 8}  # most rows of x the native kernel takes


def linear(x: Tensor, weight: Tensor) -> Tensor:
    """x [..., K] @ weight [N, K]^T -> [..., N]."""
    num_rows = x.numel() // x.shape[-1] if x.dim() else 0
    if (num_rows <= NATIVE_LINEAR_MAX_TOKENS.get(x.dtype, 0) and weight.dtype == x.dtype and weight.dim() == 2
            and weight.is_contiguous() and native.worth_it(x, num_rows * weight.numel(), native.EXPERT_DTYPES)):
        return native.linear(x.reshape(num_rows, x.shape[-1]), weight).view(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight)
