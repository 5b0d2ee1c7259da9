"""Measurements behind ``moetide calibrate``, on the machine that runs them: STREAM-like DRAM bandwidth, the fp32
GEMM rate, CPU attention with the kernel the engine runs for each shape, and pinned host-to-device copies; and
``calibrate``, which runs them all and fits. MEASURED. They live with the engine because they run its kernels;
``perf.calibrate`` keeps the fit and the host-file reading, stdlib only (its docstring says what each
measurement is and how it is used). torch is imported inside the functions only.
"""

from __future__ import annotations

import datetime
import math
import os
import random
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from moetide.errors import UserError, read_json
from moetide.perf.calibrate import (
    CLOCKS,
    FLASH_KERNEL,
    KERNELS,
    NATIVE_KERNEL,
    NATIVE_LAYOUT_LAYERS,
    AttentionSample,
    AttentionShape,
    Calibration,
    DramResult,
    MiB,
    calibration_shapes,
    cpu_model_name,
    fit_cpu_efficiency,
    installed_memory_bytes,
    llc_bytes,
)
from moetide.perf.step import StepShape
from moetide.perf.step_calibrate import StepSample, designed_runs


def check_clock(clock: str, num_threads: int) -> None:
    if clock not in CLOCKS:
        raise UserError(f"clock must be one of {list(CLOCKS)}, got {clock!r}")
    if clock == "thread" and num_threads != 1:
        raise UserError(f"the thread clock counts only the calling thread's CPU time: it needs 1 torch thread, "
                        f"not {num_threads}")


def time_calls(call: Callable[[], object], repeats: int, before: Callable[[], object] | None = None,
                clock: str = "wall") -> tuple[float, float]:
    """(median, min) seconds of ``call`` on ``clock`` over ``repeats`` timed calls after one untimed warm-up."""
    now = CLOCKS[clock]
    call()
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        start = now()
        call()
        times.append(now() - start)
    return statistics.median(times), min(times)


def measure_dram(buffer_bytes: int, repeats: int, clock: str = "wall") -> DramResult:
    import torch

    n = buffer_bytes // 4
    a, b, c = torch.zeros(n), torch.ones(n), torch.full((n,), 2.0)
    triad, _ = time_calls(lambda: torch.add(b, c, alpha=3.0, out=a), repeats, clock=clock)
    copy, _ = time_calls(lambda: a.copy_(b), repeats, clock=clock)
    read, _ = time_calls(lambda: torch.sum(c), repeats, clock=clock)
    return DramResult(n * 4, 3 * 4 * n / triad, 2 * 4 * n / copy, 4 * n / read)


APPEND_SHAPE = (2, 4, 32768, 128)  # a layer's K for 2 x 32K tokens, 4 KV heads of 128: 64 MiB of bf16


def measure_append(repeats: int, clock: str = "wall") -> float:
    """Bytes per second (the old tensor read and written) of appending one token by concatenation into a fresh
    tensor, as a transformers ``DynamicCache`` does every step: past the allocator's mmap threshold the new tensor
    is faulted in page by page, which a streaming copy into mapped memory never pays."""
    import torch

    old = torch.ones(APPEND_SHAPE, dtype=torch.bfloat16)
    new = torch.ones(*APPEND_SHAPE[:2], 1, APPEND_SHAPE[3], dtype=torch.bfloat16)
    median, _ = time_calls(lambda: torch.cat([old, new], dim=-2), repeats, clock=clock)
    return 2 * old.numel() * old.element_size() / median


def measure_gemm(n: int, repeats: int, clock: str = "wall") -> float:
    """fp32 FLOP/s of an n x n x n matrix product (median)."""
    import torch

    gen = torch.Generator().manual_seed(0)
    x, y, z = torch.rand(n, n, generator=gen), torch.rand(n, n, generator=gen), torch.empty(n, n)
    median, _ = time_calls(lambda: torch.mm(x, y, out=z), repeats, clock=clock)
    return 2 * n**3 / median


def flash_kernel() -> Callable:
    import torch

    op = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if op is None:
        raise UserError(f"torch {torch.__version__} has no {FLASH_KERNEL}; calibrate needs torch >= 2.3")
    return op


def engine_block_size() -> int:
    """Tokens per KV block of an engine built with the defaults for a model of full attention alone (vLLM's 16)."""
    from moetide.perf.budget import DEFAULT_BLOCK_SIZE

    return DEFAULT_BLOCK_SIZE


