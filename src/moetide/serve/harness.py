"""A ``moetide serve`` app run by uvicorn on a thread of the calling process (vLLM's tests have the same helper as
a subprocess): a test or benchmark reaches its engine loop — and checks the pool between requests — while clients
talk to it over real HTTP. ``CHAT_TEMPLATE`` is a minimal template for checkpoints without one
(``make-test-model``'s)."""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def wait_until_up(url: str, process, timeout_s: float = 60.0) -> None:
    """Poll ``url``/health until it answers, while ``process`` (a ``subprocess.Popen`` of ``moetide serve``) runs;
    ``RuntimeError`` with its output so far when it exits or the time runs out."""
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            urllib.request.urlopen(url + "/health").close()
            return
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the server at {url} did not come up") from None
            time.sleep(0.1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LiveServer:
    url: str
    loop: object  # moetide.serve.loop.EngineLoop
    model: str
    args: object
    _server: object
    _thread: threading.Thread

    def idle(self, timeout_s: float = 10.0) -> None:
        """Wait until nothing is in flight, then check the pool's invariants and that no request holds blocks."""
        deadline = time.monotonic() + timeout_s
        while self.loop.num_in_flight and time.monotonic() < deadline:
            time.sleep(0.01)
        assert self.loop.num_in_flight == 0, "requests still in flight"

        def check(engine):
            kv = engine.scheduler.kv
            kv.pool.check_invariants()
            kv.check_invariants()
            return kv.request_ids, engine.has_unfinished_requests()

        held, unfinished = self.loop.call(check).result(timeout=timeout_s)
        assert held == [] and not unfinished

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(30)


def run_in_thread(app, loop, args, host: str = "127.0.0.1") -> LiveServer:
    """Serve ``app`` (``commands.serve.build_app``'s, with its ``loop``) with uvicorn on a daemon thread."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host=host, port=args.port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the server did not start")
        time.sleep(0.02)
    return LiveServer(f"http://{host}:{args.port}", loop, str(args.model), args, server, thread)
