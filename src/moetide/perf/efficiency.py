"""``Efficiency``: the fractions of datasheet rates that kernels reach and the fixed costs the step model
(``perf.step``) charges; one instance per device preset, engine profile (``perf.engines``) or device file."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Efficiency:
    """Fractions of datasheet rates that kernels reach, and fixed costs. Defaults and sources: docs/perf.md.

    matmul:      dense GEMMs and grouped MoE GEMMs vs dense tensor-core peak (large BF16 GEMMs on H100 reach
                 ~70-80% of peak; CUTLASS/cuBLAS figures)
    hbm:         streaming reads vs HBM datasheet bandwidth (sustained copy/triad on H100 measures ~3.0-3.1 of
                 3.35 TB/s; well-tuned decode kernels 70-85% — "MBU")
    attention:   attention FLOPs vs peak (FlashAttention-2 reaches 35%, FlashAttention-3 75% on H100; Shah et
                 al. 2024, arXiv:2407.08608)
    allreduce:   ring all-reduce bus bandwidth vs one-way NVLink (measured p2p ~380 of 450 GB/s on H100,
                 NVIDIA/nccl#1264)
    allreduce_latency_s: per collective (vLLM's custom all-reduce on H100: 8.7-11.8 us for <= 32 KB at TP 2-8,
                 table in sgl-project/sglang#2904)
    step_overhead_s: per step (vllm-project/vllm#17866 measures 2.6-2.7 ms TPOT for Llama-3.2-1B, whose weights
                 take ~0.8 ms to read at 3.35 TB/s)
    seq_overhead_s: per sequence per step (0 for the GPU presets; a device file's ``[efficiency]`` table sets it,
                 as ``moetide calibrate --model`` fits it for the PyTorch engine on a CPU)
    attention_memory: the attention kernel's KV reads vs HBM bandwidth; None: ``hbm`` (the GPU presets). A paged
                 decode kernel on a CPU reaches a fraction of what streaming weights does (``moetide calibrate``)
    request_overhead_s, request_overhead_s_per_token: what each arriving request costs the device besides its
                 steps, fixed and per prompt token (0 for the GPU presets, whose server runs on other cores; a
                 server sharing its one core with the engine receives and checks each prompt on it). The replay
                 charges them at the request's send (``sim.replay``), not in ``step_time_s``
    moe_matmul:  the grouped MoE GEMM's share of peak at many tokens per expert; None: ``matmul``
    moe_matmul_fp8: the same with 1-byte (FP8) weights, against the same BF16 peak (FP8 fused-MoE kernels do not
                 reach the FP8 tensor-core rate at these shapes); None: ``moe_matmul``
    moe_half_tokens: tokens per active expert at which the grouped GEMM reaches half of ``moe_matmul``
    moe_layer_s, attention_layer_s, linear_layer_s: fixed time per MoE, full-attention and linear-attention
                 layer (the small kernels and launch gaps no byte or FLOP term carries)
    custom_allreduce_max_bytes: all-reduce messages up to this size use vLLM's custom all-reduce (0: none do)
    nccl_latency_s: per NCCL ring all-reduce; None: ``allreduce_latency_s``

    Every new-term default is neutral (the plain roofline); ``perf.engines`` holds the fitted engine profiles.
    """

    matmul: float = 0.7
    hbm: float = 0.8
    attention: float = 0.5
    allreduce: float = 0.8
    allreduce_latency_s: float = 10e-6
    step_overhead_s: float = 1e-3
    seq_overhead_s: float = 0.0
    attention_memory: float | None = None
    request_overhead_s: float = 0.0
    request_overhead_s_per_token: float = 0.0
    moe_matmul: float | None = None
    moe_matmul_fp8: float | None = None
    moe_half_tokens: float = 0.0
    moe_layer_s: float = 0.0
    attention_layer_s: float = 0.0
    linear_layer_s: float = 0.0
    custom_allreduce_max_bytes: float = 0.0
    nccl_latency_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("matmul", "hbm", "attention", "allreduce", "attention_memory", "moe_matmul", "moe_matmul_fp8"):
            value = getattr(self, name)
            if value is None and name in ("attention_memory", "moe_matmul", "moe_matmul_fp8"):
                continue
            if not (isinstance(value, (int, float)) and 0 < value <= 1):
                raise ValueError(f"Efficiency.{name} is a fraction of peak and must be in (0, 1], got {value!r}")
        for name in ("allreduce_latency_s", "step_overhead_s", "seq_overhead_s", "request_overhead_s",
                     "request_overhead_s_per_token", "moe_half_tokens", "moe_layer_s", "attention_layer_s",
                     "linear_layer_s", "custom_allreduce_max_bytes", "nccl_latency_s"):
            value = getattr(self, name)
            if value is None and name == "nccl_latency_s":
                continue
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"Efficiency.{name} must be a finite number >= 0, got {value!r}")
