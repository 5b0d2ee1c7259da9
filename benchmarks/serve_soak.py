"""A bounded soak of ``moetide serve`` on the loopback address: many clients for a fixed time, a share of them
rude, then a check that nothing leaked.

    .venv/bin/python benchmarks/serve_soak.py [--duration-s 600] [--clients 8] [--policies vllm,vamp] [--seed 0]
    .venv/bin/python benchmarks/serve_soak.py --engine vllm --policies vamp [--line-cycle-steps 40]

For each policy it makes (or takes, ``--model DIR``) a ``make-test-model`` qwen3_moe checkpoint, starts
``moetide serve`` on 127.0.0.1 with an API key and a KV cache of 256 KiB (16 blocks: one ``--max-model-len`` 256
sequence, so concurrent requests evict prefixes and preempt), and runs ``--clients`` threads until
``--duration-s`` has passed. Each request is drawn (seeded) from a mix: plain and streamed completions and chats
whose prompts share a few system prefixes; streams the client closes after two chunks (disconnects); streams read
slowly; malformed JSON (400), bodies past ``--max-request-bytes`` (413) and a wrong key (401). Then it stops
sending, waits for the server to drain, and reads ``/metrics``: requests still running or waiting (stuck), KV
blocks still held (leaked), whether the pool's invariants hold, and the server's RSS at the start and the end; and
it counts tracebacks in the server's log. One JSON line per policy; exit 1 if anything leaked, stuck, failed
unexpectedly or logged a traceback. It sends traffic to 127.0.0.1 only, stops by itself, and stops its server.
Measured on this machine's CPU, not modeled.

``--engine vllm``: ``moetide serve --engine vllm`` (vLLM 0.32's server with moetide's plugin) on a qwen3_moe
checkpoint vLLM's CPU attention runs (head size 64, bf16, experts of 1.5 MiB), 1 MiB of KV cache (``--kv-cache-memory``)
and an offload cap of 0.5; under ``static-offload`` with ``--line-cycle-steps``, so the line moves both ways
throughout, and under vamp's policies with a short review interval (``--vamp-horizon-s``, on the plugin's modeled
clock). vLLM has no
body limit: an oversized prompt is refused as longer than ``--max-model-len`` (400). The server's processes (API
server, engine core, worker) are sampled every 10 s: their RSS, and the line's series on ``/metrics``. After the
load it sends one small request at a time until the line has given every block back (``kv_blocks_granted`` 0), or
60 s pass. Leaks: requests running or waiting, KV cache usage above 0, ``moetide:unstaged_total`` above 0.
"""

from __future__ import annotations

import argparse
import collections
import http.client
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HOST = "127.0.0.1"  # the only address this script sends to
KEY = "soak-key-5e1d"
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
MAX_MODEL_LEN = 256
BODY_LIMIT = 64 * 1024
# kind -> weight: what a client sends
EXPECTED = {"moetide": {"malformed": 400, "oversized": 413, "wrong_key": 401},
            "vllm": {"malformed": 400, "oversized": 400, "wrong_key": 401}}  # status per refused kind, per engine
MIX = {"complete": 25, "complete_stream": 20, "chat": 10, "chat_stream": 10, "disconnect": 12, "slow_reader": 6,
       "malformed": 6, "oversized": 4, "wrong_key": 7}
WORDS = ("cache block prefix expert token layer batch queue stream route model step page host device line "
         "split split evict stage share load").split()
SYSTEMS = [" ".join(random.Random(i).choice(WORDS) for _ in range(12)) for i in range(4)]
CLI = [sys.executable, "-c", "import sys; from moetide.cli import main; sys.exit(main())"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def metrics(port: int) -> dict[str, float]:
    connection = http.client.HTTPConnection(HOST, port, timeout=30)
    try:
        connection.request("GET", "/metrics")
        text = connection.getresponse().read().decode()
    finally:
        connection.close()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name if "finished_reason" in name else name.split("{")[0]] = float(value)  # one series a name else
    return out


