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
  added to a layer's weights when its first expert goes out (one copy of that layer's weights, once).
* Slots stand in for the expert memory the line will hand to the KV cache; until the backing takes an offloaded
  expert's pages (the whole line), an offloaded expert's own row stays allocated and unread.

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
        self.host = None  # (w13, w2) host copies, taken when the first expert goes out
        self.offloaded: set[int] = set()
        self.num_staged = 0  # staged copies so far (the step costs' touches)
        self.staged_bytes = 0
        _LAYERS.add(self)

    @property
    def layer(self):
        return self._layer()

    def set_offloaded(self, experts: set[int]) -> None:
        """The layer's offloaded experts from now on; the first offload adds staging slots for all of them."""
        if experts and self.host is None:
            w13, w2 = self.layer.w13_weight.data, self.layer.w2_weight.data
            self.host = (w13.clone(), w2.clone())
            spare13 = w13.new_zeros((self.num_experts, *w13.shape[1:]))
            spare2 = w2.new_zeros((self.num_experts, *w2.shape[1:]))
            replace_parameter(self.layer, "w13_weight", torch.cat([w13, spare13]))
            replace_parameter(self.layer, "w2_weight", torch.cat([w2, spare2]))
        self.offloaded = set(experts)

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
            w13[slot].copy_(self.host[0][expert])
            w2[slot].copy_(self.host[1][expert])
            slot_of[expert] = slot
            self.staged_bytes += w13[slot].nbytes + w2[slot].nbytes
        self.num_staged += len(routed)
        return slot_of[topk_ids.long()]


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
            "stagings": sum(m.num_staged for m in layers), "staged_bytes": sum(m.staged_bytes for m in layers)}
