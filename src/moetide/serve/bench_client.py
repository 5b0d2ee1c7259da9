"""Send a trace's requests to an OpenAI-compatible server in real time, and time each as vLLM's benchmark does.

One request is one streamed ``/v1/completions`` call (vLLM's ``async_request_openai_completions``): the clock
starts before the request is sent; the first chunk that carries a choice is the first token (TTFT); each later one
adds an inter-token latency; the latency is the time of the last such chunk; ``usage.completion_tokens`` (asked
for with ``stream_options.include_usage``) is the output length. A request with no choice chunk, or any HTTP or
connection error, is a failure with its reason.

Open loop: each turn is sent at its arrival time, whatever is in flight. Closed loop (agent sessions): a session
sends its first turn at its start and each next one ``think_time_s`` after the previous completes — the trace's
think times (times come scaled already: ``workloads.scale``), so a slow server sees fewer requests, as a
real agent would give it. One thread per request in flight (open loop) or per session (closed loop): the standard
library's ``http.client``, no event loop, so bench-serve needs nothing beyond moetide's core install.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from urllib.parse import urlsplit

from moetide.serve.bench_prompts import BenchSession, BenchTurn


@dataclass
class RequestResult:
    request_id: str
    prompt_len: int
    expected_output_len: int
    start_s: float = 0.0  # perf_counter at send
    success: bool = False
    ttft_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    latency_s: float = 0.0
    output_tokens: int = 0
    error: str = ""


@dataclass(frozen=True)
class Target:
    url: str  # base URL, e.g. http://127.0.0.1:8000
    model: str
    endpoint: str = "/v1/completions"
    ignore_eos: bool = True
    timeout_s: float = 600.0

    def connection(self) -> http.client.HTTPConnection:
        parts = urlsplit(self.url)
        kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        return kind(parts.hostname, parts.port, timeout=self.timeout_s)

    def path(self) -> str:
        return urlsplit(self.url).path.rstrip("/") + self.endpoint


def first_model(url: str, timeout_s: float = 30.0) -> str:
    """The first model ``/v1/models`` lists (what vLLM's benchmark uses when no ``--model`` is given)."""
    target = Target(url, "", timeout_s=timeout_s)
    connection = target.connection()
    try:
        connection.request("GET", urlsplit(url).path.rstrip("/") + "/v1/models")
        response = connection.getresponse()
        body = response.read()
        if response.status != 200:
            raise OSError(f"GET /v1/models answered {response.status}")
        return json.loads(body)["data"][0]["id"]
    finally:
        connection.close()


def send(target: Target, turn: BenchTurn) -> RequestResult:
    result = RequestResult(turn.request_id, len(turn.prompt_token_ids), turn.output_tokens)
    body = json.dumps({"model": target.model, "prompt": turn.prompt_token_ids, "max_tokens": turn.output_tokens,
                       "temperature": 0.0, "ignore_eos": target.ignore_eos, "stream": True,
                       "stream_options": {"include_usage": True}})
    connection = target.connection()
    start = last = time.perf_counter()
    result.start_s = start
    try:
        connection.request("POST", target.path(), body, {"Content-Type": "application/json"})
        response = connection.getresponse()
        if response.status != 200:
            result.error = f"HTTP {response.status}: {response.read()[:300].decode(errors='replace')}"
            return result
        for line in response:
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            chunk = json.loads(data)
            if not isinstance(chunk, dict):
                raise ValueError(f"a stream chunk that is not a JSON object: {data[:200]!r}")
            if chunk.get("error"):
                error = chunk["error"]
                message = error.get("message", error) if isinstance(error, dict) else error
                result.success, result.error = False, str(message)
                break
            if chunk.get("choices"):
                now = time.perf_counter()
                if not result.success:
                    result.success, result.ttft_s = True, now - start
                else:
                    result.itl_s.append(now - last)
                last = now
            elif isinstance(chunk.get("usage"), dict):
                result.output_tokens = chunk["usage"].get("completion_tokens") or 0
                result.prompt_len = chunk["usage"].get("prompt_tokens") or result.prompt_len
        if not result.success and not result.error:
            result.error = "never received a chunk with a choice (no first token)"
        result.latency_s = last - start
    except Exception as exc:  # whatever a server sends, one request's failure is recorded, not the run's
        result.success, result.error = False, f"{type(exc).__name__}: {exc}"
    finally:
        connection.close()
    if result.success and not result.output_tokens:
        result.output_tokens = len(result.itl_s) + 1  # a server without usage chunks: one token per chunk
    return result


def replay(sessions: list[BenchSession], mode: str, target: Target,
           progress: Callable[[int, int], None] | None = None) -> tuple[list[RequestResult], float]:
    """Send everything; returns the results (in trace order) and the benchmark's duration in seconds."""
    turns = [turn for session in sessions for turn in session.turns]
    results: dict[str, RequestResult] = {}
    lock = threading.Lock()
    start = time.perf_counter()

    def record(result: RequestResult) -> None:
        with lock:
            results[result.request_id] = result
            if progress is not None:
                progress(len(results), len(turns))

    def sleep_until(offset_s: float) -> None:
        delay = start + offset_s - time.perf_counter()
        if delay > 0:
            time.sleep(delay)

    def run_session(session: BenchSession) -> None:
        sleep_until(session.start_s)
        for i, turn in enumerate(session.turns):
            if i and turn.think_time_s > 0:
                time.sleep(turn.think_time_s)
            record(send(target, turn))

    threads = []
    if mode == "open":
        for turn in sorted(turns, key=lambda t: t.arrival_s):
            sleep_until(turn.arrival_s)
            threads.append(threading.Thread(target=lambda t=turn: record(send(target, t)), daemon=True))
            threads[-1].start()
    else:
        for session in sessions:
            threads.append(threading.Thread(target=run_session, args=(session,), daemon=True))
            threads[-1].start()
    for thread in threads:
        thread.join()
    duration = time.perf_counter() - start
    missing = RequestResult("", 0, 0, error="never sent (its session stopped early)")
    return [results.get(turn.request_id) or replace(missing, request_id=turn.request_id,
                                                                prompt_len=len(turn.prompt_token_ids),
                                                                expected_output_len=turn.output_tokens)
            for turn in turns], duration
