"""Simulator speed: simulated requests per wall-clock second, one JSON line per workload.

    .venv/bin/python benchmarks/sim_speed.py             # generator + trace subsets (a minute or two)
    .venv/bin/python benchmarks/sim_speed.py --full      # whole traces (WEKA: 49,334 requests; target < 60 s)

Peer: vidur (the LLM inference simulator on PyPI) installs here but fetches its profiling data from a model hub at
run time, so it cannot run offline on these machines (../shared/PEERS.md); the script says so in a JSON line
rather than comparing. Wall times vary with machine load: run it alone.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import resource
import time
from pathlib import Path

from moetide.sim.setup import ReplayConfig, run_replay
from moetide.workloads import generate_agent_sessions, load_workload

TRACES = Path(__file__).resolve().parents[1].parent / "shared" / "traces"
NEXT_TP2 = dict(model="qwen3-next-80b-a3b", gpu="h200", tp=2)


def cases(full: bool):
    weka = TRACES / "weka_claude_code" / "weka_cc_traces_compact.jsonl.gz"
    conv = TRACES / "mooncake" / "conversation_trace.jsonl.gz"
    yield "generator-default", lambda: generate_agent_sessions(0), ReplayConfig()
    if conv.is_file():
        subset = {} if full else {"max_requests": 3000}
        yield ("mooncake-conversation" + ("" if full else "-3000"),
               lambda: load_workload(conv, seed=0, **subset), ReplayConfig(**NEXT_TP2))
    if weka.is_file():
        subset = {} if full else {"sessions": 60}
        # None: vLLM's block size for the model (544 for Qwen3-Next at TP=2); 64 needs prefix caching off, since in
        # mamba_cache_mode align a hybrid state fills one block
        for block_size in (None, 64):
            yield (f"weka{'' if full else '-60-sessions'}-block{block_size or 'default'}",
                   lambda: load_workload(weka, seed=0, **subset),
                   ReplayConfig(block_size=block_size, enable_prefix_caching=None if block_size is None else False,
                                **NEXT_TP2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="whole traces instead of subsets")
    parser.add_argument("--only", default="", help="run only the workloads whose name contains this")
    args = parser.parse_args()
    for name, make, config in cases(args.full):
        if args.only not in name:
            continue
        workload = make()
        start, cpu_start = time.perf_counter(), time.process_time()
        result, _ = run_replay(workload, config)
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
        m = result["metrics"]
        print(json.dumps({"benchmark": "sim_speed", "workload": name, "requests": workload.num_requests,
                          "completed": m["completed"], "failed": m["failed"], "wall_s": round(wall, 3),
                          "cpu_s": round(cpu, 3),
                          "requests_per_wall_s": round(workload.num_requests / wall, 1), "steps": m["steps"],
                          "model": config.model, "gpu": config.gpu, "tp": config.tp,
                          "block_size": result["config"]["block_size"],
                          "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024}), flush=True)
    vidur = importlib.util.find_spec("vidur") is not None
    print(json.dumps({"benchmark": "sim_speed", "peer": "vidur", "status": "not run",
                      "reason": ("installed, but it fetches profiling data from a model hub at run time (offline here)"
                                 if vidur else "not installed; it cannot run offline here (../shared/PEERS.md)")}))


if __name__ == "__main__":
    main()
