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
* An offloaded expert's home rows are not read while it is out: their memory is lent to the KV cache, and the
  expert is written home from its copy once the backing has let go of it (``apply_line_op`` orders the two). On
  the CPU each layer's weights live in shared memory (``vllm.shared_rows.SharedRows``) and the backing maps the
  lent pages over the granted blocks. On CUDA they live in the driver's virtual memory (``vllm.vmm.VmmRows``): the
  granules an offloaded expert's rows wholly cover are unmapped and their chunks mapped under the granted blocks
  (``vllm.vmm_backing``), so the device holds no more than it held at start-up; host copies are pinned.
* vLLM's kernels must read rows by the ids they are given: the CPU kernel does, and on CUDA the Triton kernel
  without an expert map (it takes the expert count from the weights). Any other MoE kernel, an expert map (expert
  parallelism), LoRA on the experts, or per-expert biases are refused at load in one line
  (``unpageable_reason``).
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
from vllm.model_executor.layers.fused_moe.oracle.fp8 import make_fp8_moe_kernel
from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
from vllm.model_executor.layers.quantization import register_quantization_config
from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import CompressedTensorsConfig
from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe.compressed_tensors_moe_w8a8_fp8 \
    import CompressedTensorsW8A8Fp8MoEMethod
from vllm.model_executor.layers.quantization.fp8 import Fp8Config, Fp8MoEMethod
from vllm.model_executor.utils import replace_parameter

from moetide.core.pressure import policy_entry
from moetide.vllm.shared_rows import PageRun, SharedRows, StagingArea
from moetide.vllm.line import LineOp, line_max_offloaded, model_experts
from moetide.vllm.line_memory import device_memory
from moetide.vllm.plugin import plugin_settings
from moetide.vllm.staging import ExpertSlots, page_experts, take_counts

logger = logging.getLogger(__name__)
# this process's paged MoE layers (weakly: a model that is deleted takes its layers along)
_LAYERS: weakref.WeakSet[PagedExperts] = weakref.WeakSet()
_STAGING: dict[tuple[str, int], StagingArea] = {}  # (weight, row bytes) -> the staging rows every layer shares
_LAYER_NUMBER = re.compile(r"\.layers\.(\d+)\.")
WEIGHTS = ("w13_weight", "w2_weight")


