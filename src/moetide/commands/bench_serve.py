"""``moetide bench-serve TRACE --url URL``: replay a recorded trace in real time against an OpenAI-compatible
server (``moetide serve``, vLLM's ``api_server``, any other) and report what vLLM's benchmark reports.

The trace is read and sliced as ``moetide replay`` reads and slices it (the same options: ``--max-requests``,
``--sessions``, ``--time-window``, ``--format``; no TRACE: the built-in agent-session generator). Prompts are token
ids built so that equal block keys are equal token blocks (``serve.bench_prompts``), scaled by ``--length-scale``
and capped by ``--max-input-tokens`` / ``--max-output-tokens``; times are scaled by ``--time-scale`` (the same
``workloads.scale`` as replay's, so ``moetide replay`` with the same options models the same requests). Metrics are
vLLM's definitions (``serve.bench_metrics``); ``--json PATH`` ('-': stdout) writes them under vLLM's names with the
per-request arrays; ``--plot PNG`` draws TTFT per request and output tokens per second over the run. Exit status 1
if any request failed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys

from moetide.commands.options import (add_json_argument, add_plot_argument, add_workload_arguments, check_outputs,
                                      human_output, write_json_output)
from moetide.commands.replay import load as load_workload
from moetide.errors import UserError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_workload_arguments(parser)
    add = parser.add_argument
    add("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    add("--endpoint", default="/v1/completions", help="completions endpoint (default %(default)s)")
    add("--model", dest="model_name", metavar="NAME",
        help="model name to send (default: the first one the server's /v1/models lists)")
    add("--vocab-size", type=int, default=None, metavar="V",
        help="draw prompt token ids below V (default 259: ordinary tokens in any byte-level vocabulary)")
    add("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
        help="ask for exactly the trace's output lengths (vLLM's ignore_eos; default on)")
    add("--timeout-s", type=float, default=600.0, help="per-request timeout in seconds (default %(default)s)")
    add_json_argument(parser, "the metrics and per-request arrays")
    add_plot_argument(parser, "TTFT per request, output tokens per second")


def _load(args: argparse.Namespace):
    """The workload (``moetide replay``'s reader, slices and scaling) and its token prompts."""
    from moetide.serve.bench_prompts import DEFAULT_VOCAB_SIZE, FIRST_TOKEN_ID, bench_sessions

    if not args.timeout_s > 0:
        raise UserError(f"--timeout-s must be > 0, got {args.timeout_s}")
    vocab = args.vocab_size or DEFAULT_VOCAB_SIZE
    if vocab <= FIRST_TOKEN_ID:
        raise UserError(f"--vocab-size must be > {FIRST_TOKEN_ID}, got {vocab}")
    workload = load_workload(args)
    return workload, bench_sessions(workload, args.seed, vocab)


def print_summary(metrics: dict) -> None:
    """vLLM's result table, the same rows and wording."""
    out = sys.stdout
    rows = [("Successful requests:", metrics["completed"]), ("Failed requests:", metrics["failed"]),
            ("Benchmark duration (s):", f"{metrics['duration']:.2f}"),
            ("Total input tokens:", metrics["total_input_tokens"]),
            ("Total generated tokens:", metrics["total_output_tokens"]),
            ("Request throughput (req/s):", f"{metrics['request_throughput']:.2f}"),
            ("Output token throughput (tok/s):", f"{metrics['output_throughput']:.2f}"),
            ("Peak output token throughput (tok/s):", f"{metrics['max_output_tokens_per_s']:.2f}"),
            ("Peak concurrent requests:", f"{metrics['max_concurrent_requests']:.2f}"),
            ("Total token throughput (tok/s):", f"{metrics['total_token_throughput']:.2f}")]
    print("{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="), file=out)
    for label, value in rows:
        print(f"{label:<40} {value:<10}", file=out)
    titles = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
              "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}
    for key, title in titles.items():
        print("{s:{c}^{n}}".format(s=title, n=50, c="-"), file=out)
        for stat in ("mean", "median"):
            print(f"{f'{stat.capitalize()} {key.upper()} (ms):':<40} {metrics[f'{stat}_{key}_ms']:<10.2f}", file=out)
        for name in sorted((k for k in metrics if k.startswith("p") and k.endswith(f"_{key}_ms")),
                           key=lambda k: float(k[1:].split("_")[0])):
            print(f"{f'P{name[1:].split(chr(95))[0]} {key.upper()} (ms):':<40} {metrics[name]:<10.2f}", file=out)
    print("=" * 50, file=out)


def plot(path: str, per: dict) -> None:
    from moetide.report.plots import require_matplotlib, save_figure

    plt = require_matplotlib()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    ok = [i for i, e in enumerate(per["errors"]) if not e]
    left.scatter([per["start_times"][i] for i in ok], [per["ttfts"][i] * 1000 for i in ok], s=8)
    left.set(xlabel="send time (s)", ylabel="TTFT (ms)", title="Time to first token per request")
    seconds: dict[int, int] = {}
    for i in ok:
        t = per["start_times"][i] + per["ttfts"][i]
        for gap in [0.0, *per["itls"][i]]:
            t += gap
            seconds[int(t)] = seconds.get(int(t), 0) + 1
    span = range(max(seconds, default=0) + 1)
    right.bar(list(span), [seconds.get(s, 0) for s in span], width=1.0, align="edge")
    right.set(xlabel="time (s)", ylabel="tokens/s", title="Output tokens per second")
    fig.tight_layout()
    save_figure(fig, path, dpi=110)


def run(args: argparse.Namespace) -> int:
    from moetide.report.progress import ProgressBar
    from moetide.serve.bench_client import Target, first_model, replay
    from moetide.serve.bench_metrics import calculate_metrics, per_request

    check_outputs(args)
    workload, sessions = _load(args)
    try:
        model = args.model_name or first_model(args.url, args.timeout_s)
    except (OSError, ValueError, KeyError, IndexError) as exc:
        raise UserError(f"--url {args.url}: cannot list its models ({exc}); is the server up?") from None
    target = Target(args.url, model, args.endpoint, args.ignore_eos, args.timeout_s)
    with human_output(args.json):
        print(f"bench-serve: {workload.num_requests} requests ({workload.mode} loop, {workload.num_sessions} "
              f"sessions) from {workload.name} to {args.url} as {model!r}, time x{args.time_scale:g}")
        bar = ProgressBar("bench-serve")
        results, duration = replay(sessions, workload.mode, target, bar)  # times are scaled in the workload
        bar.close()
        metrics = calculate_metrics(results, duration)
        print_summary(metrics)
        errors = [r.error for r in results if not r.success]
        if errors:
            print(f"{len(errors)} requests failed; first: {errors[0]}")
    per = per_request(results)
    if args.json:
        report = {"date": datetime.datetime.now().strftime("%Y%m%d-%H%M%S"), "backend": "openai", "model_id": model,
                  "trace": workload.source, "num_prompts": len(results), "time_scale": args.time_scale,
                  "length_scale": args.length_scale, **metrics, **per}
        write_json_output(args.json, json.dumps(report))
    if args.plot:
        plot(args.plot, per)
    return 1 if errors else 0
