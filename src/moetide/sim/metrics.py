"""Replay metrics in vLLM's definitions (``vllm bench serve``), plus the memory counters this project is about.

* TTFT: first output token time − arrival (queueing, prefill and any recompute included).
* TPOT: (last token time − first token time) / (output tokens − 1), per request with ≥ 2 output tokens.
* ITL: every gap between consecutive output tokens of a request, pooled over requests.
* E2E: last token time − arrival.
* request throughput: completed requests / (last completion − first arrival); output tokens/s likewise.
* prefix-hit rate: prompt tokens found in the prefix cache when a request was first scheduled / prompt tokens.
* recomputed tokens: tokens computed again after a preemption freed them.
Percentiles interpolate linearly between order statistics (numpy's default), so they match ``vllm bench``.
"""

from __future__ import annotations

import math
from array import array
from bisect import bisect_right
from itertools import accumulate
from operator import mul
from collections.abc import Sequence

from moetide.core.request import Request


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """q in [0, 100]; linear interpolation between closest ranks."""
    if not sorted_values:
        return math.nan
    pos = (len(sorted_values) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def weighted_summary(values: Sequence[float], weights: Sequence[int]) -> dict[str, float | None]:
    """``summary`` of the multiset holding each value ``weight`` times, without expanding it: the same
    percentiles (ranks located by cumulative weight), and the mean as fsum of value x weight (each product rounded
    once, so it may differ from the expanded mean in the last bits)."""
    total = sum(weights)
    if not total:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    order = sorted(range(len(values)), key=values.__getitem__)
    ordered_values = [values[i] for i in order]
    cumulative = list(accumulate(weights[i] for i in order))  # cumulative[j]: ranks below the j-th value's end

    def at(rank: int) -> float:
        return ordered_values[bisect_right(cumulative, rank)]

    out: dict[str, float | None] = {"mean": math.fsum(map(mul, values, weights)) / total}
    for q in (50, 90, 99):
        pos = (total - 1) * q / 100.0
        lo = math.floor(pos)
        lo_value = at(lo)
        out[f"p{q}"] = lo_value + (at(min(lo + 1, total - 1)) - lo_value) * (pos - lo)
    return out


def summary(values: Sequence[float]) -> dict[str, float | None]:
    ordered = sorted(values)
    if not ordered:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    return {
        "mean": math.fsum(ordered) / len(ordered),
        "p50": percentile(ordered, 50),
        "p90": percentile(ordered, 90),
        "p99": percentile(ordered, 99),
    }


class MetricsCollector:
    """Per-request timestamps and run-wide counters, fed by the replay loop."""

    MAX_USAGE_SAMPLES = 2048

    def __init__(self) -> None:
        self.first_token_s: dict[str, float] = {}
        self.last_token_s: dict[str, float] = {}
        self.ttft = array("d")
        self.tpot = array("d")
        self.itl = array("d")  # distinct gaps of a step, each with how many requests had it (itl_weight)
        self.itl_weight = array("q")
        self.e2e = array("d")
        self.first_arrival_s: float | None = None
        self.last_finish_s = 0.0
        self.completed = 0
        self.failed = 0
        self.prompt_tokens = 0
        self.cached_prompt_tokens = 0
        self.output_tokens = 0
        self.recomputed_tokens = 0
        self.preemptions = 0
        self.evicted_blocks = 0
        self.steps = 0
        self.busy_s = 0.0
        self.usage_every = 1
        self.kv_usage: list[tuple[float, float]] = []  # (time, used share of the pool)
        self.offload_usage: list[tuple[float, float]] = []  # (time, offloaded share of routed-expert bytes)
        self.preemption_usage: list[tuple[float, int]] = []  # (time, preemptions so far)
        self.offloaded_ratio_max = 0.0
        self.staged_bytes = 0.0
        self.offloads = 0
        self.reclaims = 0

    def arrived(self, arrival_s: float) -> None:
        if self.first_arrival_s is None or arrival_s < self.first_arrival_s:
            self.first_arrival_s = arrival_s

    def tokens(self, requests: Sequence[Request], now_s: float) -> None:
        first, last = self.first_token_s, self.last_token_s
        gaps: dict[float, int] = {}
        for request in requests:
            rid = request.request_id
            prev = last.get(rid)
            if prev is None:
                first[rid] = now_s
                self.ttft.append(now_s - request.arrival_s)
            else:
                gap = now_s - prev
                gaps[gap] = gaps.get(gap, 0) + 1
            last[rid] = now_s
        for gap, count in gaps.items():
            self.itl.append(gap)
            self.itl_weight.append(count)

    def decode_run(self, requests: Sequence[Request], step_ends_s: Sequence[float]) -> None:
        """``tokens(requests, t)`` for each t of a run of steps in which the same requests each emit one token:
        after the first step every request's gap is the step's length, so each step adds one weighted gap."""
        if not step_ends_s:
            return
        self.tokens(requests, step_ends_s[0])
        n = len(requests)
        prev = step_ends_s[0]
        for now_s in step_ends_s[1:]:
            self.itl.append(now_s - prev)
            self.itl_weight.append(n)
            prev = now_s
        last = self.last_token_s
        for request in requests:
            last[request.request_id] = prev

    def finished(self, request: Request, now_s: float) -> None:
        rid = request.request_id
        first = self.first_token_s.pop(rid)
        self.last_token_s.pop(rid, None)
        self.completed += 1
        self.output_tokens += request.num_output_tokens
        if request.num_output_tokens > 1:
            self.tpot.append((now_s - first) / (request.num_output_tokens - 1))
        self.e2e.append(now_s - request.arrival_s)
        self._count_prompt(request)
        self.last_finish_s = max(self.last_finish_s, now_s)

    def failed_request(self, request: Request, now_s: float) -> None:
        self.failed += 1
        self.first_token_s.pop(request.request_id, None)
        self.last_token_s.pop(request.request_id, None)
        self.last_finish_s = max(self.last_finish_s, now_s)

    def _count_prompt(self, request: Request) -> None:
        self.prompt_tokens += request.num_prompt_tokens
        self.cached_prompt_tokens += request.num_cached_prompt_tokens or 0
        self.recomputed_tokens += request.num_recomputed_tokens

    def step(self, now_s: float, duration_s: float, used_share: float, offloaded_ratio: float = 0.0,
             preemptions: int = 0) -> None:
        self.steps += 1
        self.busy_s += duration_s
        if offloaded_ratio > self.offloaded_ratio_max:
            self.offloaded_ratio_max = offloaded_ratio
        if self.steps % self.usage_every == 0:
            self.kv_usage.append((now_s, used_share))
            self.offload_usage.append((now_s, offloaded_ratio))
            self.preemption_usage.append((now_s, preemptions))
            if len(self.kv_usage) >= self.MAX_USAGE_SAMPLES:
                self.kv_usage = self.kv_usage[::2]
                self.offload_usage = self.offload_usage[::2]
                self.preemption_usage = self.preemption_usage[::2]
                self.usage_every *= 2

    def to_dict(self) -> dict[str, object]:
        start = self.first_arrival_s or 0.0
        duration = max(self.last_finish_s - start, 1e-12)
        return {
            "ttft_s": summary(self.ttft),
            "tpot_s": summary(self.tpot),
            "itl_s": weighted_summary(self.itl, self.itl_weight),
            "e2e_s": summary(self.e2e),
            "request_throughput_per_s": self.completed / duration,
            "output_tokens_per_s": self.output_tokens / duration,
            "prefix_hit_rate": self.cached_prompt_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
            "recomputed_tokens": self.recomputed_tokens,
            "preemptions": self.preemptions,
            "evicted_blocks": self.evicted_blocks,
            "completed": self.completed,
            "failed": self.failed,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "duration_s": duration,
            "steps": self.steps,
            "busy_s": self.busy_s,
            "kv_usage_max": max((u for _, u in self.kv_usage), default=0.0),
            "offloaded_ratio_max": self.offloaded_ratio_max,
            "staged_bytes": self.staged_bytes,
            "offloads": self.offloads,
            "reclaims": self.reclaims,
        }