class Client(threading.Thread):
    """Sends requests drawn from ``MIX`` until ``deadline``; counts outcomes."""

    def __init__(self, index: int, port: int, seed: int, deadline: float, counts: collections.Counter,
                 lock: threading.Lock, examples: dict[str, str], engine: str = "moetide") -> None:
        super().__init__(daemon=True)
        self.expected = EXPECTED[engine]
        self.rng, self.port, self.deadline = random.Random(f"{seed}/{index}"), port, deadline
        self.counts, self.lock, self.examples = counts, lock, examples
        self.kinds, self.weights = list(MIX), list(MIX.values())

    def run(self) -> None:
        while time.monotonic() < self.deadline:
            kind = self.rng.choices(self.kinds, self.weights)[0]
            try:
                outcome = self.send(kind)
            except (OSError, http.client.HTTPException) as exc:
                outcome = f"unexpected: {kind}: {type(exc).__name__}: {exc}"
            with self.lock:
                if outcome.startswith("unexpected"):  # counted by kind and status; the first words kept as a sample
                    self.examples.setdefault(outcome[:60], outcome[:300])
                    outcome = outcome[:60]
                self.counts[outcome] += 1

    def prompt(self) -> str:
        words = " ".join(self.rng.choice(WORDS) for _ in range(self.rng.randint(2, 30)))
        return f"{self.rng.choice(SYSTEMS)} {words}"

    def send(self, kind: str) -> str:
        chat = kind.startswith("chat")
        stream = kind.endswith("_stream") or kind in ("disconnect", "slow_reader")
        body: dict = {"model": "soak", "max_tokens": self.rng.randint(2, 32), "temperature": 0, "stream": stream}
        if chat:
            body["messages"] = [{"role": "user", "content": self.prompt()}]
        else:
            body["prompt"] = self.prompt()
        data = json.dumps(body).encode()
        key = KEY
        if kind == "malformed":
            data = data[: len(data) // 2]
        elif kind == "oversized":
            data = json.dumps({**body, "prompt": "x " * BODY_LIMIT}).encode()
        elif kind == "wrong_key":
            key = "not-" + KEY
        connection = http.client.HTTPConnection(HOST, self.port, timeout=120)
        try:
            connection.request("POST", "/v1/chat/completions" if chat else "/v1/completions", data,
                               {"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
            response = connection.getresponse()
            expected = self.expected.get(kind)
            if expected is not None:
                response.read()
                return f"refused as expected ({expected})" if response.status == expected else (
                    f"unexpected: {kind}: HTTP {response.status}")
            if response.status != 200:
                return f"unexpected: {kind}: HTTP {response.status}: {response.read()[:160].decode(errors='replace')}"
            if not stream:
                doc = json.loads(response.read())
                return "completed" if doc["choices"][0]["finish_reason"] in ("length", "stop") else (
                    f"unexpected: {kind}: finish {doc['choices'][0]['finish_reason']}")
            chunks = 0
            for line in response:
                if not line.startswith(b"data: "):
                    continue
                if line.strip() == b"data: [DONE]":
                    return "completed (slow reader)" if kind == "slow_reader" else "completed"
                if b'"error"' in line:
                    return f"unexpected: {kind}: {line[:160].decode(errors='replace')}"
                chunks += 1
                if kind == "disconnect" and chunks == 2:
                    return "disconnected mid-stream"
                if kind == "slow_reader":
                    time.sleep(0.05)
            return "completed" if kind != "disconnect" else "completed before the disconnect"
        finally:
            connection.close()


def server_command(engine: str, model: Path, policy: str, port: int, args: argparse.Namespace) -> list[str]:
    common = [*CLI, "serve", "--model", str(model), "--host", HOST, "--port", str(port), "--served-model-name", "soak",
              "--max-model-len", str(MAX_MODEL_LEN), "--policy", policy, "--api-key", KEY,
              "--chat-template", CHAT_TEMPLATE, "--uvicorn-log-level", "warning"]
    if engine == "vllm":
        line = (["--line-cycle-steps", str(args.line_cycle_steps)] if policy == "static-offload" else
                ["--vamp-horizon-s", str(args.vamp_horizon_s)])
        return [*common, "--engine", "vllm", "--kv-cache-memory", args.kv_cache_memory, "--max-offload-ratio", "0.5",
                *line,
                "--dtype", "bfloat16", "--max-num-seqs", "16"]
    return [*common, "--threads", "1", "--kv-cache-memory", "256KiB", "--max-request-bytes", str(BODY_LIMIT)]


def start_server(command: list[str], port: int, log, timeout_s: float = 120) -> subprocess.Popen:
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode} before it was up")
        try:
            connection = http.client.HTTPConnection(HOST, port, timeout=2)
            connection.request("GET", "/health")
            if connection.getresponse().status == 200:
                return process
        except OSError:
            time.sleep(0.2)
    process.kill()
    raise RuntimeError(f"the server was not up after {timeout_s:.0f} s")


def stop_server(process: subprocess.Popen, timeout_s: float) -> None:
    """SIGTERM (the server drains), then a kill past ``timeout_s``."""
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def soak(model: Path, policy: str, args: argparse.Namespace, workdir: Path) -> dict:
    port = free_port()
    log_path = workdir / f"serve-{policy}.log"
    with log_path.open("wb") as log:
        process = start_server(server_command("moetide", model, policy, port, args), port, log)
        try:
            warm: collections.Counter = collections.Counter()
            Client(-1, port, args.seed, time.monotonic() + 1.0, warm, threading.Lock(), {}).run()  # pages touched
            rss_start = rss_mib(process.pid)
            counts, examples, ran_s = run_clients(port, args, "moetide")
            drain_deadline = time.monotonic() + 30
            while True:
                m = metrics(port)
                stuck = m.get("vllm:num_requests_running", 0) + m.get("vllm:num_requests_waiting", 0)
                if stuck == 0 or time.monotonic() > drain_deadline:
                    break
                time.sleep(0.2)
            rss_end = rss_mib(process.pid)
        finally:
            stop_server(process, 60)
    text = log_path.read_text(errors="replace")
    unexpected = {k: v for k, v in counts.items() if k.startswith("unexpected")}
    finished = {k.split('finished_reason="')[1].split('"')[0]: v for k, v in m.items()
                if k.startswith("vllm:request_success_total{")}
    return {"benchmark": "serve_soak", "policy": policy, "measured": True, "duration_s": round(ran_s, 1),
            "clients": args.clients, "requests": sum(counts.values()), "outcomes": dict(sorted(counts.items())),
            "disconnects": counts["disconnected mid-stream"], "unexpected": sum(unexpected.values()),
            "unexpected_examples": list(examples.values())[:5],
            "server_finished": finished, "preemptions": m.get("vllm:num_preemptions_total", 0),
            "experts_offloaded_at_end": m.get("moetide_experts_offloaded", 0),
            "stuck": int(stuck), "leaked_blocks": int(m.get("moetide_kv_blocks_held", -1)),
            "invariants_ok": m.get("moetide_pool_invariants_ok") == 1.0,
            "rss_start_mib": round(rss_start, 1), "rss_end_mib": round(rss_end, 1),
            "tracebacks": text.count("Traceback"), "server_exit": process.returncode, "log": str(log_path)}


def tree_rss_mib(pid: int) -> float:
    """RSS of ``pid`` and its descendants (vLLM's API server, engine core and worker), MiB."""
    children: dict[int, list[int]] = collections.defaultdict(list)
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children[ppid].append(int(entry.name))
    total, todo = 0.0, [pid]
    while todo:
        current = todo.pop()
        try:
            total += rss_mib(current)
        except OSError:
            continue
        todo += children[current]
    return total


class Sampler(threading.Thread):
    """Every ``period_s``: the server's processes' RSS and the line's series on ``/metrics``."""

    SERIES = ("moetide:kv_blocks_granted", "moetide:line_moves_total", "moetide:line_returns_total",
              "vllm:num_requests_running")

    def __init__(self, pid: int, port: int, period_s: float = 10.0) -> None:
        super().__init__(daemon=True)
        self.pid, self.port, self.period_s = pid, port, period_s
        self.samples: list[dict] = []
        self.stop = threading.Event()

    def run(self) -> None:
        start = time.monotonic()
        while not self.stop.wait(0 if not self.samples else self.period_s):
            try:
                m = metrics(self.port)
            except (OSError, http.client.HTTPException):
                m = {}
            self.samples.append({"t_s": round(time.monotonic() - start), "rss_mib": round(tree_rss_mib(self.pid), 1),
                                 **{name.split(":")[1]: m.get(name) for name in self.SERIES}})


def give_back_line(port: int, timeout_s: float = 60) -> float:
    """One small request at a time until the line has granted nothing (cycling gives the last region back once
    drained); returns ``kv_blocks_granted`` at the end."""
    deadline = time.monotonic() + timeout_s
    body = json.dumps({"model": "soak", "prompt": "settle", "max_tokens": 4}).encode()
    while True:
        granted = metrics(port).get("moetide:kv_blocks_granted", 0)
        if granted == 0 or time.monotonic() > deadline:
            return granted
        connection = http.client.HTTPConnection(HOST, port, timeout=60)
        try:
            connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json",
                                                                   "Authorization": f"Bearer {KEY}"})
            connection.getresponse().read()
        finally:
            connection.close()


