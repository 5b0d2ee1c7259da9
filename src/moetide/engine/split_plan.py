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

from moetide.core.splits import SplitCosts, SplitPolicy
from moetide.core.split_planner import SplitStepper as CoreSplitStepper
from moetide.errors import UserError

SplitCostSource = Callable[[int, int], SplitCosts]  # (device-resident tokens, queries per sequence) -> costs
DEFAULT_SPLIT_GPU = "a100-80gb"


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
