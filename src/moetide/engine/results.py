"""What the engine reports: each request's output, a ``generate`` call's result and counters, one ``step``'s
tokens, and the lifetime counters a server exports (``EngineMetrics``)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class RequestOutput:
    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: str  # "length", "stop" (an eos token), or "failed" (can never fit the KV budget)


@dataclass
class EngineStats:
    """Counters of one ``generate`` call (``experts_offloaded``, ``kv_blocks``: levels at its end)."""

    steps: int = 0
    prefix_evictions: int = 0  # cached-free blocks evicted
    preemptions: int = 0
    experts_offloaded: int = 0
    expert_reclaims: int = 0  # regions given back to their experts (vamp-reclaim)
    experts_staged: int = 0  # offloaded experts copied into a staging buffer (one per layer that routed to them)
    experts_on_host: int = 0  # offloaded experts computed from their host copies instead (``cold_experts="cpu"``)
    offloaded_ratio: float = 0.0
    kv_blocks: int = 0
    kv_blocks_at_start: int = 0  # the pool's size when the call began: it differs from kv_blocks when the line moved
    prefix_hit_tokens: int = 0  # tokens found in the prefix cache when a request was (re)admitted
    recomputed_tokens: int = 0  # tokens computed again after a preemption
    failed_requests: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_tokens: int = 0  # tokens of steps that were not pure decode
    prefill_s: float = 0.0
    decode_tokens: int = 0
    decode_s: float = 0.0
    wall_s: float = 0.0
    kv_host_blocks: int = 0  # host KV capacity in blocks (0: no host KV); ``kv_blocks`` counts them too
    split_policy: str | None = None  # with host KV: the split policy
    host_bound_waits: int = 0  # admissions deferred by the host KV bound (``kv_host_active_bytes``)
    host_blocks_promoted: int = 0  # host prefix hits past that bound copied to device blocks
    host_hits_recomputed: int = 0  # host prefix hits past that bound that could not be copied: recomputed
    split: dict = field(default_factory=dict)  # with host KV: ``SplitCounters`` of this call


@dataclass(frozen=True)
class EngineMetrics:
    """Levels (``num_*``, usage, ratios) and lifetime counters of an engine, for a server's ``/metrics``.
    ``kv_cache_usage`` is the share of device KV blocks in use (vLLM's ``kv_cache_usage_perc``, a 0-1 fraction)."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_preemptions: int
    prefix_query_tokens: int
    prefix_hit_tokens: int
    offloaded_ratio: float
    experts_offloaded: int
    kv_host_blocks: int
    kv_host_blocks_used: int
    experts_staged: int
    experts_on_host: int
    kv_blocks_held: int = 0  # blocks some request holds (device and host); 0 once every request has left


@dataclass
class GenerateResult:
    outputs: list[RequestOutput]
    stats: EngineStats = field(default_factory=EngineStats)


@dataclass(frozen=True)
class StepOutput:
    """What one ``step`` did for one request: the tokens it emitted (zero or one today) and whether it ended."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None  # None while it runs; else as ``RequestOutput.finish_reason``