class PagedExperts:
    """What makes one of vLLM's fused-MoE methods page its experts (module docstring): mixed in before the method's
    class, it pages the weights ``paged_weights`` names (the experts' rows, and an FP8 method's per-expert scales),
    after the method has put them in its kernel's format."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        config = get_current_vllm_config_or_none()
        self.settings = plugin_settings(config) if config is not None else None
        self.max_offloaded = max_offloaded_experts(config)
        self.line_enabled = self.max_offloaded > 0

    def paged_weights(self) -> tuple[str, ...]:
        """The layer's per-expert tensors the pager pages."""
        return WEIGHTS

    def rebuild_kernel(self, layer) -> None:
        """Point the method's kernel at the paged tensors (a kernel that reads the layer's weights at each call,
        as the unquantized one does, needs nothing)."""

    def kernel_backend(self):
        """The MoE kernel vLLM chose for the layer (an enum member of the method's kind)."""
        raise NotImplementedError

    def process_weights_after_loading(self, layer) -> None:
        super().process_weights_after_loading(layer)
        self._layer = weakref.ref(layer)  # not an attribute module: the layer holds this method as a submodule
        self.layer_name = layer.layer_name
        match = _LAYER_NUMBER.search(f"{layer.layer_name}.")
        self.layer_number = int(match.group(1)) if match else len(_LAYERS)
        self.num_experts = layer.w13_weight.shape[0]
        self.rows: dict[str, SharedRows] | None = None
        self.own_staging_bytes = 0  # staging rows of weights whose rows are not whole pages (not shared)
        self.slots: ExpertSlots | None = None
        self.peak_lent_bytes = 0  # the most ``lent_bytes`` has been
        self.num_staged = 0  # staged copies so far (the step costs' touches)
        self.staged_bytes = 0
        self.vmm_rows = None  # on CUDA: the weights' VmmRows
        _LAYERS.add(self)
        if self.line_enabled:
            reason = unpageable_reason(self, layer)
            if reason is not None:
                raise ValueError(f"moetide: {layer.layer_name}: {reason}")
            self._add_staging_rows(min(self.num_experts, self.max_offloaded))
            self.rebuild_kernel(layer)
            self.slots = ExpertSlots([getattr(layer, name).data for name in self.paged_weights()], self.num_experts,
                                     self.layer_name)

    def _add_staging_rows(self, num_slots: int) -> None:
        """The staging rows after the experts' own, once, before vLLM compiles the forward. On the CPU the weights
        move into shared memory (``vllm.shared_rows``) and the staging rows map onto the staging area every layer
        shares where rows are whole pages; where the line moves granules (``vllm.line_memory``: CUDA) into the
        driver's virtual memory (``vllm.vmm.VmmRows``), whose staging granules every layer of one shape shares."""
        layer = self.layer
        names = self.paged_weights()
        vmm = device_memory(self.settings, layer.w13_weight.device)
        if vmm is not None:
            from moetide.vllm.vmm import VmmRows

            memory, staging = vmm
            self.vmm_rows = [VmmRows(memory, getattr(layer, name).data, self.num_experts, num_slots, staging)
                             for name in names]
            for name, rows in zip(names, self.vmm_rows):
                replace_parameter(layer, name, rows.tensor)
            return
        self.rows = {name: SharedRows(getattr(layer, name).data, self.num_experts + num_slots) for name in names}
        for name, rows in self.rows.items():
            area = _STAGING.setdefault((name, rows.row_bytes), StagingArea(f"moetide-staging-{name}"))
            if not rows.share_rows(self.num_experts, num_slots, area):
                self.own_staging_bytes += num_slots * rows.row_bytes
            replace_parameter(layer, name, rows.view(self.num_experts + num_slots))

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
        """Bytes of the offloaded experts' home-row pages (granules on CUDA), which the KV cache may hold now."""
        if self.vmm_rows is not None:
            return sum(len(rows.lent) * rows.memory.granule for rows in self.vmm_rows)
        return sum(run.nbytes for expert in self.offloaded for run in self._pages(expert))

    def set_offloaded(self, experts: set[int]) -> list[PageRun]:
        """The layer's offloaded experts from now on; returns the pages of the experts going out, for the KV
        cache to take. An expert going out is copied to its slot's host rows first; one coming back is written
        home from them (after the KV cache has let go of its pages: ``apply_line_op``)."""
        if self.slots is None:
            raise ValueError(f"{self.layer_name}: the configured policy offloads no expert")
        if self.vmm_rows is not None:
            from moetide.vllm.vmm import move_experts

            move_experts(self.slots, self.vmm_rows, set(experts))  # the lent chunks wait in the free list
            self.peak_lent_bytes = max(self.peak_lent_bytes, self.lent_bytes)
            return []
        lent: list[PageRun] = []
        for expert in sorted(self.offloaded - set(experts)):
            self.slots.bring_home(expert)
        for expert in sorted(set(experts) - self.offloaded):
            self.slots.take_out(expert)
            lent += self._pages(expert)
        self.peak_lent_bytes = max(self.peak_lent_bytes, self.lent_bytes)
        return lent

    def _pages(self, expert: int) -> list[PageRun]:
        """The whole pages of an expert's home rows (CPU; none on CUDA)."""
        if self.rows is None:
            return []
        return [run for rows in self.rows.values() if (run := rows.row_pages(expert)) is not None]

    @property
    def row_bytes(self) -> int:
        """One expert's bytes in this layer (its rows of every paged tensor)."""
        layer = self.layer
        return sum(getattr(layer, name)[0].nbytes for name in self.paged_weights())

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


class PagedUnquantizedFusedMoEMethod(PagedExperts, UnquantizedFusedMoEMethod):
    """vLLM's unquantized fused-MoE method, paged (``CustomOp.register_oot`` builds it wherever vLLM builds its own)."""

    def kernel_backend(self):
        return self.unquantized_backend


class PagedFp8MoEMethod(PagedExperts, Fp8MoEMethod):
    """vLLM's FP8 fused-MoE method (``quant_method: fp8``), paged with its per-expert weight scales."""

    def paged_weights(self) -> tuple[str, ...]:
        return WEIGHTS + (f"w13_{self.weight_scale_name}", f"w2_{self.weight_scale_name}")

    def rebuild_kernel(self, layer) -> None:
        self._init_moe_kernel(layer)  # its kernel's quant config holds the scale tensors

    def kernel_backend(self):
        return self.fp8_backend


class PagedCompressedTensorsFp8MoEMethod(PagedExperts, CompressedTensorsW8A8Fp8MoEMethod):
    """vLLM's compressed-tensors W8A8 FP8 fused-MoE method, paged with its per-expert weight scales."""

    def paged_weights(self) -> tuple[str, ...]:
        return WEIGHTS + ("w13_weight_scale", "w2_weight_scale")

    def rebuild_kernel(self, layer) -> None:
        self.moe_quant_config = self.get_fused_moe_quant_config(layer)
        self.moe_kernel = make_fp8_moe_kernel(moe_quant_config=self.moe_quant_config, moe_config=self.moe,
                                              fp8_backend=self.fp8_backend, experts_cls=self.experts_cls,
                                              routing_tables=layer._expert_routing_tables())

    def kernel_backend(self):
        return self.fp8_backend


