"""The engine thread when the engine fails mid-step: every waiter is answered, none hangs, nothing more is taken.

A stand-in engine whose step raises while a second request waits in the command queue: both handlers get a
final "error" event, the in-flight count returns to 0 (the queue bound frees up), a later submit is refused, and a
``call`` queued behind the failure raises instead of never resolving.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

pytest.importorskip("fastapi")

from moetide.engine.sampling import SamplingParams  # noqa: E402
from moetide.serve.loop import EngineLoop  # noqa: E402


class FailingEngine:
    """Takes requests; its first step blocks until released, then raises (a bug, an out-of-memory)."""

    def __init__(self) -> None:
        self.requests: dict[str, list[int]] = {}
        self.in_step, self.release = threading.Event(), threading.Event()

    def metrics(self):
        return None

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def add_request(self, prompt, params) -> str:
        request_id = str(len(self.requests))
        self.requests[request_id] = list(prompt)
        return request_id

    def abort_request(self, request_id: str) -> bool:
        return self.requests.pop(request_id, None) is not None

    def step(self):
        self.in_step.set()
        self.release.wait(5)
        raise RuntimeError("out of memory")


def test_a_failing_step_answers_the_running_and_the_queued_request_and_refuses_new_ones():
    async def scenario():
        engine = FailingEngine()
        loop = EngineLoop(engine)
        loop.start()
        running = loop.submit([1, 2], SamplingParams(max_tokens=4))
        await asyncio.get_running_loop().run_in_executor(None, engine.in_step.wait, 5)
        queued = loop.submit([3], SamplingParams(max_tokens=4))  # posted while the failing step runs
        call = loop.call(lambda e: "never")
        engine.release.set()
        first = await asyncio.wait_for(running.events.get(), 5)
        second = await asyncio.wait_for(queued.events.get(), 5)
        with pytest.raises(RuntimeError, match="engine loop failed"):
            call.result(5)
        with pytest.raises(RuntimeError, match="has stopped"):
            loop.submit([4], SamplingParams(max_tokens=4))
        loop.stop(5)
        return first, second, loop

    first, second, loop = asyncio.run(scenario())
    assert (first.finish_reason, second.finish_reason) == ("error", "error")
    assert loop.num_in_flight == 0 and isinstance(loop.error, RuntimeError)
