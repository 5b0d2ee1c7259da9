"""Published GPU measurements and the step model's figure for the same setup.

The step model (``perf.step``) is checked against GPUs only through what others have measured and published: a
fused-MoE layer's kernel time (vLLM's ``benchmark_moe.py``), a dense GEMM and an NCCL all-reduce (Vidur's
profiles), a whole ``benchmark_latency.py`` run, and a serving benchmark's TPOT, ITL, TTFT or output throughput at a
fixed concurrency. Each point carries its full setup and its source; ``modeled`` turns the setup into the shapes the
step model prices and returns the figure in the point's own unit, so ``measured / modeled`` is the model's error
(above 1: the model is too fast).

How a setup becomes steps:

* ``moe_layer`` (``kernel_us``): one MoE layer's routed-expert term at ``num_tokens`` tokens, plus its fixed time.
* ``gemm`` (``time_us``): one ``m x n x k`` GEMM, roofline of its FLOPs and of its operands' and result's bytes.
* ``allreduce`` (``time_us``): one all-reduce of ``message_bytes`` at ``tp``, NCCL's ring at every size (what
  Vidur's profiler times: ``torch.distributed.all_reduce``, never vLLM's custom all-reduce).
* ``latency`` (``avg_latency_s``): ``benchmark_latency.py`` as the engines of its time ran it: one prefill step of
  ``batch`` prompts of ``input_len`` tokens, then ``output_len - 1`` decode steps of the batch.
* ``serving`` at ``concurrency`` C with ``input_len`` I and ``output_len`` O (a closed loop that keeps C requests in
  flight): a decode step of C sequences at context I + O/2 (``t_dec``), and the extra time a step pays when one
  prompt's I tokens join C - 1 decodes (``delta``). Each request sees the other C - 1 prompts join during its O
  steps, and every O steps all C do, so ``mean_tpot_ms`` = t_dec + (C - 1) delta / O, ``median_itl_ms`` = t_dec
  (most steps carry no prompt while C is small against O), ``output_tok_per_s`` = C / (t_dec + C delta / O), and
  ``mean_ttft_ms`` (C = 1 only, no queue) the prompt's one step.

Stdlib only, like the rest of ``perf``; the data file and the comparison are ``benchmarks/published_gpu.py``'s.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

from moetide.errors import UserError
from moetide.perf.step import Efficiency, StepShape, StepTimeModel, allreduce_s
from moetide.specs import get_gpu, get_model

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp8": 1}
SETS = ("fit", "check")
# kind -> (its setup fields, the metrics it may carry)
KINDS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "moe_layer": (("num_tokens",), ("kernel_us",)),
    "gemm": (("m", "n", "k"), ("time_us",)),
    "allreduce": (("message_bytes",), ("time_us",)),
    "latency": (("batch", "input_len", "output_len"), ("avg_latency_s",)),
    "serving": (("concurrency", "input_len", "output_len"),
                ("mean_tpot_ms", "median_itl_ms", "output_tok_per_s", "mean_ttft_ms")),
}
NEEDS_MODEL = ("moe_layer", "latency", "serving")
REQUIRED = ("id", "set", "kind", "metric", "value", "gpu", "tp", "dtype", "engine", "source", "quote", "group")


@dataclass(frozen=True, slots=True)
class PublishedPoint:
    """One published measurement: what was measured, on what, how, and where it was published."""

    id: str
    set: str  # "fit": coefficients are fitted on it; "check": never fitted on
    group: str  # the source table it belongs to (the fit weighs each group alike)
    kind: str
    metric: str
    value: float
    model: str | None
    gpu: str
    tp: int
    dtype: str
    engine: str
    engine_version: str | None
    source: str
    setup: dict[str, int] = field(default_factory=dict)


def load_points(path: Path) -> list[PublishedPoint]:
    """The points of a JSON-lines file; ``UserError`` naming the file, line and field of the first bad one."""
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise UserError(f"{path}: cannot read: {exc.strerror}") from None
    points, seen = [], set()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UserError(f"{where}: not JSON: {exc.msg}") from None
        point = _point(row, where)
        if point.id in seen:
            raise UserError(f"{where}: field 'id': {point.id!r} appears twice")
        seen.add(point.id)
        points.append(point)
    return points


def _point(row: object, where: str) -> PublishedPoint:
    if not isinstance(row, dict):
        raise UserError(f"{where}: a point is a JSON object")
    for name in REQUIRED:
        if row.get(name) in (None, ""):
            raise UserError(f"{where}: field '{name}' is missing")
    kind, metric = row["kind"], row["metric"]
    if kind not in KINDS:
        raise UserError(f"{where}: field 'kind': {kind!r} is not one of {sorted(KINDS)}")
    fields, metrics = KINDS[kind]
    if metric not in metrics:
        raise UserError(f"{where}: field 'metric': {metric!r} is not one of {list(metrics)} for {kind}")
    if row["set"] not in SETS:
        raise UserError(f"{where}: field 'set': {row['set']!r} is not one of {list(SETS)}")
    if row["dtype"] not in DTYPE_BYTES:
        raise UserError(f"{where}: field 'dtype': {row['dtype']!r} is not one of {sorted(DTYPE_BYTES)}")
    if kind in NEEDS_MODEL and not row.get("model"):
        raise UserError(f"{where}: field 'model' is missing (a {kind} point is priced on a model)")
    setup = {}
    for name in (*fields, "tp"):
        value = row.get(name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UserError(f"{where}: field '{name}': expected a positive integer, got {value!r}")
        setup[name] = value
    if metric == "mean_ttft_ms" and setup["concurrency"] != 1:
        raise UserError(f"{where}: field 'concurrency': a TTFT is a step shape only without a queue (1)")
    value = row["value"]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise UserError(f"{where}: field 'value': expected a positive number, got {value!r}")
    for name in ("gpu", "model"):
        if row.get(name):
            try:
                (get_gpu if name == "gpu" else get_model)(row[name])
            except (UserError, KeyError, ValueError) as exc:
                raise UserError(f"{where}: field '{name}': {exc}") from None
    tp = setup.pop("tp")
    return PublishedPoint(row["id"], row["set"], row["group"], kind, metric, float(value), row.get("model"),
                          row["gpu"], tp, row["dtype"], row["engine"], row.get("engine_version"), row["source"],
                          setup)


def modeled(point: PublishedPoint, efficiency: Efficiency) -> float:
    """The step model's figure for the point's setup, in the point's unit."""
    return _figure(point, efficiency)[0]


