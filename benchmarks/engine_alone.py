"""A trace slice through the engine alone — no server, no HTTP — each step timed against the device file's model.

Requests of an open-loop slice join at their (scaled) arrival times on the wall clock, as bench-serve would send them
(a closed-loop slice is skipped, saying so), and the engine
steps whenever it has work; every step's wall time is set beside ``StepTimeModel.step_time_s`` of its shape with
the device file's ``[efficiency]``. One JSON line: decode steps (measured and modeled medians), each prefill step,
and the totals. ``serve_prediction.py`` runs it on the server's core to separate the step model's error from what
the server adds.

    taskset -c 1 .venv/bin/python benchmarks/engine_alone.py --model /tmp/moe64 --device cpu.toml \\
        --trace ../shared/traces/mooncake/conversation_trace.jsonl.gz --length-scale 0.0625 --max-input-tokens 512 \\
        --max-output-tokens 24 --time-scale 0.5
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from serve_side_by_side import add_slice_arguments

from moetide.engine.runner import Engine
from moetide.engine.sampling import SamplingParams
from moetide.perf.step import StepTimeModel
from moetide.perf.step_calibrate import step_efficiency_for_gpu
from moetide.serve.bench_prompts import bench_sessions
from moetide.specs import get_gpu, get_model
from moetide.workloads import load_workload
from moetide.workloads.scale import WorkloadScale, scale_workload


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--device", required=True)
    add_slice_arguments(parser)
    parser.add_argument("--kv-cache-memory-mib", type=float, default=1024)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    workload = scale_workload(load_workload(Path(args.trace), None, seed=args.seed, max_requests=args.max_requests),
                              WorkloadScale(args.length_scale, args.max_input_tokens, args.max_output_tokens,
                                            args.time_scale))
    if workload.mode != "open":  # a closed loop's sends wait on completions: bench-serve's client has that logic
        print(json.dumps({"skipped": f"{workload.name} is a closed-loop workload; engine_alone replays open-loop "
                                     f"arrivals only"}))
        return 0
    turns = sorted((t for s in bench_sessions(workload, seed=args.seed + 1) for t in s.turns),
                   key=lambda t: t.arrival_s)
    engine = Engine(args.model, kv_cache_memory=int(args.kv_cache_memory_mib * 2**20), block_size=args.block_size,
                    max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs)
    model = StepTimeModel(get_model(args.model), get_gpu(args.device), dtype_bytes=4, kv_dtype_bytes=4,
                          efficiency=step_efficiency_for_gpu(args.device))
    steps = []
    start, sent = time.perf_counter(), 0
    while sent < len(turns) or engine.has_unfinished_requests():
        now = time.perf_counter() - start
        while sent < len(turns) and turns[sent].arrival_s <= now:
            turn = turns[sent]
            engine.add_request(turn.prompt_token_ids, SamplingParams(max_tokens=turn.output_tokens, ignore_eos=True))
            sent += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, turns[sent].arrival_s - now))
            continue
        t0 = time.perf_counter()
        engine.step()
        seconds = time.perf_counter() - t0
        shape = engine.last_step_shape
        steps.append((shape, seconds, model.step_time_s(*shape)))
    decode = [s for s in steps if s[0][0] == s[0][1]]
    print(json.dumps({
        "decode_steps": len(decode),
        "decode_measured_ms": 1e3 * statistics.median(s[1] for s in decode) if decode else None,
        "decode_model_ms": 1e3 * statistics.median(s[2] for s in decode) if decode else None,
        "prefill_steps": [{"shape": list(shape), "measured_ms": 1e3 * t, "model_ms": 1e3 * m}
                          for shape, t, m in steps if shape[0] != shape[1]],
        "total_measured_s": sum(s[1] for s in steps), "total_model_s": sum(s[2] for s in steps)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