def kernel_for(shape: AttentionShape) -> str:
    """The kernel (a key of ``KERNELS``) the engine's split backend runs for ``shape`` on torch's current thread
    count: ``native`` for one fp32 query per sequence when ``native.decode_worth_it`` says so (the native library
    is available, ``MOETIDE_NATIVE`` is not 0, and one thread, or work small enough for one), else ``flash``."""
    if shape.num_queries != 1 or shape.kv_dtype != "fp32":
        return "flash"
    import torch

    from moetide.engine import native

    bs = engine_block_size()
    num_keys = math.ceil(shape.kv_tokens / bs) * bs  # a sequence's keys come in whole blocks
    with torch.inference_mode():  # as the engine runs: the native kernels have no backward
        q = torch.empty(shape.num_seqs, shape.num_heads, shape.head_dim)
        return "native" if native.decode_worth_it(q, num_keys) else "flash"


def time_attention(shape: AttentionShape, repeats: int, flush_bytes: int, seed: int = 0, clock: str = "wall",
                   kernel: str | None = None) -> AttentionSample:
    """Time ``kernel`` (default: ``kernel_for(shape)``, the engine's) on ``shape`` (module docstring), reading
    ``flush_bytes`` before each call."""
    kernel = kernel_for(shape) if kernel is None else kernel
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {list(KERNELS)}, got {kernel!r}")
    timer = _time_native if kernel == "native" else _time_flash
    median, least = timer(shape, repeats, flush_bytes, seed, clock)
    return AttentionSample(shape, median, least, kernel)


