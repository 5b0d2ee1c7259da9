"""The engine thread: the only code that touches the ``Engine`` while the server runs.

HTTP handlers run on the asyncio loop; the engine steps on its own thread, continuously while anything is in
flight and asleep on its command queue otherwise. Handlers never call the engine: they post commands (add,
abort, call) that the thread applies between steps, in the order posted, so a request joins or leaves the batch
only at a step boundary — the core scheduler's continuous batching, with no lock around the engine. Each step's
emitted tokens go back to the waiting handler through its ``asyncio.Queue`` (``call_soon_threadsafe``).

Timing for the latency histograms is taken here, on the engine thread, when a token is emitted (as vLLM's output
processor stamps its engine-core outputs), not when the HTTP layer gets round to sending it.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from moetide.engine.results import EngineMetrics
from moetide.engine.runner import Engine
from moetide.engine.sampling import SamplingParams

log = logging.getLogger("moetide.serve")


@dataclass(frozen=True)
class TokenEvent:
    """New tokens of one request; ``finish_reason`` set on its last event ("stop", "length", "failed": can never
    fit the KV budget, "abort": its client left, "error": the engine loop failed)."""

    token_ids: list[int]
    finish_reason: str | None


@dataclass(eq=False)
class RequestHandle:
    """One engine request as a handler holds it. ``events`` is read on the asyncio loop."""

    prompt_token_ids: list[int]
    params: SamplingParams
    events: asyncio.Queue
    aio_loop: asyncio.AbstractEventLoop
    arrival_s: float = field(default_factory=time.monotonic)
    engine_id: str | None = None  # set on the engine thread when the engine has it
    first_token_s: float | None = None
    last_token_s: float | None = None
    prev_token_s: float | None = None  # the token before the last one (inter-token latency)
    num_output_tokens: int = 0
    finished: bool = False

    def post(self, event: TokenEvent) -> None:
        try:
            self.aio_loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop has closed: nobody is waiting any more
            pass


class EngineLoop:
    """Owns an ``Engine`` and its thread. ``observer(handle, event, now_s)`` (the metrics) is called on the engine
    thread for every event; ``metrics`` is the engine's latest ``EngineMetrics``, replaced after each step."""

    def __init__(self, engine: Engine, observer: Callable[[RequestHandle, TokenEvent, float], None] | None = None):
        self.engine = engine
        self.observer = observer
        self.metrics: EngineMetrics = engine.metrics()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._handles: dict[str, RequestHandle] = {}  # engine thread only
        self._num_in_flight = 0  # handles added and not finished; read by handlers for the queue bound
        self._count_lock = threading.Lock()
        self._post_lock = threading.Lock()  # submit's check-and-post against the failed loop's last drain
        self._stopping = False
        self.error: BaseException | None = None
        # written by the engine thread only, read at scrape time: steps run, their wall seconds, the engine
        # thread's CPU seconds in them (what the step-time model is calibrated against, inside the server)
        self.num_steps = 0
        self.step_wall_s = 0.0
        self.step_cpu_s = 0.0
        self._thread = threading.Thread(target=self._run, name="moetide-engine", daemon=True)

    @property
    def num_in_flight(self) -> int:
        return self._num_in_flight

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float | None = None) -> None:
        """Abort whatever is still in flight and end the thread (after uvicorn's drain, nothing is)."""
        self._commands.put(("stop", None))
        self._thread.join(timeout_s)

    # ---- called from the asyncio loop ------------------------------------------------------------------------
    def submit(self, prompt_token_ids: list[int], params: SamplingParams) -> RequestHandle:
        handle = RequestHandle(prompt_token_ids, params, asyncio.Queue(), asyncio.get_running_loop())
        with self._post_lock:
            if self.error is not None or self._stopping:
                raise RuntimeError("the engine loop has stopped")
            with self._count_lock:
                self._num_in_flight += 1
            self._commands.put(("add", handle))
        return handle

    def abort(self, handle: RequestHandle, reason: str = "abort") -> None:
        """End a request before its engine would: its client went away ("abort"), or its text reached a stop
        string ("stop", which the metrics count as a finish like vLLM's). Its blocks are freed before the next
        step."""
        if not handle.finished:
            self._commands.put(("abort", (handle, reason)))

    def call(self, fn: Callable[[Engine], object]) -> Future:
        """Run ``fn(engine)`` on the engine thread between steps (tests check the pool's invariants this way)."""
        future: Future = Future()
        with self._post_lock:
            if self.error is not None:
                future.set_exception(RuntimeError("the engine loop has stopped"))
                return future
            self._commands.put(("call", (fn, future)))
        return future

    def audit(self, timeout_s: float = 5.0) -> bool:
        """Whether the pool's and the KV manager's invariants hold, checked on the engine thread between steps
        (an admin reading for ``/metrics``); False also when the engine does not answer within ``timeout_s``."""
        def check(engine: Engine) -> bool:
            kv = engine.scheduler.kv
            try:
                kv.pool.check_invariants()
                kv.check_invariants()
            except AssertionError:
                return False
            return True

        try:
            return bool(self.call(check).result(timeout=timeout_s))
        except Exception:  # stopped, or busy past the timeout: not known to hold
            return False

    # ---- the engine thread -----------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                block = not self.engine.has_unfinished_requests()
                if not self._apply_commands(block):
                    break
                if self.engine.has_unfinished_requests():
                    self._step()
        except BaseException as exc:  # a bug or an OOM: fail every waiter instead of hanging them
            log.exception("engine loop failed")
            with self._post_lock:  # nothing is posted after this: submit and call see the error
                self.error = exc
                self._stopping = True
            now = time.monotonic()
            for handle in list(self._handles.values()):
                self._finish(handle, TokenEvent([], "error"), now)
            self._fail_pending(exc, now)
        finally:
            self._stopping = True

    def _fail_pending(self, exc: BaseException, now: float) -> None:
        """Answer every command still queued when the loop failed: an added request ends with "error", a call
        raises the loop's error."""
        while True:
            try:
                kind, payload = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                self._finish(payload, TokenEvent([], "error"), now)
            elif kind == "call":
                payload[1].set_exception(RuntimeError(f"the engine loop failed: {exc!r}"))

    def _apply_commands(self, block: bool) -> bool:
        """Apply the queued commands (waiting for one when idle); False once told to stop."""
        while True:
            try:
                kind, payload = self._commands.get(block=block)
            except queue.Empty:
                return True
            block = False
            if kind == "add":
                self._add(payload)
            elif kind == "abort":
                handle, reason = payload
                if handle.engine_id in self._handles and self.engine.abort_request(handle.engine_id):
                    self.metrics = self.engine.metrics()
                    self._finish(handle, TokenEvent([], reason), time.monotonic())
            elif kind == "call":
                fn, future = payload
                try:
                    future.set_result(fn(self.engine))
                except Exception as exc:
                    future.set_exception(exc)
            else:
                for handle in list(self._handles.values()):
                    self.engine.abort_request(handle.engine_id)
                    self._finish(handle, TokenEvent([], "abort"), time.monotonic())
                return False
            self.metrics = self.engine.metrics()

    def _add(self, handle: RequestHandle) -> None:
        try:
            handle.engine_id = self.engine.add_request(handle.prompt_token_ids, handle.params)
        except Exception as exc:  # validated by the handler first; anything left ends the request, not the loop
            log.warning("request refused by the engine: %s", exc)
            self._finish(handle, TokenEvent([], "failed"), time.monotonic())
            return
        self._handles[handle.engine_id] = handle

    def _step(self) -> None:
        wall, cpu = time.perf_counter(), time.thread_time()
        outputs = self.engine.step()
        self.step_cpu_s += time.thread_time() - cpu
        self.step_wall_s += time.perf_counter() - wall
        self.num_steps += 1
        now = time.monotonic()
        self.metrics = self.engine.metrics()  # before any event goes out: a client that saw its answer sees it
        for out in outputs:
            handle = self._handles.get(out.request_id)
            if handle is None:
                continue
            event = TokenEvent(out.new_token_ids, out.finish_reason)
            if out.new_token_ids:
                if handle.first_token_s is None:
                    handle.first_token_s = now
                handle.prev_token_s, handle.last_token_s = handle.last_token_s, now
                handle.num_output_tokens += len(out.new_token_ids)
            if out.finish_reason is not None:
                self._finish(handle, event, now)
            else:
                self._emit(handle, event, now)

    def _emit(self, handle: RequestHandle, event: TokenEvent, now: float) -> None:
        if self.observer is not None:
            self.observer(handle, event, now)
        handle.post(event)

    def _finish(self, handle: RequestHandle, event: TokenEvent, now: float) -> None:
        if handle.finished:
            return
        handle.finished = True
        if handle.engine_id is not None:
            self._handles.pop(handle.engine_id, None)
        with self._count_lock:
            self._num_in_flight -= 1
        self._emit(handle, event, now)
