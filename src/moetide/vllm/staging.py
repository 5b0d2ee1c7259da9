"""One MoE layer's expert slots: the expert pager's per-call path, with torch alone (no vLLM here, so a GPU machine
without vLLM can test it, CUDA-graph capture included).

The layer's weights (``w13``, ``w2``) have ``E`` home rows, one per expert, and ``S`` staging rows after them, all
allocated once, before vLLM compiles or captures the forward, and never rebound. An offloaded expert owns a
staging slot for as long as it is out; its host copy is that slot's row of ``host`` (pinned on CUDA).

Two kinds of work, kept apart because vLLM may compile the forward (``torch.compile`` on the CPU, CUDA graphs on a
GPU), which freezes whatever Python decides inside it:

* **Line moves** (``take_out``, ``bring_home``) run between steps, outside any graph: they fill a host copy, and
  write the slot tables (``slot_of``, ``slot_expert``) *in place*.
* **The per-call path** (``route``) runs inside the forward for every MoE call. It is tensor work of fixed shapes
  that reads the slot tables as they are now: count the call's routing, find the staging slots whose expert is
  routed, copy those slots' host rows into their staging rows, and map ``topk_ids`` to slots. On a device no
  Python branch depends on the data or on the slot tables, and nothing waits for the device, so a graph
  captured once replays it correctly after any number of line moves. (On the CPU, which captures nothing, a
  layer with nothing out skips the staging and the remap.) The one data-dependent piece, copying only the routed slots' rows, is
  ``copy_rows_where``: a loop on the CPU (which captures nothing), a masked Triton kernel on CUDA that reads the
  pinned host rows directly.

Counters (tokens routed per expert, stagings per expert, calls) are device tensors the path adds to; the worker
reads them once per step, outside the forward.

The forward reaches ``route`` through one opaque op, ``moetide::page_experts(topk_ids, name)``, as vLLM reaches
its attention layers (``unified_attention(..., layer_name)``): Dynamo keeps the op as one node of the graph and
runs it on every call, and a layer's slots are found by the name they were built with.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch

SLOTS: weakref.WeakValueDictionary[str, ExpertSlots] = weakref.WeakValueDictionary()  # by layer name


def host_rows(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host memory for ``shape``: pinned where the rows are staged to an accelerator (the copy kernel reads it
    there), plain otherwise (``torch.empty``: its pages are taken only as rows are written)."""
    return torch.empty(shape, dtype=dtype, device="cpu", pin_memory=device.type == "cuda")


