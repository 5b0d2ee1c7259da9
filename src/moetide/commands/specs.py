"""``moetide specs``: print the model and hardware facts every other verb builds on.

With no selection it prints all presets as three tables (models, GPUs, host CPUs); ``--model``, ``--gpu`` and
``--cpu`` (each repeatable, a preset name or a file; a model also as its checkpoint folder) print only what was
asked for. ``--json PATH`` writes the same facts, exact integers included, as one JSON document (``-``:
stdout). Bad input (an unknown name, a malformed or unsupported
config.json) surfaces as ``UserError``: one line on stderr and exit code 2, from ``moetide.cli``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from moetide.commands.options import add_json_argument, check_outputs, write_json_output
from moetide.errors import UserError
from moetide.report.tables import format_table
from moetide.report.units import count_text
from moetide.specs import (
    HardwareSpec,
    HostSpec,
    ModelSpec,
    all_gpus,
    all_hosts,
    all_models,
    get_gpu,
    get_host,
    get_model,
)

MiB, GiB = 2**20, 2**30
DTYPE_NAMES = {1: "fp8/int8", 2: "bf16/fp16", 4: "fp32"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", action="append", metavar="NAME|DIR|CONFIG_JSON",
                        help="a preset model name, a checkpoint folder or its HF config.json (repeatable)")
    parser.add_argument("--gpu", action="append", metavar="NAME|FILE",
                        help="a preset GPU name or a path to a .toml/.json hardware file (repeatable)")
    parser.add_argument("--cpu", action="append", metavar="NAME|FILE",
                        help="a preset host CPU name or a path to a .toml/.json host file (repeatable)")
    parser.add_argument("--dtype-bytes", type=int, default=2, metavar="N",
                        help="bytes per weight and KV element for byte figures (default 2 = bf16)")
    add_json_argument(parser, "the facts instead of tables")


def _select(args: argparse.Namespace) -> dict[str, list]:
    """Specs to show, by kind; everything when nothing was asked for."""
    if not (args.model or args.gpu or args.cpu):
        return {"models": all_models(), "gpus": all_gpus(), "hosts": all_hosts()}
    chosen: dict[str, list] = {}
    if args.model:
        chosen["models"] = [get_model(m) for m in args.model]
    if args.gpu:
        chosen["gpus"] = [get_gpu(g) for g in args.gpu]
    if args.cpu:
        chosen["hosts"] = [get_host(h) for h in args.cpu]
    return chosen


# ---- tables -----------------------------------------------------------------------------------------------


def _experts(m: ModelSpec) -> str:
    return f"{m.num_experts} + {m.num_shared_experts} shared" if m.num_shared_experts else str(m.num_experts)


def _model_row(m: ModelSpec, dtype_bytes: int) -> list[object]:
    layers = f"{m.num_layers} ({len(m.full_attention_layer_ids)}/{len(m.linear_attention_layer_ids)})"
    state = m.linear_state_bytes_per_seq(dtype_bytes)
    return [m.name, layers, _experts(m), m.num_experts_per_tok, count_text(m.params_total),
            count_text(m.params_active), f"{m.expert_bytes(dtype_bytes) / MiB:.2f}",
            f"{m.kv_bytes_per_token(dtype_bytes):,}", f"{state / MiB:.2f} MiB" if state else None]


def models_table(models: list[ModelSpec], dtype_bytes: int) -> str:
    headers = ["model", "layers (full/linear)", "experts", "top-k", "params total", "params active",
               "expert MiB", "KV B/token", "linear state/seq"]
    dtype = DTYPE_NAMES.get(dtype_bytes, f"{dtype_bytes}-byte")
    title = f"Models ({dtype}: {dtype_bytes} B per weight and KV element; KV over full-attention layers only)"
    rows = [_model_row(m, dtype_bytes) for m in models]
    return title + "\n" + format_table(headers, rows, align="<>>>>>>>>")


def _gpu_row(g: HardwareSpec) -> list[object]:
    return [g.name, f"{g.hbm_bytes / GiB:.0f}", f"{g.hbm_bandwidth_bytes_per_s / 1e9:,.0f}",
            f"{g.matmul_flops_per_s / 1e12:.1f} {g.matmul_dtype}", g.host_link or None,
            f"{g.host_link_bandwidth_bytes_per_s / 1e9:g}", f"{g.gpu_link_bandwidth_bytes_per_s / 1e9:g}"]


def gpus_table(gpus: list[HardwareSpec]) -> str:
    headers = ["gpu", "HBM GiB", "HBM GB/s", "dense TFLOP/s", "host link", "H2D GB/s (measured)",
               "NVLink GB/s (1 way)"]
    return "GPUs\n" + format_table(headers, [_gpu_row(g) for g in gpus], align="<>>><>>")


def _host_row(h: HostSpec) -> list[object]:
    return [h.name, h.cpu_model, h.num_cores, f"{h.num_memory_channels} x {h.dram_mega_transfers_per_s} MT/s",
            f"{h.peak_dram_bandwidth_bytes_per_s / 1e9:.1f}", f"{h.dram_efficiency:.2f}",
            f"{h.dram_bandwidth_bytes_per_s / 1e9:.1f}", f"{h.fp32_flops_per_s / 1e12:.2f}",
            f"{h.dram_bytes / GiB:.0f}"]


def hosts_table(hosts: list[HostSpec]) -> str:
    headers = ["host", "cpu (one socket)", "cores", "DRAM channels", "peak GB/s", "efficiency", "sustained GB/s",
               "FP32 TFLOP/s", "DRAM GiB"]
    return "Host CPUs\n" + format_table(headers, [_host_row(h) for h in hosts], align="<<>>>>>>>")


# ---- JSON -------------------------------------------------------------------------------------------------


def model_facts(m: ModelSpec, dtype_bytes: int) -> dict[str, object]:
    derived = {
        "full_attention_layer_ids": list(m.full_attention_layer_ids),
        "linear_attention_layer_ids": list(m.linear_attention_layer_ids),
        "params_total": m.params_total, "params_active": m.params_active,
        "params_non_expert": m.params_non_expert, "params_per_expert": m.params_per_expert,
        "expert_bytes": m.expert_bytes(dtype_bytes),
        "routed_expert_bytes_total": m.routed_expert_bytes_total(dtype_bytes),
        "non_expert_bytes": m.non_expert_bytes(dtype_bytes),
        "kv_bytes_per_token": m.kv_bytes_per_token(dtype_bytes),
        "linear_state_bytes_per_seq": m.linear_state_bytes_per_seq(dtype_bytes),
    }
    return {**dataclasses.asdict(m), "derived": derived}


def hardware_facts(spec: HardwareSpec | HostSpec) -> dict[str, object]:
    facts: dict[str, object] = dataclasses.asdict(spec)
    if isinstance(spec, HostSpec):
        facts["derived"] = {"peak_dram_bandwidth_bytes_per_s": spec.peak_dram_bandwidth_bytes_per_s,
                            "dram_bandwidth_bytes_per_s": spec.dram_bandwidth_bytes_per_s}
    return facts


def run(args: argparse.Namespace) -> int:
    if args.dtype_bytes <= 0:
        raise UserError(f"--dtype-bytes must be a positive integer (2 = bf16), got {args.dtype_bytes}")
    check_outputs(args)
    chosen = _select(args)
    if args.json:
        doc: dict[str, object] = {"dtype_bytes": args.dtype_bytes}
        doc.update({k: [model_facts(m, args.dtype_bytes) for m in v] if k == "models"
                    else [hardware_facts(s) for s in v] for k, v in chosen.items()})
        write_json_output(args.json, json.dumps(doc, indent=2))
        if args.json != "-":
            print(f"wrote {args.json}")
        return 0
    renderers = {"models": lambda v: models_table(v, args.dtype_bytes), "gpus": gpus_table, "hosts": hosts_table}
    print("\n\n".join(renderers[kind](specs) for kind, specs in chosen.items()))
    return 0
