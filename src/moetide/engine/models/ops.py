"""Dense projections of the engine's models: ``linear`` is ``F.linear`` without bias, taken at decode sizes on the
CPU by the native weight-streaming kernel (``engine.native.linear``).

Why: a decode step of a few tokens reads every projection's weights once and does little arithmetic with them,
so its cost is how fast the weights stream from memory. torch's one-thread GEMV reads them at about half the
core's bandwidth (measured on this machine: 7.5 GB/s against 17-24 GB/s for a plain sum; bf16 less), the
native kernel near all of it. Past a few tokens the step is arithmetic, where torch's GEMM is faster, by how much
depending on the kernel built: hence ``NATIVE_LINEAR_MAX_TOKENS`` per vector path (measured at K 256-512 and N
512-1024, one thread, on a Zen 4 core: its AVX-512 kernel beats MKL's fp32 GEMM up to 32 tokens, 0-30% with the
weights in cache and 25-58% from memory, and with AVX512-BF16 oneDNN's bf16 GEMM up to 16, 5-50%; converting
bf16 to fp32 instead, it lost past 4; the AVX2 kernel's limits are the ones measured before it). Results equal
torch's to one rounding of a sum taken in another order (fp32 round-off; bf16 as torch's bf16 linear: fp32 sums
rounded once).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from moetide.engine import native

# most rows of x the native kernel takes, by the vector path it was built with (native.linear_isa())
NATIVE_LINEAR_MAX_TOKENS = {
    "avx512-bf16": {torch.float32: 32, torch.bfloat16: 16},
    "avx512": {torch.float32: 32, torch.bfloat16: 4},
    "avx2": {torch.float32: 4, torch.bfloat16: 8},
}


def _max_tokens(dtype: torch.dtype) -> int:
    return NATIVE_LINEAR_MAX_TOKENS.get(native.linear_isa(), {}).get(dtype, 0)


def linear(x: Tensor, weight: Tensor) -> Tensor:
    """x [..., K] @ weight [N, K]^T -> [..., N]."""
    num_rows = x.numel() // x.shape[-1] if x.dim() else 0
    if (num_rows <= _max_tokens(x.dtype) and weight.dtype == x.dtype and weight.dim() == 2
            and weight.is_contiguous() and native.worth_it(x, num_rows * weight.numel(), native.EXPERT_DTYPES)):
        y = native.linear(x if x.dim() == 2 else x.reshape(num_rows, x.shape[-1]), weight)
        return y if x.dim() == 2 else y.view(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight)
