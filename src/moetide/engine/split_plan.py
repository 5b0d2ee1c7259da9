"""The engine's per-step split decision: which host KV blocks the CPU attends in place and which are streamed.

Nothing is decided here either: ``core.splits`` owns the policies (writescope and the four baselines, one
registry) and the online correction; ``perf`` owns the costs. This module only wires them to the engine's step:

* ``PerfSplitCosts`` gives a step's ``SplitCosts`` from ``perf.offload`` — the same coefficients ``moetide
  plan-split`` optimises — for the checkpoint's ``ModelSpec`` (its config.json), a GPU preset or file and a host
  preset or file; a calibrated host file (``moetide calibrate``) also supplies its fitted ``[offload_efficiency]``.
  Any callable ``(device_tokens, num_queries) -> SplitCosts`` can stand in for it (tests pin the split that way).
* ``SplitStepper`` (``core.split_planner``'s, which the replay runs too) asks the named policy for each step's
  ``SeqSplit``s. For ``writescope`` that is ``core.split_planner.SplitPlanner``: the optimum of T(X) with the CPU side
  scaled by the correction factor k, and ``observe`` feeds back the *measured* CPU time of the step (the worker
  thread's time in the CPU partials, summed over layers) against the uncorrected prediction. The baselines are
  static: factor 1, nothing observed.
* ``SplitCounters`` are what the engine reports: blocks and tokens per region, measured and predicted CPU time.

On a machine without an accelerator the "device" is the CPU too, so the costs (a GPU's) do not describe the
machine the step runs on; the decisions are still carried out exactly, which is what parity tests need.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from moetide.core.splits import SeqResidency, SplitCosts, SplitPolicy, StepSplit
from moetide.core.split_planner import SplitStepper as CoreSplitStepper
from moetide.errors import UserError

SplitCostSource = Callable[[int, int], SplitCosts]  # (device-resident tokens, queries per sequence) -> costs


class PerfSplitCosts:
    """``SplitCosts`` from ``perf.offload.split_coefficients`` (module docstring)."""

    def __init__(self, model_dir: Path, *, gpu: str, host: str, kv_dtype_bytes: int, block_size: int) -> None:
        from moetide.perf.attention import AttentionCostModel, HostKVLayout
        from moetide.perf.calibrate import offload_efficiency_for_host
        from moetide.perf.offload import split_coefficients
        from moetide.specs import get_gpu, get_host, get_model

        model = get_model(str(model_dir / "config.json"))
        gpu_spec, host_spec = get_gpu(gpu), get_host(host)
        try:
            attention = AttentionCostModel(model, gpu_spec, host_spec, kv_dtype_bytes=kv_dtype_bytes,
                                           layout=HostKVLayout(block_size=block_size),
                                           offload=offload_efficiency_for_host(host))
        except ValueError as exc:
            raise UserError(f"split costs for {model_dir}: {exc}") from None
        self.attention = attention
        self._coefficients = split_coefficients

    def __call__(self, device_tokens: int, num_queries: int) -> SplitCosts:
        return SplitCosts(**dataclasses.asdict(self._coefficients(self.attention, device_tokens, num_queries)))


@dataclass
class SplitCounters:
    """Totals over steps that had host KV. Blocks and tokens are counted once per step (not per layer)."""

    steps: int = 0
    device_blocks: int = 0  # device/in-place
    cpu_blocks: int = 0  # host/in-place: attended by the CPU where they lie
    streamed_blocks: int = 0  # host/streamed: copied into the staging ring and attended there
    cpu_tokens: int = 0
    streamed_tokens: int = 0
    host_tokens_written: int = 0  # tokens whose K/V went to host blocks
    peak_host_blocks: int = 0  # most host blocks one step attended
    peak_device_blocks: int = 0  # most device blocks one step attended
    peak_kv_tokens: int = 0  # most KV tokens (all sequences' contexts) one step attended
    cpu_s: float = 0.0  # measured: the worker thread's time in CPU partials, all layers
    predicted_cpu_s: float = 0.0  # the uncorrected model's CPU time for the same work
    correction_factor: float = 1.0  # writescope's k at the end
    probes: int = 0  # writescope's probe steps: a few blocks on a CPU judged slow that got no work (split_planner)

    def as_dict(self) -> dict[str, float | int]:
        return dataclasses.asdict(self)


class SplitStepper(CoreSplitStepper):
    """``core.split_planner.SplitStepper`` (the replay runs the same one), with bad options as ``UserError``s."""

    def __init__(self, policy: str | SplitPolicy, costs: SplitCostSource, block_bytes: int,
                 fixed_ratio: float = 0.5) -> None:
        try:
            super().__init__(policy, costs, block_bytes, fixed_ratio)
        except ValueError as exc:
            raise UserError(str(exc)) from None


def plan_split_step(stepper: SplitStepper, counters: SplitCounters, on_host: list[list[bool]], contexts: list[int],
                    num_tokens: int, block_size: int) -> StepSplit | None:
    """One step's split of the host KV (None when no sequence uses a host block), counted in ``counters``.
    ``on_host[i]``: whether each used block of sequence i (table order) is host-resident; ``contexts[i]``: its
    tokens after the step; ``num_tokens``: the step's query tokens. The split's sequence ids are the indices i."""
    seqs = [SeqResidency(i, len(flags) - sum(flags), sum(flags)) for i, flags in enumerate(on_host)]
    if not any(s.num_host_blocks for s in seqs):
        return None
    bs = block_size
    tokens = [[min(bs, context - j * bs) for j in range(len(flags))] for flags, context in zip(on_host, contexts)]
    device_tokens = sum(n for flags, ns in zip(on_host, tokens) for h, n in zip(flags, ns) if not h)
    split = stepper.plan(seqs, device_tokens, max(1, num_tokens // len(seqs)))
    c = counters
    c.steps += 1
    c.peak_host_blocks = max(c.peak_host_blocks, sum(s.num_host_blocks for s in seqs))
    c.peak_device_blocks = max(c.peak_device_blocks, sum(s.num_device_blocks for s in seqs))
    c.peak_kv_tokens = max(c.peak_kv_tokens, sum(contexts))
    for s, flags, ns in zip(split.splits, on_host, tokens):
        c.device_blocks += s.num_device_blocks
        c.cpu_blocks += s.num_cpu_blocks
        c.streamed_blocks += s.num_streamed_blocks
        host_tokens = [n for h, n in zip(flags, ns) if h]
        c.cpu_tokens += sum(host_tokens[: s.num_cpu_blocks])
        c.streamed_tokens += sum(host_tokens[s.num_cpu_blocks :])
    return split


def observe_split_step(stepper: SplitStepper, counters: SplitCounters, split: StepSplit, cpu_s: float) -> None:
    """Close a step of ``plan_split_step``: its measured CPU seconds (all layers) to the counters and to the online
    correction (writescope)."""
    counters.cpu_s += cpu_s
    counters.predicted_cpu_s += split.predicted_cpu_s
    counters.probes += split.probe
    stepper.observe(split, cpu_s)