class PagedFp8Config(Fp8Config):
    """``quant_method: fp8`` with the FP8 MoE layers' method paged (``register``)."""

    def get_quant_method(self, layer, prefix: str):
        method = super().get_quant_method(layer, prefix)
        return PagedFp8MoEMethod(self, layer) if type(method) is Fp8MoEMethod else method


class PagedCompressedTensorsConfig(CompressedTensorsConfig):
    """``quant_method: compressed-tensors`` with the W8A8 FP8 MoE layers' method paged (``register``)."""

    def get_quant_method(self, layer, prefix: str):
        method = super().get_quant_method(layer, prefix)
        if type(method) is CompressedTensorsW8A8Fp8MoEMethod:
            return PagedCompressedTensorsFp8MoEMethod(method.weight_quant, method.input_quant, layer.moe_config)
        return method


def unpageable_reason(method: PagedExperts, layer) -> str | None:
    """Why the pager cannot page this layer's experts (module docstring), in words naming what to change; None where
    it can. Its staging rows hold ``w13_weight`` and ``w2_weight`` only, and their ids are past the experts'."""
    moe = method.moe
    if moe.has_bias:
        return "the experts have biases, which the expert pager does not page yet: use policy 'vllm'"
    if moe.is_lora_enabled:
        return "LoRA on the experts replaces the MoE method the expert pager pages: use policy 'vllm'"
    if layer.expert_map is not None:
        return "expert parallelism maps expert ids to ranks, which the expert pager does not: leave out " \
               "--enable-expert-parallel, or use policy 'vllm'"
    if layer.w13_weight.device.type != "cuda":
        return None
    backend = method.kernel_backend()
    if method.is_monolithic or backend.name != "TRITON":
        return (f"vLLM chose the {backend.value} MoE kernel, which does not read expert rows by the ids the expert "
                f"pager gives: pass --moe-backend triton, or use policy 'vllm'")
    return None


def paged_layers() -> list[PagedExperts]:
    """This process's paged MoE layers in model order: moetide's MoE layer index is the position here."""
    return sorted((m for m in _LAYERS if m.layer is not None), key=lambda method: method.layer_number)


def check_every_layer_paged(vllm_config) -> None:
    """``ValueError`` in one line where the line offloads experts of MoE layers this worker does not page (a MoE
    method the pager does not replace, as a quantization it does not know): a grant would lend memory those layers
    still read. Called as the KV cache is allocated, after the model has loaded."""
    settings = plugin_settings(vllm_config)
    if settings is None or settings.experts is not None or not policy_entry(settings.policy).offloads_experts:
        return
    shape = model_experts(settings, vllm_config)[0]
    paged = sum(1 for method in paged_layers() if method.slots is not None)
    if paged != shape.num_layers:
        quantization = vllm_config.model_config.quantization or "none"
        raise ValueError(f"moetide: policy {settings.policy!r} offloads the experts of {shape.num_layers} MoE "
                         f"layers, and this worker pages {paged} (quantization {quantization!r}: the pager pages "
                         f"unquantized and block-FP8 experts): use policy 'vllm'")


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
    """Make vLLM build the paged methods wherever it builds ``UnquantizedFusedMoEMethod`` (a custom op's
    out-of-tree class) or an FP8 MoE method (the quantization configs, registered again under their names)."""
    CustomOp.register_oot(name="UnquantizedFusedMoEMethod")(PagedUnquantizedFusedMoEMethod)
    register_quantization_config("fp8")(PagedFp8Config)
    register_quantization_config("compressed-tensors")(PagedCompressedTensorsConfig)


def stats() -> dict[str, int]:
    """Plain data for the worker's RPC: the pager's counts, and its memory. ``staging_capacity_bytes`` is what the
    staging rows can hold: the shared areas once, plus the rows of layers that could not share them;
    ``staging_bytes`` what of it the system holds now (a shared area's pages are allocated only when written)."""
    layers = paged_layers()
    own_staging = sum(m.own_staging_bytes for m in layers)
    return {"paged_layers": len(layers), "offloaded_experts": sum(len(m.offloaded) for m in layers),
            "unstaged": STEPS.unstaged, "staging_slots": sum(m.num_staging_slots for m in layers),
            "stagings": sum(m.num_staged for m in layers), "staged_bytes": sum(m.staged_bytes for m in layers),
            "lent_bytes": sum(m.lent_bytes for m in layers),
            "peak_lent_bytes": sum(m.peak_lent_bytes for m in layers),
            "expert_file_bytes": sum(m.file_bytes() for m in layers) + sum(a.file_bytes() for a in _STAGING.values()),
            "home_bytes": sum(m.num_experts * m.row_bytes for m in layers),
            "staging_bytes": own_staging + sum(area.file_bytes() for area in _STAGING.values()),
            "staging_capacity_bytes": own_staging + sum(area.size for area in _STAGING.values())}
