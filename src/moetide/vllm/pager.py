"""The expert pager: vLLM's unquantized fused-MoE method with offloaded experts served from host copies.

vLLM 0.32 computes routing before the MoE method runs (``apply(layer, x, topk_weights, topk_ids, ...)``), and its
CPU kernels read an expert's prepacked weights as row ``topk_id`` of ``w13_weight``/``w2_weight`` (they ignore
``expert_map``). So a pager needs no kernel of its own: experts live in **slots** (rows), ``topk_ids`` is mapped
to slots, and an offloaded expert that a call routes to is copied from its host copy into its **staging slot**,
one of the rows after the experts' own, then computed there as if it were resident.

vLLM may compile the forward (its default: ``torch.compile`` on the CPU, where Dynamo traces through the MoE method,
and CUDA graphs on a GPU), so what runs inside ``apply`` is written for that (``vllm.staging``):

* Where the configured policy can offload (``max_offloaded_experts``), each layer gets its staging rows and its
  slot tables as its weights are processed, before vLLM compiles or captures anything, and they are never
  rebound. Where it cannot, ``apply`` is vLLM's, unchanged.
* ``apply`` calls one opaque op, ``moetide::page_experts(topk_ids, layer_name)``, on every call: Dynamo keeps it
  as one node and runs it each time, and its body (``ExpertSlots.route``) is fixed-shape tensor work that reads
  the slot tables as they are then, so a CUDA graph that captured it replays it right after any line move.
* Which experts are offloaded is moetide's ``ExpertResidency``'s choice, made in the scheduler: the step's
  ``LineOp``s name the (MoE layer, expert) keys, and the worker hands them to ``apply_line_op`` before the
  forward, which rewrites the slot tables in place.
* On the CPU each layer's weights live in shared memory (``vllm.shared_rows.SharedRows``). An offloaded expert's home
  rows are not read while it is out: their pages are lent to the KV cache (the backing maps them over the granted
  blocks), and the expert is written home from its copy once the backing has let go of them (``apply_line_op``
  orders the two). On CUDA host copies are pinned and the device rows are not lent yet (the CUDA backing maps
  fresh physical memory).
* Each step the worker reads the layers' counters once (``step_report``): stagings, the routing the scheduler's
  residency learns from, and the guard, **unstaged**: offloaded experts routed in a step but not staged, plus
  layers whose per-call path did not run in a step that ran the model while experts were out. It must stay 0.

``CustomOp.register_oot(name="UnquantizedFusedMoEMethod")`` makes vLLM build this class wherever it would build
its own (``register``, called once by the plugin).
"""

from __future__ import annotations

import logging
import re
import weakref

import torch
from vllm.config import get_current_vllm_config_or_none
from vllm.model_executor.custom_op import CustomOp
from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
from vllm.model_executor.utils import replace_parameter

from moetide.core.pressure import policy_entry
from moetide.vllm.shared_rows import PageRun, SharedRows, StagingArea
from moetide.vllm.line import LineOp, line_max_offloaded, model_experts
from moetide.vllm.plugin import plugin_settings
from moetide.vllm.staging import ExpertSlots, page_experts, take_counts

logger = logging.getLogger(__name__)
# this process's paged MoE layers (weakly: a model that is deleted takes its layers along)
_LAYERS: weakref.WeakSet[PagedUnquantizedFusedMoEMethod] = weakref.WeakSet()
_STAGING: dict[tuple[str, int], StagingArea] = {}  # (weight, row bytes) -> the staging rows every layer shares
_LAYER_NUMBER = re.compile(r"\.layers\.(\d+)\.")
WEIGHTS = ("w13_weight", "w2_weight")


