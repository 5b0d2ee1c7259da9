"""``moetide calibrate --model DIR [--device-out FILE.toml]``: this CPU described as the device the replay models.

The engine's steps on the checkpoint are timed (``engine.measure.measure_engine_steps``) and the step-time model
fitted to them (``perf.step_calibrate``); the device file holds HardwareSpec fields from the calibration's own
measurements (DRAM triad as the memory bandwidth, the fp32 GEMM as the matmul rate), the fitted ``[efficiency]``
and the fit's record in ``[measured]``, so ``moetide replay --gpu FILE --model DIR`` predicts what ``moetide serve
--model DIR`` does here (docs/serve.md holds that prediction against a measured run).
"""

from __future__ import annotations

import dataclasses
import statistics
from collections import defaultdict
from pathlib import Path

from moetide.commands.options import checkpoint_dir, write_text_file
from moetide.errors import UserError, read_json
from moetide.perf.calibrate import Calibration
from moetide.perf.step import StepTimeModel
from moetide.perf.step_calibrate import (StepFit, StepSample, fit_request_overhead, fit_step_efficiency,
                                         step_efficiency_for_gpu)
from moetide.report.tables import format_table
from moetide.report.toml import toml_line
from moetide.specs import HardwareSpec, get_gpu, get_model

CPU_DTYPE_BYTES = 4  # the GEMM calibrate times is fp32; a bf16 checkpoint would need a bf16 rate


def check_model(model: str) -> Path:
    """The checkpoint folder, refused unless fp32 (before anything is measured)."""
    folder = checkpoint_dir(model)
    config = read_json(folder / "config.json", f"--model {folder / 'config.json'}")
    dtype = (config.get("dtype") or config.get("torch_dtype") or "float32") if isinstance(config, dict) else None
    if dtype != "float32":
        raise UserError(f"--model {folder}: the checkpoint is {dtype}; a CPU device is calibrated at fp32 (the GEMM "
                        f"rate calibrate measures is fp32): give an fp32 checkpoint")
    return folder


def cpu_device(cal: Calibration, name: str) -> HardwareSpec:
    """HardwareSpec of this CPU from the calibration: DRAM is its HBM; copies stand for its links."""
    d = cal.dram
    return HardwareSpec(name=name, hbm_bytes=cal.dram_bytes, hbm_bandwidth_bytes_per_s=d.triad_bytes_per_s,
                        matmul_flops_per_s=cal.gemm_flops_per_s, matmul_dtype="fp32",
                        host_link_bandwidth_bytes_per_s=d.copy_bytes_per_s,
                        gpu_link_bandwidth_bytes_per_s=d.copy_bytes_per_s,
                        host_link="none: host and device memory are one DRAM (DRAM copy rate)",
                        source=f"moetide calibrate --model, {cal.measured_at}, {cal.num_threads} torch thread(s), "
                               f"{cal.cpu_model}")


def fit(cal: Calibration, folder: Path, samples: list[StepSample], requests: list[tuple[int, float]],
        name: str) -> tuple[HardwareSpec, StepFit]:
    device = cpu_device(cal, name)
    step_fit = fit_step_efficiency(samples, get_model(str(folder / "config.json")), device, CPU_DTYPE_BYTES)
    fixed, per_token = fit_request_overhead(requests)
    return device, dataclasses.replace(step_fit, request_overhead_s=fixed, request_overhead_s_per_token=per_token)


STEP_CALLS = {"moetide": "Engine.step", "vllm": "vLLM LLMEngine.step",  # what ``--engine`` timed, by name
              "vllm served": "served vLLM (moetide.vllm.measure.TimedScheduler)"}


