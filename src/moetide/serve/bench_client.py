"""Send a trace's requests to an OpenAI-compatible server in real time, and time each as vLLM's benchmark does.

One request is one streamed ``/v1/completions`` call (vLLM's ``async_request_openai_completions``), or, when the
endpoint is a chat one, one ``/v1/chat/completions`` call with the prompt as one user message (vLLM's
``async_request_openai_chat_completions``; ``bench_prompts.prompt_text`` writes the token prompt as text, so the
server's tokenizer decides its length). The clock starts before the request is sent; the first chunk that carries
a token (a completion's ``text``, a chat delta's ``content``; a chat stream's role-only first delta is none) is the
first token (TTFT); each later one adds an inter-token latency; the latency is the time of the last such chunk;
``usage.completion_tokens`` (asked for with ``stream_options.include_usage``) is the output length. A request with
no token chunk, or any HTTP or connection error, is a failure with its reason.

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

from moetide.errors import UserError
from moetide.serve.bench_prompts import BenchSession, BenchTurn, prompt_text

CHAT_SUFFIX = "/chat/completions"
INTERRUPTED = "interrupted before it finished"  # the error of a request a stop cut off (not the server's doing)


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
    text: str = ""  # the streamed output, as vLLM's bench serve keeps it (``generated_texts``)


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

    @property
    def chat(self) -> bool:
        return self.endpoint.rstrip("/").endswith(CHAT_SUFFIX)

    def body(self, turn: BenchTurn) -> str:
        """The request body: a completion of the token prompt, or a chat turn of its text."""
        common = {"model": self.model, "max_tokens": turn.output_tokens, "temperature": 0.0,
                  "ignore_eos": self.ignore_eos, "stream": True, "stream_options": {"include_usage": True}}
        if self.chat:
            return json.dumps({**common, "messages": [{"role": "user",
                                                       "content": prompt_text(turn.prompt_token_ids)}]})
        return json.dumps({**common, "prompt": turn.prompt_token_ids})


def normalize_url(url: str) -> tuple[str, list[str]]:
    """``url`` as a base URL for the OpenAI routes, and a warning for each thing taken as a person would mean it:
    no scheme is ``http://`` (as curl reads it), a trailing ``/v1`` is dropped (the routes carry it). A scheme other
    than http(s), or no host, is a ``UserError``."""
    warnings = []
    text = url.strip()
    if "://" not in text:
        text = "http://" + text
        warnings.append(f"--url {url}: no scheme; using {text}")
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https"):
        raise UserError(f"--url {url}: scheme {parts.scheme!r} is not http or https")
    try:
        parts.port  # noqa: B018 - raises on a port that is not a number
    except ValueError:
        raise UserError(f"--url {url}: the port is not a number") from None
    if not parts.hostname:
        raise UserError(f"--url {url}: no host (e.g. http://127.0.0.1:8000)")
    path = parts.path.rstrip("/")
    if path.endswith("/v1"):
        path = path[:-3]
        warnings.append(f"--url {url}: dropping the trailing /v1 (the routes, /v1/models and the endpoint, carry it)")
    return f"{parts.scheme}://{parts.netloc}{path}", warnings


@dataclass(frozen=True)
class ServerInfo:
    model: str  # the first model /v1/models lists (what vLLM's benchmark uses without --model)
    max_model_len: int | None  # vLLM and moetide list it beside the model; None where a server does not


def server_info(url: str, timeout_s: float = 30.0) -> ServerInfo:
    """What ``/v1/models`` says of the first model; ``OSError``/``ValueError`` when it cannot be read."""
    target = Target(url, "", timeout_s=timeout_s)
    connection = target.connection()
    try:
        connection.request("GET", urlsplit(url).path.rstrip("/") + "/v1/models")
        response = connection.getresponse()
        body = response.read()
        if response.status != 200:
            raise OSError(f"GET /v1/models answered HTTP {response.status}")
        card = json.loads(body)["data"][0]
        length = card.get("max_model_len")
        return ServerInfo(card["id"], length if isinstance(length, int) and length > 0 else None)
    finally:
        connection.close()


def _output_in(chunk: dict, chat: bool) -> str | None:
    """The output a stream chunk carries, None if it carries none: any choice for a completion (vLLM counts
    each, its ``text`` possibly empty), a delta with content for a chat (its first delta carries only the
    role)."""
    choices = chunk.get("choices")
    if not choices:
        return None
    first = choices[0] if isinstance(choices[0], dict) else {}
    if not chat:
        text = first.get("text")
        return text if isinstance(text, str) else ""
    delta = first.get("delta")
    if not isinstance(delta, dict):
        return None
    content = delta.get("content") or delta.get("reasoning_content")
    return content if isinstance(content, str) and content else None


def send(target: Target, turn: BenchTurn) -> RequestResult:
    result = RequestResult(turn.request_id, len(turn.prompt_token_ids), turn.output_tokens)
    body = target.body(turn)
    chat = target.chat
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
            piece = _output_in(chunk, chat)
            if piece is not None:
                result.text += piece
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


@dataclass
class Progress:
    """What a replay has done so far, read by a progress printer while the replay runs."""

    total: int
    done: int = 0
    failed: int = 0
    in_flight: int = 0


class _Sending:
    """One benchmark's sending: what finished, how many are in flight, and the stop every sender watches."""

    def __init__(self, target: Target, num_turns: int, progress: Callable[[Progress], None] | None,
                 stop: threading.Event) -> None:
        self.target, self.progress, self.stop = target, progress, stop
        self.results: dict[str, RequestResult] = {}
        self.lock = threading.Lock()
        self.state = Progress(num_turns)
        self.start = time.perf_counter()

    def one(self, turn: BenchTurn) -> None:
        state = self.state
        with self.lock:
            state.in_flight += 1
        result = send(self.target, turn)
        with self.lock:
            state.in_flight -= 1
            if self.stop.is_set() and turn.request_id not in self.results and not result.success:
                return  # cut off by the stop, not by the server: reported as not finished
            self.results[result.request_id] = result
            state.done += 1
            state.failed += not result.success
            if self.progress is not None:
                self.progress(state)

    def session(self, session: BenchSession) -> None:
        """A closed-loop session's turns, one after the other, each after its think time."""
        stop = self.stop
        if stop.wait(max(0.0, self.start + session.start_s - time.perf_counter())):
            return
        for i, turn in enumerate(session.turns):
            if i and turn.think_time_s > 0 and stop.wait(turn.think_time_s):
                return
            if stop.is_set():
                return
            self.one(turn)

    def launch(self, sessions: list[BenchSession], turns: list[BenchTurn], mode: str) -> list[threading.Thread]:
        """Start the senders: a thread per request at its arrival time (open loop; this waits for the last one's
        arrival), or a thread per session (closed loop)."""
        threads = []
        if mode == "open":
            for turn in sorted(turns, key=lambda t: t.arrival_s):
                if self.stop.wait(max(0.0, self.start + turn.arrival_s - time.perf_counter())):
                    break
                threads.append(threading.Thread(target=self.one, args=(turn,), daemon=True))
                threads[-1].start()
        else:
            for session in sessions:
                threads.append(threading.Thread(target=self.session, args=(session,), daemon=True))
                threads[-1].start()
        return threads

    def in_trace_order(self, turns: list[BenchTurn], stopped: bool) -> list[RequestResult]:
        """Every turn's result; one that never finished is a failure that says why."""
        why = INTERRUPTED if stopped else "never sent (its session stopped early)"
        missing = RequestResult("", 0, 0, error=why)
        with self.lock:
            return [self.results.get(turn.request_id) or replace(missing, request_id=turn.request_id,
                                                                 prompt_len=len(turn.prompt_token_ids),
                                                                 expected_output_len=turn.output_tokens)
                    for turn in turns]


def replay(sessions: list[BenchSession], mode: str, target: Target,
           progress: Callable[[Progress], None] | None = None,
           stop: threading.Event | None = None) -> tuple[list[RequestResult], float, bool]:
    """Send everything; returns the results (in trace order), the benchmark's duration in seconds, and whether it
    was interrupted. Ctrl-C (or ``stop`` set) stops sending: what finished is kept, what was in flight or never
    sent is a failure that says so."""
    turns = [turn for session in sessions for turn in session.turns]
    sending = _Sending(target, len(turns), progress, stop or threading.Event())
    interrupted = False
    try:
        for thread in sending.launch(sessions, turns, mode):
            while thread.is_alive():
                thread.join(0.2)
    except KeyboardInterrupt:
        interrupted = True
        sending.stop.set()
    duration = time.perf_counter() - sending.start
    stopped = interrupted or sending.stop.is_set()
    return sending.in_trace_order(turns, stopped), duration, stopped
