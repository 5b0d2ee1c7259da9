"""The line's Prometheus series beside vLLM's own, through vLLM's KV-connector stats channel.

The scheduler's connector reports ``MoetideConnectorStats`` every step (``get_kv_connector_stats``); vLLM carries
them in ``SchedulerStats`` to the API server, whose Prometheus logger hands them to ``MoetidePromMetrics`` (the
connector's ``build_prom_metrics``). Series, each labelled like vLLM's (model name, engine):

* ``moetide:expert_offload_ratio`` (gauge): the share of routed experts whose memory the KV cache holds now.
* ``moetide:kv_blocks_granted`` (gauge): KV blocks the line has granted and not taken back.
* ``moetide:line_moves_total`` (counter): regions granted plus regions given back.
* ``moetide:line_returns_total`` (counter): of those, the regions given back to their experts.
* ``moetide:stagings_total``, ``moetide:staged_bytes_total`` (counters): offloaded experts the pager copied from
  their host copies into staging slots, and their bytes, summed over the workers (each tensor-parallel rank
  stages its own shard).
* ``moetide:unstaged_total`` (counter): offloaded experts routed in a step but not staged, plus MoE layers whose
  pager did not run in a step that ran the model while experts were out (``vllm.pager``). Their tokens were
  computed from memory lent to the KV cache: it must stay 0.
* With a host KV tier (``vllm.host_tier``): ``moetide:kv_host_blocks_written_total`` (counter): KV blocks written
  to host memory, summed over the workers (each tensor-parallel rank writes its own shard of a block);
  ``moetide:kv_host_blocks_used`` (gauge): host blocks the last step that had any attended;
  ``moetide:kv_host_cpu_share`` (gauge): the share of them the CPU attended in place (the rest were streamed);
  ``moetide:kv_host_correction_factor`` (gauge): writescope's online correction of the CPU's modeled time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.metrics.utils import create_metric_per_engine

SERIES = {  # name (after "moetide:") -> (kind, documentation); a gauge's latest value wins, a counter is summed
    # over the interval and the workers
    "expert_offload_ratio": ("gauge", "Share of routed experts whose memory moetide's line has given to the KV cache."),
    "kv_blocks_granted": ("gauge", "KV cache blocks moetide's line has granted and not taken back."),
    "line_moves": ("counter", "Moves of moetide's line: regions granted to the KV cache plus regions given back."),
    "line_returns": ("counter", "Regions moetide's line gave back to their experts (of its moves)."),
    "stagings": ("counter", "Offloaded experts staged from their host copies when routed (all workers)."),
    "staged_bytes": ("counter", "Bytes of offloaded experts staged from their host copies (all workers)."),
    "unstaged": ("counter", "Offloaded experts routed but not staged, or MoE layers whose expert pager did not run "
                            "while experts were out (all workers). Must stay 0."),
    "kv_host_blocks_written": ("counter", "KV blocks written to moetide's host KV tier (all workers)."),
    "kv_host_blocks_used": ("gauge", "Host KV blocks the last step with any attended."),
    "kv_host_cpu_share": ("gauge", "Share of those host KV blocks the CPU attended in place (the rest were "
                                   "streamed)."),
    "kv_host_correction_factor": ("gauge", "The split planner's online correction of the CPU's modeled attention "
                                           "time."),
}
GAUGES = tuple(key for key, (kind, _) in SERIES.items() if kind == "gauge")
COUNTERS = tuple(key for key, (kind, _) in SERIES.items() if kind == "counter")


@dataclass
class MoetideConnectorStats(KVConnectorStats):
    data: dict[str, Any] = field(default_factory=dict)

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        merged = dict(self.data)
        for key, value in other.data.items():
            merged[key] = merged.get(key, 0) + value if key in COUNTERS else value
        return MoetideConnectorStats(merged)

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not self.data


def line_stats(books, reported: tuple[int, int]) -> MoetideConnectorStats:
    """One step's report: the gauges now, the moves and returns since ``reported`` (``line_counts`` then)."""
    moves, returns = line_counts(books)
    return MoetideConnectorStats({
        "expert_offload_ratio": books.expert_offload_ratio,
        "kv_blocks_granted": books.num_kv_blocks_granted,
        "line_moves": moves - reported[0],
        "line_returns": returns - reported[1],
    })


def line_counts(books) -> tuple[int, int]:
    """The line's moves and returns so far."""
    return books.num_line_moves, books.num_line_returns


class MoetidePromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config, metric_types, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.series = {
            key: self._gauge_cls(name=f"moetide:{key}", labelnames=labelnames, multiprocess_mode="mostrecent",
                                 documentation=text) if key in GAUGES else
            self._counter_cls(name=f"moetide:{key}", labelnames=labelnames, documentation=text)
            for key, (_, text) in SERIES.items()}
        self.per_engine = {key: create_metric_per_engine(metric, per_engine_labelvalues)
                           for key, metric in self.series.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key in GAUGES:
            if key in transfer_stats_data:
                self.per_engine[key][engine_idx].set(transfer_stats_data[key])
        for key in COUNTERS:
            amount = transfer_stats_data.get(key, 0)
            if amount:
                self.per_engine[key][engine_idx].inc(amount)