def explain(point: PublishedPoint, efficiency: Efficiency) -> dict[str, float]:
    """The terms behind ``modeled``, in seconds: the representative step's breakdown (or the kernel's roofline)."""
    return _figure(point, efficiency)[1]


def _figure(point: PublishedPoint, e: Efficiency) -> tuple[float, dict[str, float]]:
    gpu, setup = get_gpu(point.gpu), point.setup
    if point.kind == "gemm":
        return _gemm(point, e)
    if point.kind == "allreduce":
        seconds = allreduce_s(gpu, point.tp, replace(e, custom_allreduce_max_bytes=0), setup["message_bytes"])
        return seconds * 1e6, {"allreduce_s": seconds}
    assert point.model is not None
    step = StepTimeModel(get_model(point.model), gpu, tp=point.tp, dtype_bytes=DTYPE_BYTES[point.dtype],
                         efficiency=e)
    if point.kind == "moe_layer":
        terms = step.moe_layer_terms(setup["num_tokens"])
        return sum(terms.values()) * 1e6, terms
    if point.kind == "latency":
        return _latency(step, setup["batch"], setup["input_len"], setup["output_len"])
    return _serving(step, point.metric, setup["concurrency"], setup["input_len"], setup["output_len"])


def _gemm(point: PublishedPoint, e: Efficiency) -> tuple[float, dict[str, float]]:
    gpu, (m, n, k), b = get_gpu(point.gpu), (point.setup[x] for x in "mnk"), DTYPE_BYTES[point.dtype]
    compute_s = 2 * m * n * k / (gpu.matmul_flops_per_s * e.matmul)
    memory_s = (n * k + m * k + m * n) * b / (gpu.hbm_bandwidth_bytes_per_s * e.hbm)
    return max(compute_s, memory_s) * 1e6, {"compute_s": compute_s, "memory_s": memory_s}


def _latency(step: StepTimeModel, batch: int, input_len: int, output_len: int) -> tuple[float, dict[str, float]]:
    prefill = StepShape(batch * input_len, batch, 0, batch * input_len, batch * input_len * (input_len + 1) // 2)
    prefill_s = step.step_time_s(*prefill.as_args())
    decode_s = sum(step.step_time_s(*StepShape.decode(batch, input_len + j).as_args()) for j in range(output_len - 1))
    mid = step.breakdown(StepShape.decode(batch, input_len + output_len // 2))
    return prefill_s + decode_s, {"prefill_s": prefill_s, "decode_s": decode_s,
                                  **{k: v for k, v in mid.items() if k.endswith("_s")}}


def _serving(step: StepTimeModel, metric: str, concurrency: int, input_len: int,
             output_len: int) -> tuple[float, dict[str, float]]:
    c, context = concurrency, input_len + output_len // 2
    if metric == "mean_ttft_ms":
        shape = StepShape.prefill(input_len)
        return step.step_time_s(*shape.as_args()) * 1e3, step.breakdown(shape)
    decode = StepShape.decode(c, context)
    t_dec = step.step_time_s(*decode.as_args())
    mixed = StepShape(c - 1 + input_len, c, c - 1, (c - 1) * (context + 1) + input_len,
                      (c - 1) * (context + 1) + input_len * (input_len + 1) // 2)
    delta = step.step_time_s(*mixed.as_args()) - t_dec
    terms = {**{k: v for k, v in step.breakdown(decode).items() if k.endswith("_s")}, "prompt_step_extra_s": delta}
    if metric == "median_itl_ms":
        return t_dec * 1e3, terms
    if metric == "mean_tpot_ms":
        return (t_dec + (c - 1) * delta / output_len) * 1e3, terms
    return c / (t_dec + c * delta / output_len), terms
