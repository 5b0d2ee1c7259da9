"""``moetide bench-serve TRACE --url URL``: replay a recorded trace in real time against an OpenAI-compatible
server (``moetide serve``, vLLM's ``api_server``, any other) and report what vLLM's benchmark reports.

The trace is read and sliced as ``moetide replay`` reads and slices it (the same options: ``--max-requests``,
``--sessions``, ``--time-window``, ``--format``; no TRACE: the built-in agent-session generator). Prompts are token
ids built so that equal block keys are equal token blocks (``serve.bench_prompts``), scaled by ``--length-scale``
and capped by ``--max-input-tokens`` / ``--max-output-tokens``; times are scaled by ``--time-scale`` (the same
``workloads.scale`` as replay's, so ``moetide replay`` with the same options models the same requests). Metrics are
vLLM's definitions (``serve.bench_metrics``); ``--json PATH`` ('-': stdout) writes them under vLLM's names with the
per-request arrays; ``--plot PNG`` draws TTFT per request and output tokens per second over the run. Exit status 1
if any request failed, 130 if interrupted.

Before sending, it asks the server's ``/v1/models`` for its ``max_model_len`` and says how many requests exceed it
and what it does with them (``--too-long``: skip them, the default; truncate their prompts; fail before sending;
or send them anyway), how many requests and sessions it sends (a closed-loop slice keeps whole sessions, so
``--max-requests`` can send more), and how long the trace's own timing makes the run at least. While it runs, a
status line on stderr (every second on a terminal, every 30 s otherwise) counts requests done, failed and in
flight. Ctrl-C stops the sending and reports what finished.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import sys
import threading
import time

from moetide.commands.options import (add_json_argument, add_plot_argument, add_workload_arguments, check_outputs,
                                      human_output, write_json_output)
from moetide.commands.replay import load as load_workload
from moetide.errors import UserError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_workload_arguments(parser)
    add = parser.add_argument
    add("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    add("--endpoint", default="/v1/completions",
        help="completions endpoint (default %(default)s); one ending in /chat/completions gets chat bodies")
    add("--too-long", choices=("skip", "truncate", "fail", "send"), default="skip",
        help="requests whose prompt and output exceed the server's max_model_len: skip them (default), truncate "
             "their prompts to fit, fail before sending, or send them anyway (to measure the server's refusals)")
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


class StatusLine:
    """Requests done, failed and in flight and the time elapsed, on stderr: redrawn every second on a terminal, a
    line every 30 s otherwise, from a thread of its own (a closed-loop session can think for minutes)."""

    def __init__(self, stream=None) -> None:
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.interval_s = 1.0 if self.tty else 30.0
        self.state = None
        self._stop = threading.Event()
        self._start = time.monotonic()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __call__(self, state) -> None:
        self.state = state

    def start(self, state) -> None:
        self.state = state
        self._thread.start()

    def _line(self) -> str:
        s, elapsed = self.state, time.monotonic() - self._start
        return (f"bench-serve: {s.done:,}/{s.total:,} done, {s.failed:,} failed, {s.in_flight:,} in flight, "
                f"{elapsed:,.0f} s")

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.stream.write(("\r" + self._line()) if self.tty else self._line() + "\n")
            self.stream.flush()

    def close(self) -> None:
        self._stop.set()
        if self.tty and self._thread.is_alive():
            self.stream.write("\r" + self._line() + "\n")
            self.stream.flush()


def _fit_to_server(sessions, max_model_len: int | None, action: str) -> tuple[list, int]:
    """The sessions with their too-long turns skipped or truncated (``--too-long``), and how many there were."""
    from moetide.serve.bench_prompts import BenchSession, fit_turn

    if max_model_len is None:
        return sessions, 0
    kept, num_long = [], 0
    for session in sessions:
        turns = []
        for turn in session.turns:
            cut = fit_turn(turn, max_model_len)
            if cut is None:
                turns.append(turn)
                continue
            num_long += 1
            if action != "skip":
                turns.append(cut if action == "truncate" else turn)
        if turns:
            kept.append(BenchSession(session.session_id, session.start_s, tuple(turns)))
    if num_long and action == "fail":
        raise UserError(f"{num_long} requests need more than the server's max_model_len of {max_model_len:,} tokens "
                        f"(prompt + output); --too-long skip or truncate sends the rest, --length-scale or "
                        f"--max-input-tokens shortens them")
    return kept, num_long


def _timing_floor_s(sessions, mode: str) -> float:
    """How long the trace's own timing makes the replay at least: the last arrival (open loop), or the longest
    session's start plus its think times (closed loop), before any server time."""
    if mode == "open":
        return max((t.arrival_s or 0.0 for s in sessions for t in s.turns), default=0.0)
    return max((s.start_s + sum(t.think_time_s for t in s.turns[1:]) for s in sessions), default=0.0)


