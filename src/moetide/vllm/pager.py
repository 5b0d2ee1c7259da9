"""The expert pager: vLLM's unquantized fused-MoE method with offloaded experts served from host copies.

vLLM 0.32 computes routing before the MoE method runs (``apply(layer, x, topk_weights, topk_ids, ...)``), and its
CPU kernels read an expert's prepacked weights as row ``topk_id`` of ``w13_weight``/``w2_weight`` (they ignore
``expert_map``). So a pager needs no kernel of its own: experts live in **slots** (rows), ``topk_ids`` is remapped
to slots, and an offloaded expert that a step routes to is copied from its host copy into a **staging slot**
appended after the experts' own rows, then computed there as if it were resident.

* The host copies are the weights as the kernel reads them: snapshotted after vLLM's
  ``process_weights_after_loading`` (the CPU prepacks them; a GPU may permute them), as an expert goes out.
* Which experts are offloaded is moetide's ``ExpertResidency``'s choice, made in the scheduler: the step's
  ``LineOp``s name the (MoE layer, expert) keys, and the worker hands them to ``apply_line_op`` before the forward.
* With nothing offloaded in a layer its ``apply`` is vLLM's, unchanged but for one check (and, where the policy
  can offload, a bincount of the step's routing). The staging slots are added to a layer's weights as its
  offloaded count first reaches each new high.
* Where the configured policy can offload (``line_may_offload``), on the CPU each layer's weights live in shared
  memory (``vllm.arena.SharedRows``) with room for as many staging rows again. An offloaded expert's home rows
  are not read while it is out: their pages are lent to the KV cache (the backing maps them over the granted
  blocks), and the expert is written home from its copy once the backing has let go of them (``apply_line_op``
  orders the two). On CUDA host copies are pinned and staged on a copy stream; the device rows are not lent yet
  (the CUDA backing maps fresh physical memory).

``CustomOp.register_oot(name="UnquantizedFusedMoEMethod")`` makes vLLM build this class wherever it would build
its own (``register``, called once by the plugin).
"""

from __future__ import annotations

import re
import weakref

import torch
from vllm.config import get_current_vllm_config_or_none
from vllm.model_executor.custom_op import CustomOp
from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
from vllm.model_executor.utils import replace_parameter

from moetide.core.pressure import policy_entry
from moetide.vllm.arena import PageRun, SharedRows, StagingArea
from moetide.vllm.line import LineOp
from moetide.vllm.plugin import plugin_settings
from moetide.vllm.staging import Stager, host_copy

# this process's paged MoE layers (weakly: a model that is deleted takes its layers along)
_LAYERS: weakref.WeakSet[PagedUnquantizedFusedMoEMethod] = weakref.WeakSet()
_STAGING: dict[tuple[str, int], StagingArea] = {}  # (weight, row bytes) -> the staging rows every layer shares
_LAYER_NUMBER = re.compile(r"\.layers\.(\d+)\.")
WEIGHTS = ("w13_weight", "w2_weight")


