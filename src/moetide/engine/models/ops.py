"""Dense projections of the engine's models: ``linear`` is ``F.linear`` without bias, taken at decode sizes on the
CPU by the native weight-streaming kernel (``engine.native.linear``).

Why: a decode step of a few tokens reads every projection's weights once and does little arithmetic with them,
so its cost is how fast the weights stream from memory. torch's one-thread GEMV reads them at about half the
core's bandwidth (measured on this machine: 7.5 GB/s against 17-24 GB/s for a plain sum; bf16 less), the
native kernel near all of it. Past a few tokens the step is arithmetic, where torch's GEMM is faster, by how much
depending on the kernel built: hence ``NATIVE_LINEAR_MAX_TOKENS`` per vector path (measured at K 256-512 and N
512-1024, one thread, on a Zen 4 core: its AVX-512 kernel beats MKL's fp32 GEMM up to 32 tokens, 0-30% with the
weights in cache and 25-58% from memory; with AVX512-BF16 it takes 10-55% less time than torch's bf16 linear
from memory up to 24 tokens, ties at 32 and is 10-20% behind at 64, while whole bf16 decode steps at batch 32
take 9-17% less time with it (the decoder layer then fuses, ``models.common``); converting bf16 to fp32 instead,
it lost past 4; the AVX2 kernel's limits are the ones measured before it). Results equal torch's to one rounding
of a sum taken in another order (fp32 round-off; bf16 as torch's bf16 linear: fp32 sums rounded once).

Built with AMX tiles (``linear_isa()`` "amx", ``moe.c``) the native bf16 kernel is torch's bits (both accumulate
in the tiles) in 0.3-0.7x its time up to 16 rows (K 512, N 512-1024, one thread), 0.9-1.9x at 32; it takes at
most 8, the cap the whole-step measurements below set (whole steps at 16 rows with it were not measured). Where
only torch's bf16 GEMMs run on AMX tiles (Sapphire Rapids and later: oneDNN's AMX path, ~1 TFLOP/s on one core
against ~0.2 for AVX512-BF16 dot products) the native kernel keeps bf16 only up to
``NATIVE_LINEAR_MAX_TOKENS_BESIDE_AMX`` rows: measured on such a core (K 512, N 512-1024, one thread) it takes
0.8-0.95x torch's time at 1-4 rows, 1.2-1.3x at 8, 2.1-2.5x at 16 and 3.5x at 32; at 8 the decoder layer's
fused native call (``models.common``), which needs native projections, still gains more (bf16 decode steps at
batch 8 took 10-20% longer with torch's projections), at 32 torch's win (3-7% shorter steps).

Projections with few outputs (a router's gate, N = the expert count; Qwen3-Next's shared-expert gate, N = 1) go
to torch whatever the row count: the native call's fixed cost is most of theirs. Measured one thread on the Zen 4
core with 24 MiB streamed between calls, as the experts do: fp32 at K 512, N 8-64, torch 1.4-3.7x faster from 1
to 32 rows, even at N 256 and the native kernel ahead from N 512; at K 2048 even at N 128 (0.77-1.37x). bf16:
torch's small path (about 10 us) serves T·N <= 8, its next path costs about 48 us, where the native kernel is
0.6-0.9x of it.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor

from moetide.engine import native

# most rows of x the native kernel takes, by the vector path it was built with (native.linear_isa())
NATIVE_LINEAR_MAX_TOKENS = {
    "amx": {torch.float32: 32, torch.bfloat16: 8},
    "avx512-bf16": {torch.float32: 32, torch.bfloat16: 32},
    "avx512": {torch.float32: 32, torch.bfloat16: 4},
    "avx2": {torch.float32: 4, torch.bfloat16: 8},
}


NATIVE_LINEAR_MAX_TOKENS_BESIDE_AMX = 8  # most bf16 rows of a kernel without AMX beside torch's AMX GEMMs (above)

# fewest outputs for which the native kernel takes an fp32 projection (see above)
NATIVE_LINEAR_MIN_OUTPUTS_FP32 = 128
# most T·N of a bf16 projection that torch's small GEMM path serves faster than the native kernel
TORCH_BF16_SMALL_PRODUCT = 8


@functools.cache
def torch_bf16_on_amx() -> bool:
    """Whether torch's CPU bf16 GEMMs run on AMX tiles here (the check vLLM's CPU MoE makes too)."""
    return torch.cpu._is_amx_tile_supported()


def native_max_rows(dtype: torch.dtype) -> int:
    """Most rows the native kernel takes in this dtype here (the vector path built; torch's AMX for bf16)."""
    isa = native.linear_isa()
    most = NATIVE_LINEAR_MAX_TOKENS.get(isa, {}).get(dtype, 0)
    if dtype == torch.bfloat16 and isa != "amx" and torch_bf16_on_amx():
        return min(most, NATIVE_LINEAR_MAX_TOKENS_BESIDE_AMX)
    return most


def _few_outputs(num_rows: int, num_outputs: int, dtype: torch.dtype) -> bool:
    if dtype == torch.float32:
        return num_outputs < NATIVE_LINEAR_MIN_OUTPUTS_FP32
    return num_rows * num_outputs <= TORCH_BF16_SMALL_PRODUCT


def native_linear_takes(x: Tensor, num_rows: int, weight: Tensor) -> bool:
    """Whether ``linear`` runs ``num_rows`` rows like x through the native kernel (see the module docstring)."""
    return (num_rows <= native_max_rows(x.dtype) and weight.dtype == x.dtype and weight.dim() == 2
            and not _few_outputs(num_rows, weight.shape[0], x.dtype) and weight.is_contiguous()
            and native.worth_it(x, num_rows * weight.numel(), native.EXPERT_DTYPES))


def linear(x: Tensor, weight: Tensor) -> Tensor:
    """x [..., K] @ weight [N, K]^T -> [..., N]."""
    num_rows = x.numel() // x.shape[-1] if x.dim() else 0
    if native_linear_takes(x, num_rows, weight):
        y = native.linear(x if x.dim() == 2 else x.reshape(num_rows, x.shape[-1]), weight)
        return y if x.dim() == 2 else y.view(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight)