class PagedUnquantizedFusedMoEMethod(UnquantizedFusedMoEMethod):
    """``UnquantizedFusedMoEMethod`` whose experts can be offloaded and staged back per call (module docstring)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.max_offloaded = max_offloaded_experts(get_current_vllm_config_or_none())
        self.line_enabled = self.max_offloaded > 0

    def process_weights_after_loading(self, layer) -> None:
        super().process_weights_after_loading(layer)
        self._layer = weakref.ref(layer)  # not an attribute module: the layer holds this method as a submodule
        self.layer_name = layer.layer_name
        match = _LAYER_NUMBER.search(f"{layer.layer_name}.")
        self.layer_number = int(match.group(1)) if match else len(_LAYERS)
        self.num_experts = layer.w13_weight.shape[0]
        self.rows: dict[str, SharedRows] | None = None
        self.shared_staging = False  # whether the staging rows are the shared area's (whole-page rows)
        self.slots: ExpertSlots | None = None
        self.peak_lent_bytes = 0  # the most ``lent_bytes`` has been
        self.num_staged = 0  # staged copies so far (the step costs' touches)
        self.staged_bytes = 0
        _LAYERS.add(self)
        if self.line_enabled:
            self._add_staging_rows(min(self.num_experts, self.max_offloaded))
            self.slots = ExpertSlots([layer.w13_weight.data, layer.w2_weight.data], self.num_experts,
                                     self.layer_name)

    def _add_staging_rows(self, num_slots: int) -> None:
        """The staging rows after the experts' own, once, before vLLM compiles the forward. On the CPU the weights
        move into shared memory (``vllm.shared_rows``) and the staging rows map onto the staging area every layer shares
        where rows are whole pages; elsewhere the weights are rebuilt with zero rows appended."""
        layer = self.layer
        if layer.w13_weight.device.type == "cpu":
            self.rows = {name: SharedRows(getattr(layer, name).data, self.num_experts + num_slots)
                         for name in WEIGHTS}
        self.shared_staging = self.rows is not None
        for name in WEIGHTS:
            if self.rows is not None:
                rows = self.rows[name]
                area = _STAGING.setdefault((name, rows.row_bytes), StagingArea(f"moetide-staging-{name}"))
                self.shared_staging = rows.share_rows(self.num_experts, num_slots, area) and self.shared_staging
                replace_parameter(layer, name, rows.view(self.num_experts + num_slots))
            else:
                weight = getattr(layer, name).data
                replace_parameter(layer, name, torch.cat([weight, weight.new_zeros((num_slots, *weight.shape[1:]))]))

    @property
    def layer(self):
        return self._layer()

    @property
    def offloaded(self) -> set[int]:
        return set(self.slots.out) if self.slots is not None else set()

    @property
    def num_staging_slots(self) -> int:
        return self.slots.num_slots if self.slots is not None else 0

    @property
    def lent_bytes(self) -> int:
        """Bytes of the offloaded experts' home-row pages, which the KV cache may hold now."""
        return sum(run.nbytes for expert in self.offloaded for run in self._pages(expert))

    def set_offloaded(self, experts: set[int]) -> list[PageRun]:
        """The layer's offloaded experts from now on; returns the pages of the experts going out, for the KV
        cache to take. An expert going out is copied to its slot's host rows first; one coming back is written
        home from them (after the KV cache has let go of its pages: ``apply_line_op``)."""
        if self.slots is None:
            raise ValueError(f"{self.layer_name}: the configured policy offloads no expert")
        lent: list[PageRun] = []
        for expert in sorted(self.offloaded - set(experts)):
            self.slots.bring_home(expert)
        for expert in sorted(set(experts) - self.offloaded):
            self.slots.take_out(expert)
            lent += self._pages(expert)
        self.peak_lent_bytes = max(self.peak_lent_bytes, self.lent_bytes)
        return lent

    def _pages(self, expert: int) -> list[PageRun]:
        """The whole pages of an expert's home rows (CPU; none elsewhere)."""
        if self.rows is None:
            return []
        return [run for rows in self.rows.values() if (run := rows.row_pages(expert)) is not None]

    @property
    def row_bytes(self) -> int:
        """One expert's bytes in this layer (its w13 and w2 rows)."""
        layer = self.layer
        return layer.w13_weight[0].nbytes + layer.w2_weight[0].nbytes

    def file_bytes(self) -> int:
        """Bytes of this layer's expert memory the system holds now (CPU)."""
        return 0 if self.rows is None else sum(rows.file_bytes() for rows in self.rows.values())

    def route(self, topk_ids: torch.Tensor) -> torch.Tensor:
        """What ``apply`` runs before vLLM's kernel: the whole per-call path, inside vLLM's compiled region."""
        return page_experts(topk_ids, self.layer_name) if self.line_enabled else topk_ids

    def apply(self, layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input):
        return super().apply(layer, x, topk_weights, self.route(topk_ids), shared_experts, shared_experts_input)

    def take_step(self, counters: list[int], ran_forward: bool) -> tuple[list[int], int, int, int]:
        """The step's routing (tokens per expert), stagings, staged bytes and unstaged count
        (``ExpertSlots.step_counts``) from this layer's ``counters`` as read after the step; added to the totals."""
        routed, staged, unstaged = self.slots.step_counts(counters, ran_forward)
        staged_bytes = staged * self.row_bytes
        self.num_staged += staged
        self.staged_bytes += staged_bytes
        return routed, staged, staged_bytes, unstaged


def paged_layers() -> list[PagedUnquantizedFusedMoEMethod]:
    """This process's paged MoE layers in model order: moetide's MoE layer index is the position here."""
    return sorted((m for m in _LAYERS if m.layer is not None), key=lambda method: method.layer_number)


