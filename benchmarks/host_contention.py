"""How much a second user on the host slows CPU attention: the measurement behind the two-user case of the
WriteScope paper (its static split 1,010 ms, with online feedback 436 ms).

MEASURED on the machine that runs it. The cost model's two-user case (``writescope_paper.py --contention``) takes
the slowdown of the CPU side as an input (``--cpu-slowdown``, 2 by default: a fair share of the cores); this
script measures it. One process ("the user") runs the engine's CPU attention kernel for bf16 KV
(``measure.flash_kernel``, what the split backend calls) on a shape of Qwen3-30B-A3B's attention (32 query heads,
4 KV heads of 128, 32K tokens, KV far larger than the last-level cache) and times each call on the wall clock,
alone and while a competitor runs:

- ``same``: a second process running the same kernel (a second server or user, configured the same way);
- ``stream``: a process copying a buffer far larger than the cache (a DRAM-bound neighbour).

Each in two placements: ``shared`` (both processes on every core with torch's thread count at the core count, as
two servers started with their defaults would run; the cores are oversubscribed) and ``partitioned`` (each pinned
to its own half of the cores, one thread per core: only the last-level cache and DRAM are shared). One JSON line per
(placement, competitor, round) and a summary line per (placement, competitor): the median call time alone and
contended, measured back to back within a round, and the slowdown = contended / alone (median over rounds, with
[min, max]). Feed the ``shared``/``same`` slowdown to ``writescope_paper.py --contention --cpu-slowdown X``.

    .venv/bin/python benchmarks/host_contention.py                 # 3 rounds, ~2 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

SHAPE = {"num_seqs": 2, "num_kv_heads": 4, "group": 8, "kv_tokens": 32768, "head_dim": 128}
STREAM_BYTES = 512 * 2**20


def attention_call(threads: int):
    """The kernel on SHAPE in bf16 and a closure that runs it once."""
    import torch

    from moetide.engine.measure import flash_kernel

    torch.set_num_threads(threads)
    op = flash_kernel()
    gen = torch.Generator().manual_seed(0)
    b, h, g, n, d = (SHAPE[k] for k in ("num_seqs", "num_kv_heads", "group", "kv_tokens", "head_dim"))
    q, k, v = ((torch.rand(*s, generator=gen) * 2 - 1).to(torch.bfloat16)
               for s in ((b, h, g, d), (b, h, n, d), (b, h, n, d)))
    return lambda: op(q, k, v, scale=d**-0.5)


def stream_call(threads: int):
    import torch

    torch.set_num_threads(threads)
    src = torch.ones(STREAM_BYTES // 4)
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


def worker(kind: str, threads: int, calls: int) -> None:
    """Run as a child: ``calls`` timed calls after two warm-ups (``time_calls`` makes the second), printed as
    one JSON line; ``calls`` 0 loops until killed (a competitor), after printing ``ready`` once warm."""
    from moetide.engine.measure import time_calls

    call = attention_call(threads) if kind == "same" or kind == "user" else stream_call(threads)
    call()
    if calls == 0:
        call()
        print("ready", flush=True)
        while True:
            call()
    median, least = time_calls(call, calls)
    print(json.dumps({"median_s": median, "min_s": least}), flush=True)


def spawn(kind: str, threads: int, calls: int, cpus: list[int]) -> subprocess.Popen:
    cmd = [sys.executable, __file__, "--worker", kind, "--threads", str(threads), "--calls", str(calls),
           "--cpus", ",".join(map(str, cpus))]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)


def measure_user(threads: int, calls: int, cpus: list[int]) -> dict:
    proc = spawn("user", threads, calls, cpus)
    out, _ = proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"the measured worker exited with {proc.returncode}")
    return json.loads(out.strip().splitlines()[-1])


def measure_contended(kind: str, threads: int, calls: int, user_cpus: list[int], other_cpus: list[int]) -> dict:
    other = spawn(kind, threads, 0, other_cpus)
    try:
        if other.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the {kind} competitor did not start (exit {other.poll()})")
        return measure_user(threads, calls, user_cpus)
    finally:
        other.kill()
        other.wait()


def placements(cpus: list[int]) -> dict[str, tuple[int, list[int], list[int]]]:
    """placement -> (threads per process, the user's cores, the competitor's cores)"""
    half = len(cpus) // 2
    out = {"shared": (len(cpus), cpus, cpus)}
    if half:
        out["partitioned"] = (half, cpus[:half], cpus[half:2 * half])
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=12, help="timed kernel calls per measurement")
    parser.add_argument("--worker", choices=("user", "same", "stream"), help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--cpus", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        os.sched_setaffinity(0, [int(c) for c in args.cpus.split(",")])
        worker(args.worker, args.threads, args.calls)
        return 0
    if args.rounds < 1 or args.calls < 1:
        parser.error("--rounds and --calls must be at least 1")
    cpus = sorted(os.sched_getaffinity(0))
    print(json.dumps({"benchmark": "host_contention", "measured": True, "cpus": cpus, "shape": SHAPE,
                      "kv_bytes_per_call": 2 * SHAPE["num_seqs"] * SHAPE["num_kv_heads"] * SHAPE["kv_tokens"]
                      * SHAPE["head_dim"] * 2, "stream_bytes": STREAM_BYTES, "loadavg": os.getloadavg()}),
          flush=True)
    slowdowns: dict[tuple[str, str], list[float]] = {}
    for r in range(args.rounds):
        for placement, (threads, mine, theirs) in placements(cpus).items():
            for kind in ("same", "stream"):
                alone = measure_user(threads, args.calls, mine)
                contended = measure_contended(kind, threads, args.calls, mine, theirs)
                s = contended["median_s"] / alone["median_s"]
                slowdowns.setdefault((placement, kind), []).append(s)
                print(json.dumps({"round": r, "placement": placement, "competitor": kind, "threads": threads,
                                  "alone_ms": round(alone["median_s"] * 1e3, 2),
                                  "contended_ms": round(contended["median_s"] * 1e3, 2),
                                  "slowdown": round(s, 3)}), flush=True)
    for (placement, kind), values in slowdowns.items():
        print(json.dumps({"summary": True, "placement": placement, "competitor": kind,
                          "slowdown": round(statistics.median(values), 3), "slowdown_min": round(min(values), 3),
                          "slowdown_max": round(max(values), 3), "rounds": len(values)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
