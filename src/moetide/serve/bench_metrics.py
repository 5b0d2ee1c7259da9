"""The benchmark's summary, defined as vLLM's ``calculate_metrics`` (``vllm/benchmarks/serve.py``, 0.32) defines it.

Over successful requests: TTFT per request; TPOT = (latency - TTFT) / (output tokens - 1) for requests with more
than one output token; ITL = every gap between consecutive streamed chunks, pooled over requests; e2e = latency.
Throughputs divide by the whole benchmark's duration: requests, output tokens, input plus output tokens per second.
``max_output_tokens_per_s`` and ``max_concurrent_requests`` bucket token times and request spans by whole seconds
from the first send, as vLLM does; the peak is at least the mean output rate (a run shorter than a second has one
partial bucket, whose count would read below the mean). Means, medians, population standard deviations and
percentiles (linear interpolation, numpy's default) in milliseconds, under vLLM's JSON names (``mean_ttft_ms``,
``p99_itl_ms``, ...). Pure standard library.
"""

from __future__ import annotations

import math
import statistics

from moetide.serve.bench_client import RequestResult

METRICS = ("ttft", "tpot", "itl", "e2el")
DEFAULT_PERCENTILES = (50.0, 90.0, 99.0)


def percentile(values: list[float], p: float) -> float:
    """numpy.percentile(values, p) with its default (linear) interpolation; 0 for no values, as vLLM's ``or 0``."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = (len(ordered) - 1) * p / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def _summary(name: str, values_s: list[float], percentiles: tuple[float, ...]) -> dict[str, float]:
    ms = [v * 1000 for v in values_s]
    out = {f"mean_{name}_ms": statistics.fmean(ms) if ms else 0.0,
           f"median_{name}_ms": statistics.median(ms) if ms else 0.0,
           f"std_{name}_ms": statistics.pstdev(ms) if ms else 0.0}
    for p in percentiles:
        out[f"p{p:g}_{name}_ms"] = percentile(ms, p)
    return out


def _peaks(done: list[RequestResult]) -> tuple[float, int]:
    """(max output tokens in one second, max requests active in one second), bucketed as vLLM buckets them."""
    if not done:
        return 0.0, 0
    first = min(r.start_s for r in done)
    num_seconds = math.ceil(max(r.start_s + r.latency_s for r in done) - first) + 1
    tokens, active = [0] * num_seconds, [0] * num_seconds
    for r in done:
        t = r.start_s + r.ttft_s
        times = [t]
        for gap in r.itl_s:
            t += gap
            times.append(t)
        for t in times:
            second = int(t - first)
            if 0 <= second < num_seconds:
                tokens[second] += 1
        for second in range(int(r.start_s - first), int(r.start_s + r.latency_s - first) + 1):
            active[second] += 1
    return float(max(tokens)), max(active)


def calculate_metrics(results: list[RequestResult], duration_s: float,
                      percentiles: tuple[float, ...] = DEFAULT_PERCENTILES) -> dict:
    done = [r for r in results if r.success]
    ttfts = [r.ttft_s for r in done]
    tpots = [(r.latency_s - r.ttft_s) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    itls = [gap for r in done for gap in r.itl_s]
    e2els = [r.latency_s for r in done]
    total_input = sum(r.prompt_len for r in done)
    total_output = sum(r.output_tokens for r in done)
    max_tokens_per_s, max_concurrent = _peaks(done)
    metrics = {"duration": duration_s, "completed": len(done), "failed": len(results) - len(done),
               "total_input_tokens": total_input, "total_output_tokens": total_output,
               "request_throughput": len(done) / duration_s, "output_throughput": total_output / duration_s,
               "total_token_throughput": (total_input + total_output) / duration_s,
               "max_output_tokens_per_s": max(max_tokens_per_s, total_output / duration_s),
               "max_concurrent_requests": max_concurrent}
    for name, values in zip(METRICS, (ttfts, tpots, itls, e2els)):
        metrics.update(_summary(name, values, percentiles))
    return metrics


def per_request(results: list[RequestResult]) -> dict[str, list]:
    """vLLM's per-request arrays in its result JSON (seconds, as vLLM writes them; ``start_times`` from the first
    send; ``generated_texts``, the streamed outputs, by which two servers' runs are checked for equal text)."""
    first = min((r.start_s for r in results), default=0.0)
    return {"request_ids": [r.request_id for r in results], "input_lens": [r.prompt_len for r in results],
            "output_lens": [r.output_tokens if r.success else 0 for r in results],
            "start_times": [r.start_s - first for r in results], "ttfts": [r.ttft_s for r in results],
            "itls": [r.itl_s for r in results], "e2els": [r.latency_s for r in results],
            "errors": [r.error for r in results], "generated_texts": [r.text for r in results]}