def apply_line_op(op: LineOp, backing=None) -> None:
    """One move of the line in this worker, in the order that keeps each page with one owner at a time. A grant:
    the region's experts are copied to the host, then ``backing`` (the KV backing, if any) maps their pages over
    the granted blocks. A give-back: the backing lets go of the blocks' pages first, then the experts are written
    home from their copies."""
    layers = paged_layers()
    touched: dict[int, set[int]] = {}
    for moe_layer, expert in op.region if layers else ():
        if not (0 <= moe_layer < len(layers) and 0 <= expert < layers[moe_layer].num_experts):
            raise ValueError(f"line op names expert {(moe_layer, expert)}, which this model does not have "
                             f"({len(layers)} MoE layers of {layers[0].num_experts} experts)")
        touched.setdefault(moe_layer, set()).add(expert)
    if not op.grow and backing is not None:
        backing.apply(op)
    lent: list[PageRun] = []
    for moe_layer, experts in sorted(touched.items()):
        method = layers[moe_layer]
        lent += method.set_offloaded(method.offloaded | experts if op.grow else method.offloaded - experts)
    if op.grow and backing is not None:
        backing.apply(op, lent)


def max_offloaded_experts(vllm_config) -> int:
    """Experts the configured policy may have out at once (0 without moetide's connector, or for a policy that
    never offloads): a layer gets that many staging slots, at most one per expert."""
    settings = plugin_settings(vllm_config) if vllm_config is not None else None
    if settings is None or not policy_entry(settings.policy).offloads_experts:
        return 0  # the model's experts are not read: a policy that offloads nothing serves any MoE vLLM serves
    return line_max_offloaded(settings, model_experts(settings, vllm_config)[0])


class StepReport:
    """This process's reads of the paged layers' counters, once per step (``vllm.connector``): the forward of a
    step is noted as the step starts (``begin_step``), its counts are read after it (``take``)."""

    def __init__(self) -> None:
        self.started = False  # a step has begun: counts before it are vLLM's warm-up and profiling runs
        self.ran_forward = False
        self.unstaged = 0  # over every step so far

    def begin_step(self, num_tokens: int) -> None:
        if not self.started:
            take_counts([m.slots for m in paged_layers() if m.slots is not None])
            self.started = True
        self.ran_forward = num_tokens > 0

    def take(self) -> dict:
        """The step's stagings and staged bytes, its unstaged count (logged when not 0) and, where the layers
        count it, its routing (tokens per expert, one row per MoE layer in model order)."""
        layers = [m for m in paged_layers() if m.slots is not None]
        routing, stagings, staged_bytes, unstaged = [], 0, 0, 0
        for method, counters in zip(layers, take_counts([m.slots for m in layers])):
            routed, staged, nbytes, missed = method.take_step(counters, self.ran_forward)
            routing.append(routed)
            stagings, staged_bytes, unstaged = stagings + staged, staged_bytes + nbytes, unstaged + missed
        self.ran_forward = False
        if unstaged:
            self.unstaged += unstaged
            logger.error("moetide's expert pager: %d offloaded experts routed but not staged in this step (%d so "
                         "far); their tokens were computed from memory lent to the KV cache", unstaged,
                         self.unstaged)
        report = {"stagings": stagings, "staged_bytes": staged_bytes, "unstaged": unstaged}
        if routing:
            report["routing"] = routing
        return report


STEPS = StepReport()


def register() -> None:
    """Make vLLM build the paged method wherever it builds ``UnquantizedFusedMoEMethod``."""
    CustomOp.register_oot(name="UnquantizedFusedMoEMethod")(PagedUnquantizedFusedMoEMethod)


def stats() -> dict[str, int]:
    """Plain data for the worker's RPC: the pager's counts, and its memory. ``staging_capacity_bytes`` is what the
    staging rows can hold: the shared areas once, plus the rows of layers that could not share them;
    ``staging_bytes`` what of it the system holds now (a shared area's pages are allocated only when written)."""
    layers = paged_layers()
    own_staging = sum(m.num_staging_slots * m.row_bytes for m in layers if not m.shared_staging)
    return {"paged_layers": len(layers), "offloaded_experts": sum(len(m.offloaded) for m in layers),
            "unstaged": STEPS.unstaged, "staging_slots": sum(m.num_staging_slots for m in layers),
            "stagings": sum(m.num_staged for m in layers), "staged_bytes": sum(m.staged_bytes for m in layers),
            "lent_bytes": sum(m.lent_bytes for m in layers),
            "peak_lent_bytes": sum(m.peak_lent_bytes for m in layers),
            "expert_file_bytes": sum(m.file_bytes() for m in layers) + sum(a.file_bytes() for a in _STAGING.values()),
            "home_bytes": sum(m.num_experts * m.row_bytes for m in layers),
            "staging_bytes": own_staging + sum(area.file_bytes() for area in _STAGING.values()),
            "staging_capacity_bytes": own_staging + sum(area.size for area in _STAGING.values())}
