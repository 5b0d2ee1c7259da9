"""WriteScope's host KV tier in vLLM 0.32's CPU build (``moetide.vllm.host_tier``) against stock vLLM and vLLM's
own CPU offload (``--kv-offloading-size``, the ``OffloadingConnector``), with the same device KV.

Cases (each engine in a fresh process; one JSON line per run):

* ``split``: one 16K-token prompt (eight times a 2 MiB device pool) and a short one, under each split policy
  (``transfer-all``, ``cpu-all``, ``fixed-ratio`` 0.5, ``writescope``), and stock vLLM with the whole KV on the
  device for reference: the tokens of each against stock's, the split it made (blocks attended by the CPU in
  place and streamed), writescope's correction factor, and the wall time of the run and per engine step.
* ``aggregate``: many sequences at once whose total context is >= 50x the device pool, every request finishing;
  beside it stock vLLM and vLLM's OffloadingConnector with the same device KV on the same prompts (they run the
  sequences the device pool holds at a time, and refuse a sequence longer than it).

On this machine the "device" is the CPU too: the split's costs are a GPU's (``--split-gpu``), modeled, and the
step times are the CPU's doing all of it. The checkpoint is a tiny random qwen3_moe (``make-test-model``).

    .venv/bin/python benchmarks/vllm_host_tier.py [--cases split aggregate] [--model DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from moetide.core.splits import DEFAULT_SPLIT_GPU

DEVICE_KV = 2 << 20
POLICIES = {"transfer-all": {}, "cpu-all": {}, "fixed-ratio": {"split_fixed_ratio": 0.5}, "writescope": {}}


def prompt(seed: int, length: int) -> list[int]:
    return [(7 * seed + 13 * j + (j * j) % 11) % 500 + 3 for j in range(length)]


def child(spec: dict) -> None:
    """One engine: generate, print ``RESULT {json}``."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from moetide.vllm.settings import SCHEDULER_CLS, PluginSettings

    kwargs = dict(model=spec["model"], dtype="bfloat16", max_model_len=spec["max_model_len"],
                  kv_cache_memory_bytes=spec["kv_cache_memory"], max_num_seqs=spec["max_num_seqs"], seed=0)
    if spec.get("plugin") is not None:
        kwargs.update(scheduler_cls=SCHEDULER_CLS, worker_extension_cls="moetide.vllm.worker.MoetideWorkerExtension",
                      kv_transfer_config=PluginSettings.from_extra_config(spec["plugin"]).kv_transfer_config())
    if spec.get("kv_offloading_size"):
        kwargs.update(kv_offloading_size=spec["kv_offloading_size"], kv_offloading_backend="native")
    llm = LLM(**kwargs)
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in spec["prompts"]]
    params = SamplingParams(max_tokens=spec["max_tokens"], temperature=0, ignore_eos=True)
    began = time.perf_counter()
    done = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - began
    tier = llm.collective_rpc("moetide_host_tier_stats")[0] if spec.get("plugin") is not None else None
    print("RESULT " + json.dumps({"outputs": [list(o.outputs[0].token_ids) for o in done], "seconds": seconds,
                                  "finished": sum(o.finished for o in done), "host_tier": tier}), flush=True)


def run(spec: dict, *, plugin: bool) -> dict:
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", MOETIDE_VLLM_DISABLE="0" if plugin else "1")
    done = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], env=env, capture_output=True,
                          text=True, timeout=3600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not lines:
        errors = [line for line in done.stderr.splitlines() if "Error" in line]
        return {"error": (errors[-1] if errors else done.stderr[-300:]).strip()[:400]}
    return json.loads(lines[-1][len("RESULT "):])


