"""The core's state inside vLLM's engine core: the policy, the expert line over vLLM's pool, the step costs.

``LineBooks`` is built once per scheduler from the plugin's settings, the model's experts and vLLM's KV cache
config, with the same builders as the replay's and the engine's (``core.config``). It owns nothing of vLLM's; the
scheduler (``vllm.scheduler``) asks it at each allocation that cannot be met from never-cached free blocks and
carries out its plan on vLLM's pool. What the line does is queued as ``LineOp``s for the workers.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from moetide.core.config import expert_residency, make_policy
from moetide.core.expert_line import ByteLayout, ExpertLine
from moetide.core.experts import ExpertKey, ExpertResidency
from moetide.core.pressure import policy_entry, start_offload
from moetide.core.pressure.step_costs import ASSUMED_FLOPS, EngineCosts, RecordSteps, engine_vamp_params
from moetide.errors import UserError
from moetide.specs.hf_config import model_from_hf_dict
from moetide.specs.model import ModelSpec
from moetide.vllm.line_memory import lendable_bytes
from moetide.vllm.settings import WHERE, ExpertShape, PluginSettings

logger = logging.getLogger(__name__)
FP8_QUANTIZATIONS = ("fp8", "compressed-tensors")  # the checkpoints whose experts the pager pages in FP8
HOST_COPY_BYTES_PER_S = 10e9  # default copy speed of a host expert into its staging slot, when no record gives it


@dataclass(frozen=True)
class LineOp:
    """One move of the line, as the workers apply it before the step's forward: ``grow`` gives the block ids to
    the KV cache (the region's experts are served from host copies), else takes them back to the experts."""

    grow: bool
    block_ids: tuple[int, ...]
    region: tuple[ExpertKey, ...]


@dataclass
class LineStep:
    """What the policy did in one scheduler step (plain data, for tests and metrics)."""

    num_evicted: int = 0
    offloaded: list[ExpertKey] = field(default_factory=list)
    reclaimed: int = 0  # regions given back


def model_spec(hf_config: dict) -> ModelSpec:
    """moetide's model spec from the Hugging Face config vLLM loaded (``specs.hf_config``)."""
    return model_from_hf_dict(hf_config, hf_config.get("model_type", "model"), "the model's config.json")


def expert_shape(spec: ModelSpec, tensor_parallel_size: int = 1, dtype_bytes: int = 2,
                 granule: int | None = None) -> ExpertShape:
    """The routed experts of one rank; an expert's bytes are split over the tensor-parallel ranks. With a
    ``granule`` (the device maps memory in granules: ``vllm.vmm``) an expert is worth to the KV cache what its rows
    surely free: the whole granules inside its ``w13`` and ``w2`` rows (``line_memory.lendable_bytes``)."""
    expert_bytes = max(spec.expert_bytes(dtype_bytes) // tensor_parallel_size, 1)
    if granule is not None:
        w2_row = spec.hidden_size * spec.moe_intermediate_size * dtype_bytes // tensor_parallel_size
        expert_bytes = lendable_bytes(2 * w2_row, granule) + lendable_bytes(w2_row, granule)
    return ExpertShape(num_layers=spec.num_moe_layers, num_experts=spec.num_experts,
                       experts_per_token=spec.num_experts_per_tok, expert_bytes=expert_bytes)


def model_experts(settings: PluginSettings, vllm_config) -> tuple[ExpertShape | None, int | None]:
    """The routed experts of one rank (the settings' own, else read from vLLM's model config) and the model's
    active parameters (None when the settings give both experts and costs, so the config need not be read): what the
    engine core's sizing, the scheduler and the workers all derive the line from. A policy that never offloads reads
    nothing of the model (``(None, None)``): it serves any model vLLM serves, dense ones included. ``ValueError`` in
    one line naming the ``experts`` setting where an offloading policy cannot read the model's experts."""
    if not policy_entry(settings.policy).offloads_experts:
        return None, None
    if settings.experts is not None and settings.costs is not None:
        return settings.experts, None
    model = vllm_config.model_config
    try:
        spec = model_spec(model.hf_config.to_dict())
    except (UserError, ValueError) as exc:  # ModelSpec checks its own fields too
        raise ValueError(f"moetide: policy {settings.policy!r} offloads experts, but the model's experts cannot be "
                         f"read ({exc}): give them as {WHERE}.experts and .costs, or use policy 'vllm'") from None
    if not spec.num_experts:
        raise ValueError(f"moetide: policy {settings.policy!r} offloads experts, and the model's config names no "
                         f"routed experts: it is dense; use policy 'vllm' (or give {WHERE}.experts)")
    shape = settings.experts or expert_shape(spec, vllm_config.parallel_config.tensor_parallel_size,
                                             expert_dtype_bytes(model), device_granule(settings))
    return shape, spec.params_active


def expert_dtype_bytes(model_config) -> int:
    """Bytes of one expert weight: 1 in an FP8 checkpoint, else the model's dtype."""
    return 1 if model_config.quantization in FP8_QUANTIZATIONS else model_config.dtype.itemsize


def device_granule(settings: PluginSettings) -> int | None:
    """The granule the line's memory moves in on this platform (``line_memory.line_granule``), or None where it
    moves pages, small enough to count an expert's bytes whole (the CPU's default)."""
    from vllm.platforms import current_platform

    from moetide.vllm.line_memory import line_granule

    return line_granule(settings, current_platform.device_type)


def kv_block_bytes(kv_cache_config) -> int:
    """Bytes one block id takes over every layer: the KV backing over the blocks (every ``KVCacheTensor`` names the
    one backing allocation's size), or (a config with no tensors, as a scheduler-only test builds) the largest
    group's layers times the page size."""
    tensors = kv_cache_config.kv_cache_tensors
    if tensors:
        return tensors[0].size // kv_cache_config.num_blocks
    groups = kv_cache_config.kv_cache_groups
    return max(len(g.layer_names) for g in groups) * max(g.kv_cache_spec.page_size_bytes for g in groups)


def line_max_offloaded(settings: PluginSettings, shape: ExpertShape | None) -> int:
    """Experts the offload cap lets out at once, over every layer (0 for a policy that never offloads, whose shape
    is None: ``model_experts``)."""
    if shape is None or not policy_entry(settings.policy).offloads_experts:
        return 0
    return expert_residency(settings.serving_config(), num_layers=shape.num_layers, num_experts=shape.num_experts,
                            expert_bytes=shape.expert_bytes).max_num_offloaded


def line_reserve_blocks(settings: PluginSettings, shape: ExpertShape | None, block_bytes: int) -> int:
    """Blocks the whole offload cap can add: the ids the pool is built with beyond its base (none for a policy
    that never offloads)."""
    num_experts = line_max_offloaded(settings, shape)
    return num_experts * shape.expert_bytes // block_bytes if num_experts else 0


def plugin_costs(settings: PluginSettings, shape: ExpertShape, active_params: int | None) -> EngineCosts:
    """The cost record: the settings' own, else priced as moetide's engine prices a step (2 FLOP per active
    parameter at ``ASSUMED_FLOPS``) with a host copy at ``HOST_COPY_BYTES_PER_S`` (both modeled)."""
    if settings.costs is not None:
        try:
            return EngineCosts(**settings.costs)
        except TypeError as exc:
            raise ValueError(f"kv_transfer_config.kv_connector_extra_config.costs: {exc}") from None
    if active_params is None:
        raise ValueError("kv_transfer_config.kv_connector_extra_config.costs is needed: the model's active "
                         "parameters are unknown")
    return EngineCosts(prefill_s_per_token=2.0 * active_params / ASSUMED_FLOPS,
                       copy_s_per_expert=shape.expert_bytes / HOST_COPY_BYTES_PER_S)


class LineBooks:
    """The policy, the line over vLLM's pool (``vllm.pool.VllmPool``), the steps' costs and the clock. For a
    policy that never offloads, ``shape`` and ``costs`` are None (``model_experts``): there is no line, nothing is
    priced, and the policy's clock is the wall clock."""

    def __init__(self, settings: PluginSettings, shape: ExpertShape | None, pool, *, block_bytes: int,
                 block_size: int, max_num_batched_tokens: int, costs: EngineCosts | None) -> None:
        self.settings = settings
        config = settings.serving_config()
        self.pool = pool
        self.residency: ExpertResidency | None = None
        self.line: ExpertLine | None = None
        self.steps: RecordSteps | None = None
        if shape is not None:
            self.residency = expert_residency(config, num_layers=shape.num_layers, num_experts=shape.num_experts,
                                              expert_bytes=shape.expert_bytes)
            layout = ByteLayout(pool, block_bytes=block_bytes, kv_bytes_per_expert=shape.expert_bytes,
                                first_block_id=pool.num_blocks + 1)
            self.line = ExpertLine(self.residency, layout)
            self.steps = RecordSteps(costs, self.residency, shape.experts_per_token)
        self.policy = make_policy(config, costs=lambda: engine_vamp_params(
            self.steps, block_size=block_size, chunk_tokens=max_num_batched_tokens, horizon_s=config.vamp_horizon_s))
        self._started = time.monotonic()
        self.ops: list[LineOp] = []  # for the workers, drained by the connector's metadata
        self.step = LineStep()
        self.num_evicted_blocks = 0
        self.num_line_moves = 0
        self.num_line_returns = 0  # of the moves, regions given back to their experts
        self.num_steps = 0
        self._cycling: list[int] | None = None  # line_cycle_steps: the region being given back
        self._warned_routing = False
        self.num_routed_steps = 0  # steps whose routing the workers reported
        start_offload(self.policy, self.line)
        if self.line is not None and self.line.residency.num_offloaded:
            region, ids = self.line.last_region()
            self._moved(LineOp(True, tuple(ids), tuple(region)))

    @property
    def now_s(self) -> float:
        if self.steps is not None and self.settings.clock == "modeled":
            return self.steps.busy_s()
        return time.monotonic() - self._started

    @property
    def expert_offload_ratio(self) -> float:
        """Share of routed experts whose memory the line has given the KV cache."""
        if self.residency is None:
            return 0.0
        config = self.residency.config
        return self.residency.num_offloaded / (config.num_layers * config.num_experts)

    def begin_step(self) -> None:
        """Before the step is scheduled: the policy may give a drained region back."""
        self.step = LineStep()
        if self.line is None:
            return
        last = self.line.last_region()
        if self.policy.maybe_reclaim(self.line, self.pool, self.now_s):
            self._reclaimed(last)
        if self.settings.line_cycle_steps:
            self._cycle()

    def record_routing(self, rows) -> None:
        """A step's routing as the workers counted it (tokens per expert, one row per MoE layer): the residency's
        hotness, so the next region offloaded is the coldest. A count of another shape than the line's experts
        (settings that give ``experts`` unlike the model's) is ignored, with one warning; so is any count without a
        line."""
        if self.residency is None:
            return
        config = self.residency.config
        if len(rows) != config.num_layers or any(len(row) != config.num_experts for row in rows):
            if not self._warned_routing:
                logger.warning("moetide: the workers count %d MoE layers of %d experts; the line has %d of %d: "
                               "routing not used", len(rows), len(rows[0]) if rows else 0, config.num_layers,
                               config.num_experts)
                self._warned_routing = True
            return
        for layer, row in enumerate(rows):
            self.residency.record_counts(layer, row)
        self.residency.end_step()
        self.num_routed_steps += 1

    def end_step(self, num_scheduled_tokens: int) -> None:
        if self.steps is not None:
            self.steps.record(num_scheduled_tokens)
        self.num_steps += 1

    def _reclaimed(self, last) -> None:
        region, ids = last
        self.step.reclaimed += 1
        self._moved(LineOp(False, tuple(ids), tuple(region)))

    def _cycle(self) -> None:
        """``line_cycle_steps`` (settings): start giving the last region back, or grow the line again, every that
        many steps; a region going back returns once every block of it has drained."""
        line, pool = self.line, self.pool
        if self._cycling is not None:
            if pool.num_drained_blocks >= len(self._cycling):
                last = line.last_region()
                if line.reclaim_last():
                    self._cycling = None
                    self._reclaimed(last)
            return
        if self.num_steps == 0 or self.num_steps % self.settings.line_cycle_steps:
            return
        last = line.last_region()
        if last is not None:
            self._cycling = list(last[1])
            pool.drain(self._cycling)
        else:
            residency = line.residency
            region = residency.next_offload_region(max_experts=residency.max_num_offloaded - residency.num_offloaded)
            if region:
                self.offload(region)

    def offload(self, region) -> int:
        """Carry out ``OffloadExperts``: the line gives the region's blocks to the pool; returns how many."""
        new_ids = self.line.offload(region)
        self.step.offloaded.extend(region)
        self._moved(LineOp(True, tuple(new_ids), tuple(tuple(k) for k in region)))
        return len(new_ids)

    def evict(self, num_blocks: int, protect) -> int:
        """Carry out ``EvictPrefix`` on vLLM's pool; returns the blocks evicted."""
        evicted = len(self.pool.evict(num_blocks, protect))
        self.step.num_evicted += evicted
        self.num_evicted_blocks += evicted
        return evicted

    def _moved(self, op: LineOp) -> None:
        self.ops.append(op)
        self.num_line_moves += 1
        self.num_line_returns += not op.grow

    def take_ops(self) -> list[LineOp]:
        ops, self.ops = self.ops, []
        return ops

    @property
    def num_kv_blocks_granted(self) -> int:
        """Blocks the line has given the KV cache and not taken back."""
        return 0 if self.line is None else self.line.num_granted_blocks
