"""``moetide bench-serve TRACE --url URL``: replay a recorded trace in real time against an OpenAI-compatible
server (``moetide serve``, vLLM's ``api_server``, any other) and report what vLLM's benchmark reports.

The trace is read by moetide's readers and sliced as ``moetide replay`` slices it (``--max-requests``,
``--sessions``, ``--time-window``); prompts are token ids built so that equal block keys are equal token blocks
(``serve.bench_prompts``), scaled by ``--length-scale`` and capped by ``--max-input-tokens`` / ``--max-output-tokens``;
times are scaled by ``--time-scale``. Metrics are vLLM's definitions (``serve.bench_metrics``); ``--json PATH``
('-': stdout) writes them under vLLM's names with the per-request arrays; ``--plot PNG`` draws TTFT per request and
output tokens per second over the run. Exit status 1 if any request failed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

from moetide.errors import UserError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("trace", metavar="TRACE", help="recorded trace (Mooncake JSONL, WEKA sessions, Azure CSV; .gz ok)")
    add("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    add("--endpoint", default="/v1/completions", help="completions endpoint (default %(default)s)")
    add("--model", help="model name to send (default: the first one the server's /v1/models lists)")
    add("--format", choices=["mooncake", "weka", "azure"], help="trace format (default: sniffed)")
    add("--session-rate", type=float, help="closed-loop traces: new sessions per second (Poisson)")
    add("--max-requests", type=int, help="keep the first N requests (closed loop: whole sessions)")
    add("--time-window", metavar="START:END", help="keep START:END seconds of the trace, e.g. 0:600")
    add("--sessions", type=int, help="keep the first N sessions")
    add("--seed", type=int, default=0, help="seed of the prompts' token ids and the trace reader (default 0)")
    add("--time-scale", type=float, default=1.0, metavar="F",
        help="wall seconds per trace second: arrivals and think times are multiplied by F (default %(default)s)")
    add("--length-scale", type=float, default=1.0, metavar="F",
        help="multiply prompt, output and key-block lengths by F (default %(default)s)")
    add("--max-input-tokens", type=int, metavar="N", help="cap each prompt at N tokens (its leading blocks kept)")
    add("--max-output-tokens", type=int, metavar="N", help="cap each request's output at N tokens")
    add("--vocab-size", type=int, default=None, metavar="V",
        help="draw prompt token ids below V (default 259: ordinary tokens in any byte-level vocabulary)")
    add("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
        help="ask for exactly the trace's output lengths (vLLM's ignore_eos; default on)")
    add("--timeout-s", type=float, default=600.0, help="per-request timeout in seconds (default %(default)s)")
    add("--json", metavar="PATH", help="write the metrics and per-request arrays as JSON ('-': stdout)")
    add("--plot", metavar="PNG", help="write a PNG: TTFT per request, output tokens per second")


def parse_window(text: str | None) -> tuple[float, float] | None:
    if text is None:
        return None
    try:
        start, end = (float(part) for part in text.split(":"))
    except ValueError:
        raise UserError(f"--time-window {text}: expected START:END in seconds, e.g. 0:600") from None
    return start, end


def _load(args: argparse.Namespace):
    from moetide.serve.bench_prompts import DEFAULT_VOCAB_SIZE, PromptScale, bench_sessions
    from moetide.workloads import load_workload

    if not Path(args.trace).is_file():
        raise UserError(f"{args.trace}: no such trace file")
    for flag, value in (("--time-scale", args.time_scale), ("--timeout-s", args.timeout_s)):
        if not value > 0:
            raise UserError(f"{flag} must be > 0, got {value}")
    try:
        scale = PromptScale(args.length_scale, args.max_input_tokens, args.max_output_tokens,
                            args.vocab_size or DEFAULT_VOCAB_SIZE)
    except ValueError as exc:
        field, _, rest = str(exc).partition(" ")
        raise UserError(f"--{field.replace('_', '-')} {rest}") from None
    workload = load_workload(args.trace, args.format, seed=args.seed, session_rate_per_s=args.session_rate,
                             max_requests=args.max_requests, time_window=parse_window(args.time_window),
                             sessions=args.sessions)
    return workload, bench_sessions(workload, scale, args.seed)


def print_summary(metrics: dict, out=None) -> None:
    """vLLM's result table, the same rows and wording."""
    out = out or sys.stdout
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
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError("--plot needs matplotlib: pip install -e '.[plot]'") from None
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
    try:
        fig.savefig(path, dpi=110)
    except OSError as exc:
        raise UserError(f"--plot {path}: cannot write: {exc.strerror or exc}") from None
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    from moetide.report.progress import ProgressBar
    from moetide.serve.bench_client import Target, first_model, replay
    from moetide.serve.bench_metrics import calculate_metrics, per_request

    workload, sessions = _load(args)
    try:
        model = args.model or first_model(args.url, args.timeout_s)
    except (OSError, ValueError, KeyError, IndexError) as exc:
        raise UserError(f"--url {args.url}: cannot list its models ({exc}); is the server up?") from None
    target = Target(args.url, model, args.endpoint, args.ignore_eos, args.timeout_s)
    human = sys.stderr if args.json == "-" else sys.stdout
    print(f"bench-serve: {workload.num_requests} requests ({workload.mode} loop, {workload.num_sessions} sessions) "
          f"from {workload.name} to {args.url} as {model!r}, time x{args.time_scale:g}", file=human)
    bar = ProgressBar("bench-serve")
    results, duration = replay(sessions, workload.mode, target, args.time_scale, bar)
    bar.close()
    metrics = calculate_metrics(results, duration)
    print_summary(metrics, human)
    errors = [r.error for r in results if not r.success]
    if errors:
        print(f"{len(errors)} requests failed; first: {errors[0]}", file=human)
    per = per_request(results)
    if args.json:
        report = {"date": datetime.datetime.now().strftime("%Y%m%d-%H%M%S"), "backend": "openai", "model_id": model,
                  "trace": args.trace, "num_prompts": len(results), "time_scale": args.time_scale,
                  "length_scale": args.length_scale, **metrics, **per}
        text = json.dumps(report)
        if args.json == "-":
            print(text)
        else:
            try:
                Path(args.json).write_text(text + "\n", encoding="utf-8")
            except OSError as exc:
                raise UserError(f"--json {args.json}: cannot write: {exc.strerror or exc}") from None
    if args.plot:
        plot(args.plot, per)
    return 1 if errors else 0
