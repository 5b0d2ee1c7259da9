"""What a monolithic cache's append costs in host memory: the measurement behind the ``host_append`` factor of
the cost model (``OffloadEfficiency.host_append``; the WriteScope paper's layout ablation, a transformers
``DynamicCache``).

MEASURED on the machine that runs it. A ``DynamicCache`` appends a decode token by concatenation: every step
allocates a new tensor for the layer's whole K and V, faults it in page by page, and copies the old cache into it.
The cost model charges that rewrite as 2 x bytes / (sustained DRAM bandwidth x ``host_append``); ``host_append`` =
1 is a streaming copy into memory already mapped. This script times, on one torch thread and a Qwen3-30B-A3B
layer's KV shape (4 KV heads of 128, bf16, 2 sequences), for each context:

- ``dynamic_cache``: ``DynamicCache.update`` with one new token (read + write bytes of the old K and V per second);
- ``copy_into_mapped``: the same concatenation into a preallocated tensor (the copy alone);
- ``triad``: ``measure_dram``'s triad, the sustained bandwidth a host file's ``dram_bandwidth`` stands for;

and prints ``host_append`` = dynamic_cache / triad, one JSON line per context, the median of ``--repeats`` calls.

    .venv/bin/python benchmarks/host_append.py                 # about 30 s
"""

from __future__ import annotations

import argparse
import json
import os

KV_HEADS, HEAD_DIM, SEQS = 4, 128, 2


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="8192,32768", help="comma-separated token counts")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    try:
        contexts = [int(c) for c in args.contexts.split(",")]
    except ValueError:
        parser.error(f"--contexts must be comma-separated integers, got {args.contexts!r}")
    if args.repeats < 1 or min(contexts) < 1:
        parser.error("--repeats and every context must be at least 1")
    import torch
    from transformers import DynamicCache

    from moetide.engine.measure import measure_dram, time_calls

    torch.set_num_threads(1)
    triad = measure_dram(256 * 2**20, 5).triad_bytes_per_s
    print(json.dumps({"benchmark": "host_append", "measured": True, "threads": 1, "triad_gb_s": round(triad / 1e9, 2),
                      "loadavg": os.getloadavg()}), flush=True)
    gen = torch.Generator().manual_seed(0)
    for n in contexts:
        k, v = (torch.rand(SEQS, KV_HEADS, n, HEAD_DIM, generator=gen).to(torch.bfloat16) for _ in range(2))
        new = torch.rand(SEQS, KV_HEADS, 1, HEAD_DIM, generator=gen).to(torch.bfloat16)
        moved = 2 * (k.numel() + v.numel()) * k.element_size()  # the old K and V, read and written
        cache = DynamicCache()
        cache.update(k, v, 0)
        dynamic, _ = time_calls(lambda: cache.update(new, new, 0), args.repeats)
        out_k, out_v = (torch.empty(SEQS, KV_HEADS, n + 1, HEAD_DIM, dtype=torch.bfloat16) for _ in range(2))
        mapped, _ = time_calls(lambda: (torch.cat([k, new], dim=-2, out=out_k), torch.cat([v, new], dim=-2, out=out_v)),
                               args.repeats)
        print(json.dumps({"context": n, "kv_mib": round(moved / 2 / 2**20, 1),
                          "dynamic_cache_ms": round(dynamic * 1e3, 2),
                          "dynamic_cache_gb_s": round(moved / dynamic / 1e9, 2),
                          "copy_into_mapped_gb_s": round(moved / mapped / 1e9, 2),
                          "host_append": round(moved / dynamic / triad, 3)}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