class PagedUnquantizedFusedMoEMethod(UnquantizedFusedMoEMethod):
    """``UnquantizedFusedMoEMethod`` whose experts can be offloaded and staged back per step (module docstring)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.line_enabled = line_may_offload(get_current_vllm_config_or_none())

    def process_weights_after_loading(self, layer) -> None:
        super().process_weights_after_loading(layer)
        self._layer = weakref.ref(layer)  # not an attribute module: the layer holds this method as a submodule
        match = _LAYER_NUMBER.search(f"{layer.layer_name}.")
        self.layer_number = int(match.group(1)) if match else len(_LAYERS)
        self.num_experts = layer.w13_weight.shape[0]
        # on the CPU the weights live in shared memory whose pages the KV backing can take over (vllm.arena), with
        # room for as many staging rows again, so adding staging rows never moves them
        self.rows: dict[str, SharedRows] | None = None
        if self.line_enabled and layer.w13_weight.device.type == "cpu":
            self.rows = {name: SharedRows(getattr(layer, name).data, 2 * self.num_experts) for name in WEIGHTS}
            for name, rows in self.rows.items():
                replace_parameter(layer, name, rows.view(self.num_experts))
        self.host: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # offloaded expert -> its (w13, w2) copy
        self.num_staging_slots = 0
        self.shared_staging = self.rows is not None  # the staging rows are the shared area's (whole-page rows)
        self.offloaded: set[int] = set()
        self.peak_lent_bytes = 0  # the most ``lent_bytes`` has been
        self.num_staged = 0  # staged copies so far (the step costs' touches)
        # tokens routed to each expert since ``take_routing`` (where the line may offload)
        self._routed = torch.zeros(self.num_experts, dtype=torch.long, device=layer.w13_weight.device)
        self.staged_bytes = 0
        self._stager = Stager(layer.w13_weight.device)
        _LAYERS.add(self)

    @property
    def layer(self):
        return self._layer()

    @property
    def lent_bytes(self) -> int:
        """Bytes of the offloaded experts' home-row pages, which the KV cache may hold now."""
        return sum(run.nbytes for expert in self.offloaded for run in self._pages(expert))

    def set_offloaded(self, experts: set[int]) -> list[PageRun]:
        """The layer's offloaded experts from now on; returns the pages of the experts going out, for the KV
        cache to take. An expert going out is copied to the host first (pinned memory on CUDA); one coming back is
        written home from its copy (after the KV cache has let go of its pages: ``apply_line_op``). A layer gets
        as many staging rows as it has ever had experts out."""
        layer = self.layer
        if len(experts) > self.num_staging_slots:
            self._add_staging_rows(len(experts))
        w13, w2 = layer.w13_weight.data, layer.w2_weight.data
        lent: list[PageRun] = []
        for expert in sorted(set(experts) - self.offloaded):
            self.host[expert] = (host_copy(w13[expert]), host_copy(w2[expert]))
            lent += self._pages(expert)
        for expert in sorted(self.offloaded - set(experts)):
            host13, host2 = self.host.pop(expert)
            w13[expert].copy_(host13)
            w2[expert].copy_(host2)
        self.offloaded = set(experts)
        self.peak_lent_bytes = max(self.peak_lent_bytes, self.lent_bytes)
        return lent

    def _add_staging_rows(self, spare: int) -> None:
        """Staging rows after the experts' own: on the CPU a longer view of the same shared memory (no copy), its
        staging rows mapped onto the staging area every layer shares (``vllm.arena.StagingArea``); elsewhere the
        weights rebuilt once with zero rows appended."""
        layer = self.layer
        for name in WEIGHTS:
            if self.rows is not None:
                rows = self.rows[name]
                area = _STAGING.setdefault((name, rows.row_bytes), StagingArea(f"moetide-staging-{name}"))
                self.shared_staging = rows.share_rows(self.num_experts, spare, area) and self.shared_staging
                replace_parameter(layer, name, rows.view(self.num_experts + spare))
            else:
                weight = getattr(layer, name).data[:self.num_experts]
                replace_parameter(layer, name, torch.cat([weight, weight.new_zeros((spare, *weight.shape[1:]))]))
        self.num_staging_slots = spare

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

    def apply(self, layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input):
        if self.line_enabled:
            self._routed += torch.bincount(topk_ids.flatten(), minlength=self.num_experts)
        if self.offloaded:
            topk_ids = self._stage(topk_ids)
        return super().apply(layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input)

    def _stage(self, topk_ids: torch.Tensor) -> torch.Tensor:
        """Copy the routed offloaded experts into staging slots; ``topk_ids`` remapped to them."""
        routed = [e for e in torch.unique(topk_ids).tolist() if e in self.offloaded]
        if not routed:
            return topk_ids
        slot_of = torch.arange(self.num_experts, dtype=topk_ids.dtype, device=topk_ids.device)
        w13, w2 = self.layer.w13_weight.data, self.layer.w2_weight.data
        copies = []
        for j, expert in enumerate(routed):
            slot = self.num_experts + j
            copies += [(w13[slot], self.host[expert][0]), (w2[slot], self.host[expert][1])]
            slot_of[expert] = slot
        self.staged_bytes += self._stager.stage(copies)
        self.num_staged += len(routed)
        return slot_of[topk_ids.long()]


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


def line_may_offload(vllm_config) -> bool:
    """Whether moetide's connector is configured with a policy that can offload experts: only then do the layers
    keep their weights in shared memory and count their routing (a bincount per layer per step), so that
    ``ExpertResidency`` offloads the coldest experts first."""
    settings = plugin_settings(vllm_config) if vllm_config is not None else None
    return settings is not None and policy_entry(settings.policy).offloads_experts


def take_routing() -> list[list[int]]:
    """Tokens routed to each expert of each paged layer (model order) since the last call: one read-back; empty
    where the layers do not count routing."""
    layers = paged_layers()
    if not layers or not layers[0].line_enabled:
        return []
    counts = torch.stack([method._routed for method in layers]).tolist()
    for method in layers:
        method._routed.zero_()
    return counts


def staging_totals() -> tuple[int, int]:
    """Stagings and staged bytes so far, over this process's paged layers (what the connector reports each step)."""
    layers = paged_layers()
    return sum(m.num_staged for m in layers), sum(m.staged_bytes for m in layers)


def register() -> None:
    """Make vLLM build the paged method wherever it builds ``UnquantizedFusedMoEMethod``."""
    CustomOp.register_oot(name="UnquantizedFusedMoEMethod")(PagedUnquantizedFusedMoEMethod)


def stats() -> dict[str, int]:
    """Plain data for the worker's RPC: the pager's counts, and its memory. ``staging_bytes`` is what the staging
    rows can hold: the shared areas once, plus the rows of layers that could not share them."""
    layers = paged_layers()
    own_staging = sum(m.num_staging_slots * m.row_bytes for m in layers if not m.shared_staging)
    return {"paged_layers": len(layers), "offloaded_experts": sum(len(m.offloaded) for m in layers),
            "stagings": sum(m.num_staged for m in layers), "staged_bytes": sum(m.staged_bytes for m in layers),
            "lent_bytes": sum(m.lent_bytes for m in layers),
            "peak_lent_bytes": sum(m.peak_lent_bytes for m in layers),
            "expert_file_bytes": sum(m.file_bytes() for m in layers) + sum(a.file_bytes() for a in _STAGING.values()),
            "home_bytes": sum(m.num_experts * m.row_bytes for m in layers),
            "staging_bytes": own_staging + sum(area.size for area in _STAGING.values())}