def line(case: str, engine: str, result: dict, reference: dict | None, **extra) -> None:
    out = {"bench": "vllm_host_tier", "case": case, "engine": engine, "device_kv_bytes": DEVICE_KV, **extra}
    if "error" in result:
        out["error"] = result["error"]
    else:
        generated = sum(map(len, result["outputs"]))
        out.update(seconds=round(result["seconds"], 3), finished=result["finished"],
                   output_tokens_per_s=round(generated / result["seconds"], 2))
        if reference is not None and "outputs" in reference:
            out["tokens_equal_stock"] = result["outputs"] == reference["outputs"]
        tier = result.get("host_tier")
        if tier:
            out.update({k: tier[k] for k in ("split_policy", "cpu_blocks", "streamed_blocks", "steps",
                                             "correction_factor", "host_blocks_written", "peak_kv_tokens",
                                             "cpu_s", "predicted_cpu_s")})
            out["s_per_split_step"] = round(result["seconds"] / max(tier["steps"], 1), 4)
    print(json.dumps(out), flush=True)


def split_case(model: str, split_gpu: str) -> None:
    spec = {"model": model, "max_model_len": 17_000, "max_num_seqs": 8, "max_tokens": 32,
            "prompts": [prompt(5, 16_000), prompt(6, 200)]}
    stock = run({**spec, "kv_cache_memory": 64 << 20}, plugin=False)
    line("split", "stock-whole-kv-on-device", stock, None, kv_cache_bytes=64 << 20)
    line("split", "stock", run({**spec, "kv_cache_memory": DEVICE_KV}, plugin=False), stock)
    for policy, extra in POLICIES.items():
        tier = {"kv_host_memory": 64 << 20, "split_policy": policy, "split_gpu": split_gpu, **extra}
        line("split", "moetide-host-tier", run({**spec, "kv_cache_memory": DEVICE_KV, "plugin": tier}, plugin=True),
             stock, kv_host_bytes=64 << 20)


def aggregate_case(model: str, split_gpu: str, num_seqs: int, length: int) -> None:
    spec = {"model": model, "max_model_len": length + 64, "max_num_seqs": num_seqs, "max_tokens": 16,
            "prompts": [prompt(100 + i, length) for i in range(num_seqs)], "kv_cache_memory": DEVICE_KV}
    host = 2 * num_seqs * (length + 64) * 1024  # 1 KiB a token for the test checkpoint, twice over
    common = dict(num_seqs=num_seqs, total_context_tokens=num_seqs * (length + 16),
                  context_over_device_pool=round(num_seqs * (length + 16) / (DEVICE_KV / 1024), 1))
    stock = run(spec, plugin=False)
    line("aggregate", "stock", stock, None, **common)
    offload = run({**spec, "kv_offloading_size": host / 2**30}, plugin=False)
    line("aggregate", "vllm-offloading-connector", offload, stock, kv_offloading_bytes=host, **common)
    tier = {"kv_host_memory": host, "split_gpu": split_gpu}
    line("aggregate", "moetide-host-tier", run({**spec, "plugin": tier}, plugin=True), stock, kv_host_bytes=host,
         **common)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--cases", nargs="+", choices=("split", "aggregate"), default=["split", "aggregate"])
    parser.add_argument("--model", help="a qwen3_moe or mixtral checkpoint with head_dim 64 (default: make one)")
    parser.add_argument("--split-gpu", default=DEFAULT_SPLIT_GPU, help="the GPU the split's costs are priced for")
    parser.add_argument("--aggregate-seqs", type=int, default=56)
    parser.add_argument("--aggregate-length", type=int, default=1_900)
    args = parser.parse_args()
    if args.child:
        child(json.loads(args.child))
        return
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from moetide.engine.testmodel import TinyModelArgs, make_test_model

            model = str(make_test_model(TinyModelArgs(arch="qwen3_moe", head_dim=64, dtype="bfloat16",
                                                      max_position_embeddings=20_000), Path(tmp) / "qwen3_moe"))
        if "split" in args.cases:
            split_case(model, args.split_gpu)
        if "aggregate" in args.cases:
            aggregate_case(model, args.split_gpu, args.aggregate_seqs, args.aggregate_length)


if __name__ == "__main__":
    main()