def _time_flash(shape: AttentionShape, repeats: int, flush_bytes: int, seed: int,
                clock: str) -> tuple[float, float]:
    """``FLASH_KERNEL`` over contiguous K and V, GQA as one problem per KV head."""
    import torch

    op = flash_kernel()
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[shape.kv_dtype]
    gen = torch.Generator().manual_seed(seed)
    group = shape.num_heads // shape.num_kv_heads
    B, Hkv, N, d = shape.num_seqs, shape.num_kv_heads, shape.kv_tokens, shape.head_dim

    def rand(*size: int) -> torch.Tensor:
        return (torch.rand(*size, generator=gen) * 2 - 1).to(dtype)

    q, k = rand(B, Hkv, group * shape.num_queries, d), rand(B, Hkv, N, d)
    v = k if shape.is_mla else rand(B, Hkv, N, d)  # MLA: the values are the keys (the engine's absorbed form)
    flush = torch.ones(max(1, flush_bytes // 4))
    scale = d**-0.5
    out, lse = op(q, k, v, scale=scale)
    if tuple(lse.shape) != (B, Hkv, group * shape.num_queries):  # the merge needs one lse per query row
        raise RuntimeError(f"{FLASH_KERNEL} returned a log-sum-exp of shape {tuple(lse.shape)}")
    return time_calls(lambda: op(q, k, v, scale=scale), repeats, before=lambda: torch.sum(flush), clock=clock)


def _time_native(shape: AttentionShape, repeats: int, flush_bytes: int, seed: int,
                 clock: str) -> tuple[float, float]:
    """``NATIVE_KERNEL`` as the split backend calls it for a decode group's CPU partial: q [B, Hq, d], K and V read
    in place from host blocks in the engine's layout, each sequence's blocks scattered, the lse requested."""
    import torch

    from moetide.engine import native
    from moetide.engine.host_kv import HostKVStorage
    from moetide.engine.storage import KVLayout

    if shape.num_queries != 1 or shape.kv_dtype != "fp32" or not native.available():
        raise UserError(f"{NATIVE_KERNEL} times one fp32 query per sequence with the native library "
                        f"({native.unavailable_reason() or 'available'}), not {shape}")
    gen = torch.Generator().manual_seed(seed)
    B, Hq, d, bs = shape.num_seqs, shape.num_heads, shape.head_dim, engine_block_size()
    per_seq = math.ceil(shape.kv_tokens / bs)
    layout = KVLayout(tuple(range(NATIVE_LAYOUT_LAYERS)), bs, shape.num_kv_heads, d, torch.float32,
                      values_in_keys=shape.is_mla)
    host = HostKVStorage(layout, B * per_seq, 0, pin=False)
    host.data.view(torch.float32).uniform_(-1, 1, generator=gen)
    blocks = torch.randperm(B * per_seq, generator=gen).tolist()  # sequence s owns blocks[s * per_seq:][:per_seq]
    starts = torch.tensor(host.key_rows(blocks)).view(B, per_seq, 1)
    key_rows = (starts + torch.arange(bs)).view(B, per_seq * bs)  # [B, L]: slot o of a block is row start + o
    lengths = torch.full((B,), shape.kv_tokens, dtype=torch.int64)
    k_rows, v_rows = host.kv_rows(0)
    q = torch.rand(B, Hq, d, generator=gen) * 2 - 1
    lse = torch.empty(B, Hq)
    flush = torch.ones(max(1, flush_bytes // 4))
    scale = d**-0.5

    def call() -> torch.Tensor:
        return native.paged_decode_attention(q, k_rows, v_rows, key_rows, lengths, scale, lse=lse)

    with torch.inference_mode():
        call()
        if not bool(torch.isfinite(lse).all()):
            raise RuntimeError(f"{NATIVE_KERNEL} returned a non-finite log-sum-exp")
        return time_calls(call, repeats, before=lambda: torch.sum(flush), clock=clock)


def measure_host_to_device(repeats: int, num_bytes: int = 256 * MiB) -> dict[str, Any]:
    """{"bytes_per_s", "latency_s", "device"} of pinned copies, or {"skipped": reason} without a CUDA device."""
    import torch

    if not torch.cuda.is_available():
        return {"skipped": f"no CUDA device (torch {torch.__version__}: torch.cuda.is_available() is False)"}
    src = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    small_src, small_dst = src[:4096], dst[:4096]

    def copy(s: torch.Tensor, d: torch.Tensor) -> None:
        d.copy_(s, non_blocking=True)
        torch.cuda.synchronize()

    big, _ = time_calls(lambda: copy(src, dst), repeats)
    small, _ = time_calls(lambda: copy(small_src, small_dst), max(repeats, 20))
    return {"bytes_per_s": num_bytes / big, "latency_s": small, "device": torch.cuda.get_device_name(0),
            "copy_bytes": num_bytes}


def calibrate(*, quick: bool, num_threads: int | None = None, clock: str = "wall") -> Calibration:
    """Run every measurement (module docstring) on ``num_threads`` torch threads (default: torch's) and fit,
    timing on ``clock`` (``CLOCKS``; host-to-device copies are always timed on the wall clock)."""
    try:
        import torch
    except ImportError:
        raise UserError("calibrate measures with torch, which is not installed: pip install 'moetide[engine]'") \
            from None
    previous = torch.get_num_threads()
    threads = num_threads or previous
    check_clock(clock, threads)
    torch.set_num_threads(threads)
    try:
        llc = llc_bytes()
        repeats = 3 if quick else 7
        dram = measure_dram((4 if quick else 8) * llc, repeats, clock)
        append = measure_append(repeats, clock)
        gemm_n = 1024 if quick else 2048
        gemm = measure_gemm(gemm_n, repeats, clock)
        samples = tuple(time_attention(s, repeats, 2 * llc, clock=clock) for s in calibration_shapes(quick, threads))
        h2d = measure_host_to_device(repeats)
    finally:
        torch.set_num_threads(previous)
    return Calibration(
        measured_at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), quick=quick,
        clock=clock, torch_version=torch.__version__, num_threads=threads, logical_cpus=os.cpu_count() or threads,
        cpu_model=cpu_model_name(), dram_bytes=installed_memory_bytes(), llc_bytes=llc, dram=dram,
        append_bytes_per_s=append, gemm_n=gemm_n,
        gemm_flops_per_s=gemm, attention=samples, fit=fit_cpu_efficiency(samples, dram.triad_bytes_per_s, gemm),
        host_to_device=h2d)




def measure_engine_steps(model_dir: str, *, quick: bool, num_threads: int | None = None,
                         clock: str = "wall", seed: int = 0) -> tuple[list[StepSample], list[tuple[int, float]]]:
    """Every step of the ``ENGINE_STEP_RUNS`` batches (``ENGINE_STEP_REPEATS`` times over), each a whole
    ``Engine.step`` call (scheduling, forward, sampling, bookkeeping) timed on ``clock``, with the shape the
    step-time model takes; and every ``Engine.add_request`` call (the request's block hashes are made there) as
    (prompt tokens, seconds); after one untimed warm-up run. Prefix caching is off, so every prompt token is
    computed."""
    import torch

    from moetide.engine.runner import Engine
    from moetide.engine.sampling import SamplingParams

    previous = torch.get_num_threads()
    threads = num_threads or previous
    check_clock(clock, threads)
    torch.set_num_threads(threads)
    now = CLOCKS[clock]
    try:
        engine = Engine(model_dir, kv_cache_memory=256 * 2**20, enable_prefix_caching=False)
        vocab = engine.parts.model.config.vocab_size
        hf_config = read_json(Path(model_dir) / "config.json", f"--model {model_dir}")
        longest = (hf_config.get("max_position_embeddings") if isinstance(hf_config, dict) else None) or 1 << 30
        rng = random.Random(seed)
        samples: list[StepSample] = []
        requests: list[tuple[int, float]] = []
        runs = designed_runs(quick, longest)
        for i, (batch, prompt, output) in enumerate(runs):
            params = SamplingParams(max_tokens=output, ignore_eos=True, temperature=0.0)
            for _ in range(batch):
                tokens = [rng.randrange(3, vocab) for _ in range(prompt)]
                start = now()
                engine.add_request(tokens, params)
                if i:
                    requests.append((prompt, now() - start))
            while engine.has_unfinished_requests():
                start = now()
                engine.step()
                seconds = now() - start
                if i and engine.last_step_shape is not None:
                    samples.append(StepSample(StepShape(*engine.last_step_shape), seconds))
    finally:
        torch.set_num_threads(previous)
    return samples, requests