def _preflight(args: argparse.Namespace, workload, sessions, info, model: str) -> list:
    from moetide.report.units import duration_text

    num_asked = sum(len(s.turns) for s in sessions)
    sessions, num_long = _fit_to_server(sessions, info.max_model_len, args.too_long)
    num_sent = sum(len(s.turns) for s in sessions)
    if args.max_requests is not None and num_asked > args.max_requests:
        print(f"bench-serve: --max-requests {args.max_requests} keeps whole sessions in a closed loop: "
              f"{num_asked} requests in {workload.num_sessions} session{'' if workload.num_sessions == 1 else 's'}")
    if num_long:
        did = {"skip": "skipped", "truncate": "truncated to fit", "send": "sent anyway"}[args.too_long]
        print(f"bench-serve: {num_long} of {num_asked} requests need more than the server's max_model_len of "
              f"{info.max_model_len:,} tokens (prompt + output): {did} (--too-long)")
    if not num_sent:
        raise UserError(f"no request fits the server's max_model_len of {info.max_model_len:,} tokens; "
                        f"--too-long truncate, --length-scale or --max-input-tokens makes them fit")
    floor = _timing_floor_s(sessions, workload.mode)
    plural = "" if len(sessions) == 1 else "s"
    print(f"bench-serve: {num_sent} requests ({workload.mode} loop, {len(sessions)} session{plural}) from "
          f"{workload.name} to {args.url} as {model!r}, time x{args.time_scale:g}; the trace's timing alone takes "
          f"{duration_text(floor)} (--time-scale shortens it), the server's time comes on top")
    return sessions


def _failure_lines(results) -> list[str]:
    """Failed requests grouped by reason, most common first."""
    reasons = collections.Counter(r.error.strip()[:200] for r in results if not r.success)
    return [f"  {count:>6} x {reason}" for reason, count in reasons.most_common()]


def _server_info(url: str, timeout_s: float):
    """What the server says of itself (its model, its max_model_len), or one error naming what went wrong."""
    from moetide.serve.bench_client import server_info

    try:
        return server_info(url, min(timeout_s, 30.0))
    except ConnectionRefusedError:
        raise UserError(f"--url {url}: connection refused; is the server up, and on that port?") from None
    except (OSError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise UserError(f"--url {url}: cannot list its models at {url}/v1/models ({exc})") from None


def run(args: argparse.Namespace) -> int:
    from moetide.serve.bench_client import INTERRUPTED, Progress, Target, normalize_url, replay
    from moetide.serve.bench_metrics import calculate_metrics, per_request

    check_outputs(args)
    url, warnings = normalize_url(args.url)
    for warning in warnings:
        print(f"bench-serve: {warning}", file=sys.stderr)
    if not args.endpoint.startswith("/"):
        raise UserError(f"--endpoint {args.endpoint}: a path on the server, e.g. /v1/completions")
    args.url = url
    workload, sessions = _load(args)
    info = _server_info(url, args.timeout_s)
    model = args.model_name or info.model
    target = Target(url, model, args.endpoint, args.ignore_eos, args.timeout_s)
    with human_output(args.json):
        sessions = _preflight(args, workload, sessions, info, model)
        if target.chat:
            print("bench-serve: chat endpoint: each prompt goes as one user message of one word per token; the "
                  "server's tokenizer and chat template decide its length")
        status = StatusLine()
        status.start(Progress(sum(len(s.turns) for s in sessions)))
        try:
            results, duration, interrupted = replay(sessions, workload.mode, target, status)
        finally:
            status.close()
        finished = [r for r in results if r.success or r.error != INTERRUPTED]
        if interrupted:
            print(f"bench-serve: interrupted after {duration:.1f} s: {len(finished)} of {len(results)} requests "
                  f"finished; the figures are theirs")
        metrics = calculate_metrics(finished, duration)
        print_summary(metrics)
        failures = _failure_lines(finished)
        if failures:
            print("Failed requests by reason:")
            print("\n".join(failures))
    per = per_request(finished)
    if args.json:
        report = {"date": datetime.datetime.now().strftime("%Y%m%d-%H%M%S"), "backend": "openai", "model_id": model,
                  "trace": workload.source, "num_prompts": len(results), "time_scale": args.time_scale,
                  "length_scale": args.length_scale, "interrupted": interrupted, **metrics, **per}
        write_json_output(args.json, json.dumps(report))
    if args.plot:
        plot(args.plot, per)
    if interrupted:
        return 130
    return 1 if failures else 0