class ExpertSlots:
    """The slot tables, host copies and counters of one MoE layer (module docstring). ``weights``: the layer's
    weights, each of ``num_experts`` home rows and the staging rows after them; ``name``: the layer's, which
    ``moetide::page_experts`` finds it by."""

    def __init__(self, weights: Sequence[torch.Tensor], num_experts: int, name: str) -> None:
        num_rows = {w.shape[0] for w in weights}
        if len(num_rows) != 1 or next(iter(num_rows)) < num_experts:
            raise ValueError(f"expert weights of {sorted(num_rows)} rows for {num_experts} experts")
        self.weights = tuple(weights)
        self.num_experts = num_experts
        self.num_slots = weights[0].shape[0] - num_experts
        device = self.device = weights[0].device
        self.staging = tuple(w[num_experts:] for w in weights)
        self.host = tuple(host_rows((self.num_slots, *w.shape[1:]), w.dtype, device) for w in weights)
        long = dict(dtype=torch.long, device=device)
        # the row each expert is computed from (int32, as vLLM's ``topk_ids``; indexing with them needs no cast)
        self.slot_of = torch.arange(num_experts, dtype=torch.int32, device=device)
        self.slot_expert = torch.full((self.num_slots,), num_experts, **long)  # each slot's expert; E: free
        # the counters, one tensor so that a step reads every layer's at once (``take_counts``): tokens routed to
        # each expert, stagings of each expert (and of free slots, which stay 0), per-call paths run
        self.counters = torch.zeros(2 * num_experts + 2, **long)
        self.routed = self.counters[:num_experts]
        self.staged = self.counters[num_experts:2 * num_experts + 1]
        self.calls = self.counters[2 * num_experts + 1]
        self.out: dict[int, int] = {}  # offloaded expert -> its slot
        self.name = name
        SLOTS[name] = self

    # ---- line moves: between steps, outside the forward --------------------------------------------------
    def take_out(self, expert: int) -> None:
        """Give ``expert`` a free slot and copy its home rows to the slot's host rows; from now on it is computed
        from the staging row its host copy is copied into when routed."""
        if expert in self.out or not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} cannot go out (out now: {sorted(self.out)})")
        slot = min(set(range(self.num_slots)) - set(self.out.values()), default=None)
        if slot is None:
            raise ValueError(f"no free staging slot for expert {expert}: all {self.num_slots} hold experts")
        for weight, host in zip(self.weights, self.host):
            host[slot].copy_(weight[expert])
        self.slot_expert[slot] = expert
        self.slot_of[expert] = self.num_experts + slot
        self.out[expert] = slot

    def bring_home(self, expert: int) -> None:
        """Write ``expert``'s home rows from its host copy (its pages are the experts' again) and free its slot."""
        slot = self.out.pop(expert)
        for weight, host in zip(self.weights, self.host):
            weight[expert].copy_(host[slot])
        self.slot_of[expert] = expert
        self.slot_expert[slot] = self.num_experts

    # ---- the per-call path: inside the forward, fixed shapes, no host sync -----------------------------------
    def route(self, topk_ids: torch.Tensor) -> torch.Tensor:
        """Count the call's routing, stage the routed offloaded experts, and return ``topk_ids`` mapped to the
        rows each expert is computed from."""
        counts = self._count(topk_ids.reshape(-1))  # counts[E] is 0: free slots are never staged
        self.routed.add_(counts[:self.num_experts])
        if self.device.type == "cpu" and not self.out:
            # Nothing captures this body on the CPU (the op runs it on every call, compiled or not), so it may
            # skip what would do nothing: no slot is taken, the ids map to themselves (a copy: an op's output
            # may not alias its input). Not on a device, where a CUDA graph replays what the body enqueued when
            # it was captured.
            self.calls.add_(1)
            return topk_ids.clone()
        need = counts.index_select(0, self.slot_expert) > 0
        copy_rows_where(need, self.staging, self.host)
        self.staged.index_add_(0, self.slot_expert, need.long())
        self.calls.add_(1)
        return self.slot_of[topk_ids].to(topk_ids.dtype)

    def _count(self, ids: torch.Tensor) -> torch.Tensor:
        """Tokens per expert, and a last count of 0 for free slots: ``bincount`` on the CPU; on a device, a
        scatter of fixed size (``bincount`` there reads the largest id back to the host)."""
        if self.device.type == "cpu":
            return torch.bincount(ids, minlength=self.num_experts + 1)
        ids = ids.long()
        return torch.zeros(self.num_experts + 1, dtype=torch.long, device=self.device).index_add_(
            0, ids, torch.ones_like(ids))

    # ---- the worker's reads: once per step, outside the forward -----------------------------------------------
    def step_counts(self, counters: Sequence[int], ran_forward: bool) -> tuple[list[int], int, int]:
        """From this layer's ``counters`` as read after a step: (tokens routed to each expert, stagings, unstaged).
        **Unstaged** counts the offloaded experts routed but not staged, plus 1 where the step ran the model while
        experts were out and this layer's per-call path did not run (a forward that left it out): tokens computed
        from home rows the KV cache may hold. It must stay 0."""
        e = self.num_experts
        routed, staged, calls = list(counters[:e]), counters[e:2 * e], counters[2 * e + 1]
        unstaged = sum(1 for expert in self.out if routed[expert] and not staged[expert])
        if self.out and ran_forward and not calls:
            unstaged += 1
        return routed, sum(staged), unstaged


def take_counts(layers: Sequence[ExpertSlots]) -> list[list[int]]:
    """Every layer's counters since the last call, read in one transfer, and zeroed."""
    if not layers:
        return []
    counters = [slots.counters for slots in layers]
    values = torch.stack(counters).tolist() if len({c.shape for c in counters}) == 1 else [
        c.tolist() for c in counters]
    for counter in counters:
        counter.zero_()
    return values


def _page_experts(topk_ids: torch.Tensor, name: str) -> torch.Tensor:
    return SLOTS[name].route(topk_ids)


def _page_experts_fake(topk_ids: torch.Tensor, name: str) -> torch.Tensor:
    return torch.empty_like(topk_ids)


_LIB = torch.library.Library("moetide", "FRAGMENT")
_LIB.define("page_experts(Tensor topk_ids, str name) -> Tensor")
_LIB.impl("page_experts", _page_experts, "CompositeExplicitAutograd")
torch.library.register_fake("moetide::page_experts", _page_experts_fake, lib=_LIB)


def page_experts(topk_ids: torch.Tensor, name: str) -> torch.Tensor:
    """The per-call path of the layer ``name`` as the forward calls it: ``ExpertSlots.route`` behind the op."""
    return torch.ops.moetide.page_experts(topk_ids, name)


def copy_rows_where(need: torch.Tensor, dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> None:
    """``dst[s] = src[s]`` for every ``s`` with ``need[s]``, for each (dst, src); other rows untouched. The sources
    are host memory; on CUDA they must be pinned (the kernel reads them over the bus, and only the rows it
    copies)."""
    if need.device.type == "cpu":
        for slot in need.nonzero().view(-1).tolist():
            for dst, src in zip(dsts, srcs):
                dst[slot].copy_(src[slot])
        return
    from moetide.vllm.staging_kernel import copy_rows_where_cuda

    for dst, src in zip(dsts, srcs):
        copy_rows_where_cuda(need, dst, src)
