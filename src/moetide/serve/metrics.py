"""``/metrics``: Prometheus text under vLLM's names (``vllm/v1/metrics/loggers.py``, 0.32) and moetide's own.

Same names, labels (``model_name``, ``engine``), kinds and histogram buckets as vLLM for the same things, so a
dashboard built for vLLM reads moetide unchanged:

* levels: ``vllm:num_requests_running``, ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc`` (a 0-1
  fraction of the device KV blocks in use, as vLLM's despite its name);
* counters: ``vllm:prefix_cache_queries`` / ``_hits`` (tokens), ``vllm:num_preemptions``, ``vllm:prompt_tokens``,
  ``vllm:generation_tokens``, ``vllm:request_success`` (by ``finished_reason``: stop, length, abort, error — a
  request that can never fit the KV budget);
* histograms: ``vllm:time_to_first_token_seconds``, ``vllm:inter_token_latency_seconds``,
  ``vllm:request_time_per_output_token_seconds``, ``vllm:e2e_request_latency_seconds``;
* moetide's: ``moetide_offloaded_expert_ratio`` (offloaded / all routed-expert bytes), ``moetide_experts_offloaded``,
  ``moetide_kv_host_blocks`` and ``moetide_kv_host_blocks_used`` (the host KV tier), ``moetide_experts_staged``
  and ``moetide_experts_on_host`` (offloaded experts copied into a staging buffer, or computed from their host
  copies, per layer that routed to them); ``moetide_engine_steps``, ``moetide_engine_step_seconds`` and
  ``moetide_engine_step_cpu_seconds`` (steps run, their wall and engine-thread CPU seconds) and
  ``moetide_server_thread_cpu_seconds`` (CPU seconds of the HTTP event-loop thread): on a server pinned to one
  core the two threads share it, and these say how much of each step's time the HTTP side took;
  ``moetide_kv_blocks_held`` (blocks some request holds: 0 once every request has left) and
  ``moetide_pool_invariants_ok`` (1 if the block pool's and the KV manager's invariants held at the scrape, checked
  on the engine thread between steps): what a soak reads to show nothing leaked.

Where the numbers differ from vLLM's for the same traffic: a request whose client left is counted in
``request_success{finished_reason="abort"}`` (vLLM's frontend abort records no finished stats; counting it lets an
operator see disconnects); a one-token request observes no TPOT (vLLM observes 0); the ``repetition`` label of
vLLM's per-request histograms is not exported.

Levels and engine counters are read at scrape time from the engine loop's latest ``EngineMetrics`` (replaced after
every step on the engine thread, so a scrape never touches the engine); the histograms are observed by the engine
thread as tokens are emitted. One registry per server: two servers in one process (tests) do not collide.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from moetide.engine.results import EngineMetrics
from moetide.serve.loop import RequestHandle, TokenEvent

# vllm/v1/metrics/buckets.py (0.32)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)
TIME_TO_FIRST_TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                               10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
INTER_TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                               20.0, 40.0, 80.0)
FINISH_REASONS = ("stop", "length", "abort", "error")  # vLLM's labels; the engine's "failed" is counted as "error"
LABELS = ("model_name", "engine")
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

disable_created_metrics()  # as vLLM does: no ``*_created`` series beside every counter and histogram


class _EngineCollector:
    """Exports the levels and lifetime counters of the latest ``EngineMetrics`` at each scrape."""

    def __init__(self, read: Callable[[], EngineMetrics], labels: list[str],
                 steps: Callable[[], tuple[int, float, float]], audit: Callable[[], bool | None]) -> None:
        self.read, self.labels, self.steps, self.audit = read, labels, steps, audit

    def collect(self):
        m = self.read()
        num_steps, step_wall_s, step_cpu_s = self.steps()

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=LABELS)
            family.add_metric(self.labels, value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=LABELS)
            family.add_metric(self.labels, value)
            return family

        yield gauge("vllm:num_requests_running", "Number of requests in model execution batches.", m.num_running)
        yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", m.num_waiting)
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", m.kv_cache_usage)
        yield counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                      m.prefix_query_tokens)
        yield counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                      m.prefix_hit_tokens)
        yield counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.", m.num_preemptions)
        yield gauge("moetide_offloaded_expert_ratio", "Offloaded share of the routed-expert bytes.", m.offloaded_ratio)
        yield gauge("moetide_experts_offloaded", "Experts served from their host copies.", m.experts_offloaded)
        yield gauge("moetide_kv_host_blocks", "Host KV tier capacity in blocks (0: no host tier).", m.kv_host_blocks)
        yield gauge("moetide_kv_host_blocks_used", "Host KV blocks held by running requests.", m.kv_host_blocks_used)
        yield gauge("moetide_kv_blocks_held", "KV blocks some request holds (0 once every request has left).",
                    m.kv_blocks_held)
        audited = self.audit()
        if audited is not None:
            yield gauge("moetide_pool_invariants_ok", "1 if the block pool's invariants held when scraped.",
                        float(audited))
        yield counter("moetide_experts_staged", "Offloaded experts copied into a staging buffer (per layer routed).",
                      m.experts_staged)
        yield counter("moetide_experts_on_host", "Offloaded experts computed from their host copies (per layer).",
                      m.experts_on_host)
        yield counter("moetide_engine_steps", "Engine steps run.", num_steps)
        yield counter("moetide_engine_step_seconds", "Wall seconds inside engine steps.", step_wall_s)
        yield counter("moetide_engine_step_cpu_seconds", "Engine-thread CPU seconds inside engine steps.", step_cpu_s)
        # collect runs on the event loop (an async handler renders it): this is the HTTP thread's own CPU time
        yield counter("moetide_server_thread_cpu_seconds", "CPU seconds of the HTTP event-loop thread.",
                      time.thread_time())


class ServerMetrics:
    """The registry of one server; ``observe`` is the engine loop's observer. ``read`` gives the latest
    ``EngineMetrics``, ``steps`` the loop's (steps, step wall seconds, step CPU seconds)."""

    def __init__(self, model_name: str, read: Callable[[], EngineMetrics],
                 steps: Callable[[], tuple[int, float, float]]) -> None:
        self.registry = CollectorRegistry()
        labels = [model_name, "0"]
        self.invariants_ok: bool | None = None  # set by the /metrics route from the engine loop's audit
        self.registry.register(_EngineCollector(read, labels, steps, lambda: self.invariants_ok))

        def histogram(name: str, doc: str, buckets: tuple[float, ...]):
            return Histogram(name, doc, LABELS, buckets=buckets, registry=self.registry).labels(*labels)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()):
            return Counter(name, doc, LABELS + extra, registry=self.registry)

        self.ttft = histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              TIME_TO_FIRST_TOKEN_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             INTER_TOKEN_LATENCY_BUCKETS)
        self.tpot = histogram("vllm:request_time_per_output_token_seconds",
                              "Histogram of time_per_output_token_seconds per request.", INTER_TOKEN_LATENCY_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             REQUEST_LATENCY_BUCKETS)
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.").labels(*labels)
        self.generation_tokens = counter("vllm:generation_tokens",
                                         "Number of generation tokens processed.").labels(*labels)
        success = counter("vllm:request_success", "Count of successfully processed requests.", ("finished_reason",))
        self.success = {reason: success.labels(*labels, reason) for reason in FINISH_REASONS}

    def observe(self, handle: RequestHandle, event: TokenEvent, now_s: float) -> None:
        if event.token_ids:
            self.generation_tokens.inc(len(event.token_ids))
            if handle.num_output_tokens == len(event.token_ids):
                self.ttft.observe(now_s - handle.arrival_s)
                self.prompt_tokens.inc(len(handle.prompt_token_ids))
            elif handle.prev_token_s is not None:
                self.itl.observe(now_s - handle.prev_token_s)
        if event.finish_reason is None:
            return
        self.success["error" if event.finish_reason == "failed" else event.finish_reason].inc()
        if event.finish_reason in ("stop", "length"):
            self.e2e.observe(now_s - handle.arrival_s)
            if handle.num_output_tokens > 1:
                self.tpot.observe((handle.last_token_s - handle.first_token_s) / (handle.num_output_tokens - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