def device_file_text(device: HardwareSpec, step_fit: StepFit, folder: Path, samples: list[StepSample],
                     engine: str = "moetide") -> str:
    fields = ("name", "hbm_bytes", "hbm_bandwidth_bytes_per_s", "matmul_flops_per_s", "matmul_dtype",
              "host_link_bandwidth_bytes_per_s", "gpu_link_bandwidth_bytes_per_s", "host_link", "source")
    notes = {"hbm_bytes": "installed memory (sysconf)", "hbm_bandwidth_bytes_per_s": "MEASURED DRAM triad",
             "matmul_flops_per_s": "MEASURED fp32 GEMM (torch.mm)"}
    lines = [
        "# Device file written by `moetide calibrate --model`: this CPU described as the device the replay models,",
        "# for `moetide replay --gpu THIS_FILE --model CHECKPOINT` (tp 1, fp32). MEASURED rates; FITTED [efficiency].",
        "",
        *(toml_line(f, getattr(device, f), notes.get(f, "")) for f in fields),
        "",
        f"# perf.step.Efficiency FITTED to {len(samples)} whole {STEP_CALLS[engine]} calls on {folder} "
        f"(perf.step_calibrate);",
        f"# the fit's error on those same steps: median {step_fit.median_abs_rel_error:.1%}, max "
        f"{step_fit.max_abs_rel_error:.1%}.",
        "[efficiency]",
        *(toml_line(k, v) for k, v in step_fit.table().items()),
        "",
        "# For the record (the model does not read it).",
        "[measured]",
        toml_line("model", str(folder)),
        toml_line("engine_steps", len(samples)),
        toml_line("fit_median_abs_rel_error", step_fit.median_abs_rel_error),
        toml_line("fit_max_abs_rel_error", step_fit.max_abs_rel_error),
    ]
    return "\n".join(lines) + "\n"


def write_device_file(path: Path, text: str) -> None:
    write_text_file("--device-out", path, text)
    get_gpu(str(path))  # what was written must read back; a failure here is a bug, not the user's
    step_efficiency_for_gpu(str(path))


def steps_table(device: HardwareSpec, step_fit: StepFit, folder: Path, samples: list[StepSample],
                engine: str = "moetide") -> str:
    """Measured and fitted step time per step size (tokens, sequences), medians."""
    model = StepTimeModel(get_model(str(folder / "config.json")), device, dtype_bytes=CPU_DTYPE_BYTES,
                          kv_dtype_bytes=CPU_DTYPE_BYTES, efficiency=step_fit.efficiency())
    groups: dict[tuple[int, int], list[tuple[float, float]]] = defaultdict(list)
    for s in samples:
        groups[s.shape.num_tokens, s.shape.num_seqs].append((s.seconds, model.step_time_s(*s.shape.as_args())))
    rows = []
    for (tokens, seqs), pairs in sorted(groups.items()):
        measured = statistics.median(m for m, _ in pairs)
        fitted = statistics.median(f for _, f in pairs)
        rows.append([tokens, seqs, len(pairs), f"{measured * 1e3:.2f}", f"{fitted * 1e3:.2f}",
                     f"{fitted / measured - 1:+.1%}"])
    table = format_table(["tokens", "seqs", "steps", "measured ms", "fit ms", "fit error"], rows)
    return (f"engine steps on {folder} (whole {STEP_CALLS[engine]} calls, MEASURED), and the step-time model "
            f"FITTED to them:\n"
            f"{table}\nfitted: matmul {step_fit.matmul:.3f}, attention {step_fit.attention:.3f} (of the GEMM "
            f"rate), hbm {step_fit.hbm:.3f}, attention_memory {step_fit.attention_memory:.3f} (of the triad), "
            f"step overhead {step_fit.step_overhead_s * 1e3:.3f} ms + {step_fit.seq_overhead_s * 1e3:.3f} ms per "
            f"sequence; error median {step_fit.median_abs_rel_error:.1%}, max {step_fit.max_abs_rel_error:.1%}; "
            f"per request (add_request) {step_fit.request_overhead_s * 1e3:.3f} ms + "
            f"{step_fit.request_overhead_s_per_token * 1e6:.3f} us per prompt token")
