"""moetide's KV connector: how line moves travel from vLLM's scheduler to its workers, through vLLM's own channel.

vLLM ships a connector's metadata inside every step's ``SchedulerOutput``, to every worker, in-process or across
its multiprocessing. The scheduler side here carries the plugin's settings and drains the line's queued
``LineOp``s into each step's metadata; each worker applies them to its KV backing (``vllm.backing``) as the step
starts (``vllm.plugin`` patches the runner's ``execute_model`` for that: the connector's ``start_load_kv`` runs
after the forward of a step that loads nothing), so a granted block is backed before any kernel zeroes or writes
it, and a given-back one is released only once no request holds it.

It loads no KV and saves none (``get_num_new_matched_tokens`` is ``(0, False)``, frees are never deferred), so vLLM
schedules exactly as without a connector. ``SupportsHMA`` lets vLLM keep its hybrid allocator, which hybrid
models (Qwen3-Next's Gated DeltaNet groups) need to start at all.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from moetide.vllm.line import LineOp
from moetide.vllm.plugin import check_supported, plugin_settings, refuse_unsupported_mode


class MoetideConnectorMetadata(KVConnectorMetadata):
    """One step's line moves, in the order the scheduler made them (plain data: it crosses processes)."""

    def __init__(self, line_ops: tuple[LineOp, ...] = ()) -> None:
        self.line_ops = line_ops


class MoetideConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None) -> None:
        check_supported()
        super().__init__(vllm_config, role, kv_cache_config)
        self.settings = plugin_settings(vllm_config)
        refuse_unsupported_mode(vllm_config, self.settings)
        if role == KVConnectorRole.SCHEDULER:
            from moetide.vllm.scheduler import refuse_foreign_scheduler

            refuse_foreign_scheduler(vllm_config.scheduler_config.get_scheduler_cls())
        self._line = None  # scheduler side: the LineBooks whose ops go out
        self._reported = (0, 0)  # line moves and returns already reported in the stats

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # nothing is handed off: a preempted request is recomputed as without a connector

    # ---- scheduler side -----------------------------------------------------------------------------------
    def bind_line(self, books) -> None:
        self._line = books

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        return None

    def update_connector_output(self, connector_output) -> None:
        """The workers' routing of the step (in their stats) goes to the line's ``ExpertResidency``, and is taken
        out of the stats, which go on to the API server."""
        from moetide.vllm.metrics import MoetideConnectorStats

        stats = connector_output.kv_connector_stats
        if self._line is not None and isinstance(stats, MoetideConnectorStats) and "routing" in stats.data:
            self._line.record_routing(stats.data.pop("routing"))

    def build_connector_meta(self, scheduler_output) -> MoetideConnectorMetadata:
        ops = tuple(self._line.take_ops()) if self._line is not None else ()
        return MoetideConnectorMetadata(ops)

    def get_kv_connector_stats(self):
        """Every step: on the scheduler, the line's gauges and new moves; on a worker, the expert pager's new
        stagings and unstaged experts and the host tier's step (vLLM sums the workers' and adds the scheduler's,
        ``vllm.metrics``) and, where it counts routing, the step's routing (``update_connector_output`` takes it)."""
        from moetide.vllm import host_tier, pager
        from moetide.vllm.metrics import MoetideConnectorStats, line_counts, line_stats

        if self._line is not None:
            stats = line_stats(self._line, self._reported)
            self._reported = line_counts(self._line)
            return stats
        if self.role != KVConnectorRole.WORKER:
            return None
        tier = host_tier.installed()
        return MoetideConnectorStats({**pager.STEPS.take(), **(tier.take_step_stats() if tier is not None else {})})

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None):
        from moetide.vllm.metrics import MoetideConnectorStats

        return MoetideConnectorStats(dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        from moetide.vllm.metrics import MoetidePromMetrics

        return MoetidePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def request_finished(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        return False, None

    def request_finished_all_groups(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        return False, None

    # ---- worker side: nothing to load or save (the line ops are applied as the step starts) --------------
    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None
