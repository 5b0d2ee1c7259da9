"""The expert pager: vLLM's unquantized fused-MoE method with offloaded experts served from host copies.

vLLM 0.32 computes routing before the MoE method runs (``apply(layer, x, topk_weights, topk_ids, ...)``), and its
CPU kernels read an expert's prepacked weights as row ``topk_id`` of ``w13_weight``/``w2_weight`` (they ignore
``expert_map``). So a pager needs no kernel of its own: experts live in **slots** (rows), ``topk_ids`` is remapped
to slots, and an offloaded expert that a step routes to is copied from its host copy into a **staging slot**
appended after the experts' own rows, then computed there as if it were resident.

* The host copies are the weights as the kernel reads them: snapshotted after vLLM's
  ``process_weights_after_loading`` (the CPU prepacks them; a GPU may permute them). On CUDA they would be device
  clones: pinned host copies and a copy stream are not written yet.
* Which experts are offloaded is moetide's ``ExpertResidency``'s choice, made in the scheduler: the step's
  ``LineOp``s name the (MoE layer, expert) keys, and the worker hands them to ``apply_line_op`` before the forward.
* With nothing offloaded in a layer its ``apply`` is vLLM's, unchanged but for one check. The staging slots are
  added to a layer's weights as its offloaded count first reaches each new high (a copy of the layer's weights).
* An offloaded expert's home rows are not read while it is out; on the CPU their pages go back to the system
  (``MADV_DONTNEED``), and the expert is written home from its copy when the region comes back. The KV blocks the
  line grants still come from the backing's reserve: the two sides of the line are not yet one memory.

``CustomOp.register_oot(name="UnquantizedFusedMoEMethod")`` makes vLLM build this class wherever it would build
its own (``register``, called once by the plugin).
"""

from __future__ import annotations

import re
import weakref

import torch
from vllm.model_executor.custom_op import CustomOp
from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
from vllm.model_executor.utils import replace_parameter

from moetide.vllm.backing import release_pages, release_size
from moetide.vllm.line import LineOp

# this process's paged MoE layers (weakly: a model that is deleted takes its layers along)
_LAYERS: weakref.WeakSet[PagedUnquantizedFusedMoEMethod] = weakref.WeakSet()
_LAYER_NUMBER = re.compile(r"\.layers\.(\d+)\.")


class PagedUnquantizedFusedMoEMethod(UnquantizedFusedMoEMethod):
    """``UnquantizedFusedMoEMethod`` whose experts can be offloaded and staged back per step (module docstring)."""

    def process_weights_after_loading(self, layer) -> None:
        super().process_weights_after_loading(layer)
        self._layer = weakref.ref(layer)  # not an attribute module: the layer holds this method as a submodule
        match = _LAYER_NUMBER.search(f"{layer.layer_name}.")
        self.layer_number = int(match.group(1)) if match else len(_LAYERS)
        self.num_experts = layer.w13_weight.shape[0]
        self.host: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # offloaded expert -> its (w13, w2) copy
        self.num_staging_slots = 0
        self.offloaded: set[int] = set()
        self.released_bytes = 0  # bytes of offloaded experts' home rows returned to the system now
        self.peak_released_bytes = 0
        self.num_staged = 0  # staged copies so far (the step costs' touches)
        self.staged_bytes = 0
        _LAYERS.add(self)

    @property
    def layer(self):
        return self._layer()

    def set_offloaded(self, experts: set[int]) -> None:
        """The layer's offloaded experts from now on. An expert going out is copied to the host and its home rows'
        pages are returned to the system (CPU; ``backing.release_pages``); one coming back is written home from
        its copy. A layer gets as many staging slots as it has ever had experts out."""
        layer = self.layer
        if len(experts) > self.num_staging_slots:  # more staging rows: rebuild the weights once, then re-release
            w13, w2 = layer.w13_weight.data[:self.num_experts], layer.w2_weight.data[:self.num_experts]
            spare = len(experts)
            replace_parameter(layer, "w13_weight", torch.cat([w13, w13.new_zeros((spare, *w13.shape[1:]))]))
            replace_parameter(layer, "w2_weight", torch.cat([w2, w2.new_zeros((spare, *w2.shape[1:]))]))
            self.num_staging_slots = spare
            self.released_bytes = sum(self._release(e) for e in self.offloaded)
        w13, w2 = layer.w13_weight.data, layer.w2_weight.data
        for expert in sorted(set(experts) - self.offloaded):
            self.host[expert] = (w13[expert].clone(), w2[expert].clone())
            self.released_bytes += self._release(expert)
        for expert in sorted(self.offloaded - set(experts)):
            host13, host2 = self.host.pop(expert)
            w13[expert].copy_(host13)
            w2[expert].copy_(host2)
            self.released_bytes -= _released_size(w13[expert]) + _released_size(w2[expert])
        self.offloaded = set(experts)
        self.peak_released_bytes = max(self.peak_released_bytes, self.released_bytes)

    def _release(self, expert: int) -> int:
        """Return an offloaded expert's home-row pages to the system (CPU); the bytes released."""
        rows = (self.layer.w13_weight.data[expert], self.layer.w2_weight.data[expert])
        if rows[0].device.type != "cpu":
            return 0
        return sum(release_pages(row.data_ptr(), row.nbytes) for row in rows)

    def apply(self, layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input):
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
        for j, expert in enumerate(routed):
            slot = self.num_experts + j
            w13[slot].copy_(self.host[expert][0])
            w2[slot].copy_(self.host[expert][1])
            slot_of[expert] = slot
            self.staged_bytes += w13[slot].nbytes + w2[slot].nbytes
        self.num_staged += len(routed)
        return slot_of[topk_ids.long()]


def _released_size(row: torch.Tensor) -> int:
    return release_size(row.data_ptr(), row.nbytes) if row.device.type == "cpu" else 0


def paged_layers() -> list[PagedUnquantizedFusedMoEMethod]:
    """This process's paged MoE layers in model order: moetide's MoE layer index is the position here."""
    return sorted((m for m in _LAYERS if m.layer is not None), key=lambda method: method.layer_number)


def apply_line_op(op: LineOp) -> None:
    """Mark the op's experts offloaded (a grant) or resident again (a give-back) in their layers."""
    layers = paged_layers()
    if not layers:
        return
    touched: dict[int, set[int]] = {}
    for moe_layer, expert in op.region:
        if not (0 <= moe_layer < len(layers) and 0 <= expert < layers[moe_layer].num_experts):
            raise ValueError(f"line op names expert {(moe_layer, expert)}, which this model does not have "
                             f"({len(layers)} MoE layers of {layers[0].num_experts} experts)")
        touched.setdefault(moe_layer, set()).add(expert)
    for moe_layer, experts in touched.items():
        method = layers[moe_layer]
        method.set_offloaded(method.offloaded | experts if op.grow else method.offloaded - experts)


def register() -> None:
    """Make vLLM build the paged method wherever it builds ``UnquantizedFusedMoEMethod``."""
    CustomOp.register_oot(name="UnquantizedFusedMoEMethod")(PagedUnquantizedFusedMoEMethod)


def stats() -> dict[str, int]:
    layers = paged_layers()
    return {"paged_layers": len(layers), "offloaded_experts": sum(len(m.offloaded) for m in layers),
            "stagings": sum(m.num_staged for m in layers), "staged_bytes": sum(m.staged_bytes for m in layers),
            "released_bytes": sum(m.released_bytes for m in layers),
            "peak_released_bytes": sum(m.peak_released_bytes for m in layers)}
