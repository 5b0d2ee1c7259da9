"""Whether the expert pager's staging copy overlaps the forward's compute on CUDA, with torch alone.

The pager copies a routed offloaded expert from its pinned host copy into a staging row (``vllm.staging``). On a GPU
the copy can run beside the compute of other layers when it is on its own stream; this measures it. Three timed
phases, each ``--repeat`` times, alternating, with CUDA events:

* ``compute``: ``--matmuls`` bf16 matmuls shaped like one MoE layer's experts at ``--tokens`` tokens;
* ``copy``: ``--experts`` experts' rows of ``--expert-mib`` MiB each from pinned host memory into device rows;
* ``both``: the copy on a side stream while the compute runs on the main one.

One JSON line: the medians and ``overlap = (compute + copy - both) / min(compute, copy)`` (1: the shorter one fully
hidden; 0: none), and the copy's bandwidth. Without a GPU, ``--dry-run`` (and the default there) runs the same
phases on the CPU at a tiny size, to check the script, and says so: its numbers mean nothing.

    python3 benchmarks/gpu_staging_overlap.py            # on a lent GPU (benchmarks/gpu_checks.sh runs it)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=256, help="tokens of the compute's matmuls (default 256)")
    parser.add_argument("--hidden", type=int, default=2048, help="hidden size (default 2048, Qwen3-30B-A3B)")
    parser.add_argument("--matmuls", type=int, default=96, help="matmuls per compute phase (default 96)")
    parser.add_argument("--experts", type=int, default=16, help="experts per copy phase (default 16)")
    parser.add_argument("--expert-mib", type=float, default=9.0, help="MiB per expert (default 9, bf16 Qwen3-30B)")
    parser.add_argument("--repeat", type=int, default=20, help="timed repetitions (default 20)")
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU: checks the script only")
    return parser.parse_args()


class Phases:
    """The three phases' tensors and their timed runs on one device."""

    def __init__(self, args: argparse.Namespace, device: str) -> None:
        self.device = device
        dtype = torch.bfloat16
        self.x = torch.randn(args.tokens, args.hidden, dtype=dtype, device=device)
        self.w = torch.randn(args.hidden, args.hidden, dtype=dtype, device=device)
        self.matmuls = args.matmuls
        words = int(args.expert_mib * (1 << 20)) // 2
        self.host = torch.randn(args.experts, words, dtype=dtype).pin_memory() if device == "cuda" else \
            torch.randn(args.experts, words, dtype=dtype)
        self.rows = torch.empty_like(self.host, device=device)
        self.side = torch.cuda.Stream() if device == "cuda" else None

    def compute(self) -> None:
        y = self.x
        for _ in range(self.matmuls):
            y = torch.matmul(y, self.w)

    def copy(self) -> None:
        self.rows.copy_(self.host, non_blocking=True)

    def both(self) -> None:
        if self.side is None:
            self.copy()
            self.compute()
            return
        self.side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.side):
            self.copy()
        self.compute()
        torch.cuda.current_stream().wait_stream(self.side)

    def timed(self, phase) -> float:
        if self.device != "cuda":
            start = time.perf_counter()
            phase()
            return time.perf_counter() - start
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        begin.record()
        phase()
        end.record()
        torch.cuda.synchronize()
        return begin.elapsed_time(end) / 1e3


def main() -> int:
    args = parse_args()
    device = "cuda" if torch.cuda.is_available() and not args.dry_run else "cpu"
    if device == "cpu":
        args.tokens, args.hidden, args.matmuls, args.experts, args.expert_mib, args.repeat = 8, 64, 4, 2, 0.01, 3
    phases = Phases(args, device)
    for phase in (phases.compute, phases.copy, phases.both):
        phases.timed(phase)  # warm-up
    runs = {"compute": phases.compute, "copy": phases.copy, "both": phases.both}
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.repeat):
        for name, phase in runs.items():
            times[name].append(phases.timed(phase))
    med = {name: statistics.median(values) for name, values in times.items()}
    overlap = (med["compute"] + med["copy"] - med["both"]) / max(min(med["compute"], med["copy"]), 1e-12)
    copied = phases.host.numel() * phases.host.element_size()
    print(json.dumps({"benchmark": "gpu_staging_overlap", "device": torch.cuda.get_device_name(0) if device == "cuda"
                      else "cpu (dry run: numbers mean nothing)", "compute_s": med["compute"], "copy_s": med["copy"],
                      "both_s": med["both"], "overlap": round(overlap, 3), "copy_gb_s": copied / med["copy"] / 1e9,
                      "copied_bytes": copied, "repeat": args.repeat}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