def run_clients(port: int, args: argparse.Namespace, engine: str) -> tuple[collections.Counter, dict, float]:
    counts: collections.Counter = collections.Counter()
    examples: dict[str, str] = {}
    lock = threading.Lock()
    start = time.monotonic()
    clients = [Client(i, port, args.seed, start + args.duration_s, counts, lock, examples, engine)
               for i in range(args.clients)]
    for client in clients:
        client.start()
    for client in clients:
        client.join(args.duration_s + 180)
    return counts, examples, time.monotonic() - start


def soak_vllm(model: Path, policy: str, args: argparse.Namespace, workdir: Path) -> dict:
    """``--engine vllm`` (module docstring)."""
    port = free_port()
    log_path = workdir / f"serve-vllm-{policy}.log"
    with log_path.open("wb") as log:
        process = start_server(server_command("vllm", model, policy, port, args), port, log, timeout_s=300)
        sampler = Sampler(process.pid, port)
        try:
            sampler.start()
            counts, examples, ran_s = run_clients(port, args, "vllm")
            granted_at_end = give_back_line(port)
            m = metrics(port)
            sampler.stop.set()
            sampler.join()
        finally:
            stop_server(process, 90)
    text, _, shutdown = log_path.read_text(errors="replace").partition("[shutdown] API server: shutdown triggered")
    unexpected = {k: v for k, v in counts.items() if k.startswith("unexpected")}
    moves, returns = m.get("moetide:line_moves_total", 0), m.get("moetide:line_returns_total", 0)
    return {"benchmark": "serve_soak", "engine": "vllm", "policy": policy, "measured": True,
            "duration_s": round(ran_s, 1), "clients": args.clients, "requests": sum(counts.values()),
            "outcomes": dict(sorted(counts.items())), "disconnects": counts["disconnected mid-stream"],
            "unexpected": sum(unexpected.values()), "unexpected_examples": list(examples.values())[:5],
            "line_grants": int(moves - returns), "line_returns": int(returns), "granted_at_end": granted_at_end,
            "stagings": m.get("moetide:stagings_total", 0), "unstaged": m.get("moetide:unstaged_total", -1),
            "preemptions": m.get("vllm:num_preemptions_total", 0),
            "stuck": int(m.get("vllm:num_requests_running", 0) + m.get("vllm:num_requests_waiting", 0)),
            "kv_cache_usage_at_end": m.get("vllm:kv_cache_usage_perc", -1), "samples": sampler.samples,
            "tracebacks": text.count("Traceback"), "shutdown_tracebacks": shutdown.count("Traceback"),
            "server_exit": process.returncode, "log": str(log_path)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration-s", type=float, default=600.0)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--policies", default="vllm,vamp")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", type=Path, help="a make-test-model checkpoint (default: made in a temp folder)")
    parser.add_argument("--engine", choices=("moetide", "vllm"), default="moetide")
    parser.add_argument("--line-cycle-steps", type=int, default=40,
                        help="--engine vllm, policy static-offload: the plugin's line cycling")
    parser.add_argument("--kv-cache-memory", default="1MiB", help="--engine vllm: vLLM's KV cache (moetide's syntax)")
    parser.add_argument("--vamp-horizon-s", type=float, default=0.05,
                        help="--engine vllm, vamp's policies: their review interval, on the plugin's modeled clock")
    args = parser.parse_args()
    if not args.duration_s > 0 or args.clients < 1:
        sys.exit("serve_soak: --duration-s must be > 0 and --clients >= 1")
    workdir = Path(tempfile.mkdtemp(prefix="moetide-soak-"))
    model = args.model
    if model is None:
        model = workdir / "qwen3_moe"
        vllm_sizes = ["--head-dim", "64", "--dtype", "bfloat16", "--expert-intermediate", "4096"]
        subprocess.run([*CLI, "make-test-model", "--arch", "qwen3_moe", "--out", str(model),
                        *(vllm_sizes if args.engine == "vllm" else [])], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ})
    bad = False
    for policy in args.policies.split(","):
        if args.engine == "vllm":
            result = soak_vllm(model, policy, args, workdir)
            leaked = result["kv_cache_usage_at_end"] != 0 or result["unstaged"] != 0 or result["granted_at_end"]
        else:
            result = soak(model, policy, args, workdir)
            leaked = result["leaked_blocks"] or not result["invariants_ok"]
        print(json.dumps(result), flush=True)
        bad |= bool(result["unexpected"] or result["stuck"] or result["tracebacks"] or leaked)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
