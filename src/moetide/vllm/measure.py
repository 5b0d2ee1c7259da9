"""vLLM's own engine steps timed on a checkpoint: in this process (``moetide calibrate --engine vllm``), or inside
a running server (``TimedScheduler``).

The replay predicts a server from a device file whose ``[efficiency]`` was fitted to an engine's timed steps
(``perf.step_calibrate``). For moetide's engine those are ``engine.measure.measure_engine_steps``; this module
times vLLM's instead, on the same designed batches (``ENGINE_STEP_RUNS``: decode at several batch sizes and
contexts, prefill chunks of several lengths; not a trace), so ``moetide replay --gpu DEVICE.toml`` predicts what
vLLM does on this CPU.

vLLM runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the engine core and its one CPU worker are
this thread, and vLLM's CPU platform schedules synchronously). Each sample is one whole ``LLMEngine.step``:
scheduling, the forward, sampling and output processing, on the wall clock. Its shape is read from the
``SchedulerOutput`` that step scheduled (vLLM advances ``num_computed_tokens`` inside ``schedule``, so the context
before the step is that less the scheduled tokens). Prefix caching is off, so every prompt token is computed. Each
``add_request`` call is timed too (the request's block hashes are made there).

A server does more per step than one process does: its engine core, its worker and its API server are three
processes, which pass every step's inputs and outputs to each other, and on one core take turns. ``TimedScheduler``
(``--scheduler-cls moetide.vllm.measure.TimedScheduler``, with ``MOETIDE_VLLM_STEP_LOG=FILE``) is vLLM's scheduler
that writes the monotonic time and the shape of each step it schedules to ``FILE``; the engine core calls
``schedule`` once per loop while it has work, so the time from one call to the next is one whole step as the
server runs it, everything on that core included. ``served_samples`` reads them back, leaving out the step before
an idle gap (the client marks where its loads ended).
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Sequence
from pathlib import Path

from vllm.v1.core.sched.scheduler import Scheduler

from moetide.perf.step_calibrate import designed_runs
from moetide.errors import read_json
from moetide.perf.step import StepShape
from moetide.perf.step_calibrate import StepSample

KV_CACHE_BYTES = 256 * 2**20  # room for the largest designed batch, as moetide's calibration gives its engine
STEP_LOG_ENV = "MOETIDE_VLLM_STEP_LOG"


def step_shape(output, requests) -> StepShape | None:
    """The step-time model's shape of one vLLM ``SchedulerOutput``, read after ``schedule`` returned (``requests``:
    the scheduler's ``requests`` by id); None for a step that computes nothing."""
    if not output.total_num_scheduled_tokens:
        return None
    return StepShape.of_step((requests[request_id].num_computed_tokens - n, n)
                             for request_id, n in output.num_scheduled_tokens.items())


def measure_vllm_steps(model_dir: str, *, quick: bool, num_threads: int | None = None, dtype: str = "auto",
                       block_size: int = 32, max_num_batched_tokens: int = 8192, max_num_seqs: int = 256,
                       seed: int = 0) -> tuple[list[StepSample], list[tuple[int, float]]]:
    """Every step of the designed runs (``perf.step_calibrate.designed_runs``) and every
    ``add_request`` as (prompt tokens, seconds), after one untimed warm-up run (module docstring). The scheduler's
    knobs are the served run's, so its steps are split as the server's are."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # vLLM's CPU worker binds its threads by the machine's topology unless told; bind them to the cores this
    # process may use (``taskset``), as many as ``num_threads``
    cores = sorted(os.sched_getaffinity(0))[:num_threads or None]
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, cores)))
    from vllm import LLM

    config = read_json(Path(model_dir) / "config.json", f"--model {model_dir}")
    longest = min((config.get("max_position_embeddings") if isinstance(config, dict) else None) or 4096, 32768)
    runs = designed_runs(quick, longest)
    llm = LLM(model=str(model_dir), dtype=dtype, enforce_eager=True, enable_prefix_caching=False,
              block_size=block_size, max_model_len=longest, kv_cache_memory_bytes=KV_CACHE_BYTES,
              max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, seed=seed)
    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    schedule = scheduler.schedule
    shapes: list[StepShape | None] = []

    def timed_schedule(*args, **kwargs):
        output = schedule(*args, **kwargs)
        shapes.append(step_shape(output, scheduler.requests))
        return output

    scheduler.schedule = timed_schedule
    try:
        return _time_runs(engine, runs, shapes, llm.model_config.get_vocab_size(), seed)
    finally:
        scheduler.schedule = schedule
        del llm


def _time_runs(engine, runs, shapes: list, vocab: int, seed: int
               ) -> tuple[list[StepSample], list[tuple[int, float]]]:
    """Each designed run's requests added (their ``add_request`` timed) and stepped to the end, every step timed
    with the one shape ``shapes`` got; the first run is the warm-up and is not kept."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    rng = random.Random(seed)
    samples: list[StepSample] = []
    requests: list[tuple[int, float]] = []
    serial = 0
    for i, (batch, prompt, output) in enumerate(runs):
        params = SamplingParams(max_tokens=output, ignore_eos=True, temperature=0.0)
        for _ in range(batch):
            tokens = [rng.randrange(3, vocab) for _ in range(prompt)]
            start = time.perf_counter()
            engine.add_request(f"calibrate-{serial}", TokensPrompt(prompt_token_ids=tokens), params)
            if i:
                requests.append((prompt, time.perf_counter() - start))
            serial += 1
        while engine.has_unfinished_requests():
            shapes.clear()
            start = time.perf_counter()
            engine.step()
            seconds = time.perf_counter() - start
            if i and len(shapes) == 1 and shapes[0] is not None:
                samples.append(StepSample(shapes[0], seconds))
    return samples, requests


class TimedScheduler(Scheduler):
    """vLLM's scheduler, logging the time and shape of each step to ``$MOETIDE_VLLM_STEP_LOG`` (module
    docstring): one line per ``schedule`` call, ``TIME TOKENS SEQS DECODE_SEQS KV_READ PAIRS`` (``-`` for a step
    that computes nothing), written as it happens, so a server stopped by a signal has lost none."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        path = os.environ.get(STEP_LOG_ENV)
        if not path:
            raise ValueError(f"TimedScheduler writes its steps to ${STEP_LOG_ENV}, which is not set")
        self._step_log = open(path, "a", buffering=1)

    def schedule(self, *args, **kwargs):
        now = time.monotonic()
        output = super().schedule(*args, **kwargs)
        shape = step_shape(output, self.requests)
        fields = "-" if shape is None else " ".join(map(str, shape.as_args()))
        self._step_log.write(f"{now!r} {fields}\n")
        return output


def served_samples(path: str, idle_marks: Sequence[float], after: float = float("-inf")) -> list[StepSample]:
    """The steps of a ``TimedScheduler`` log: each from its ``schedule`` call to the next, for the calls after
    ``after`` (monotonic seconds), leaving out steps that compute nothing and any step an ``idle_marks`` time falls
    in (the client's loads ended there; the engine then waited for the next)."""
    entries = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            words = line.split()
            if len(words) == 2 and words[1] == "-":
                entries.append((float(words[0]), None))
            elif len(words) == 6:
                entries.append((float(words[0]), StepShape(*map(int, words[1:]))))
            else:
                raise ValueError(f"{path}:{number}: not a step line: {line.rstrip()!r}")
    samples = []
    for (start, shape), (end, _) in zip(entries, entries[1:]):
        if shape is not None and start > after and not any(start < mark <= end for mark in idle_marks):
            samples.append(StepSample(shape, end - start))
    return samples
