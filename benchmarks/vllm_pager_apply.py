"""The expert pager's own cost per MoE call, nothing offloaded: its ``apply`` against vLLM's on the same inputs.

``vllm_pager_hot_path.py`` compares whole decode steps, and on a 2-core machine its paired rounds spread by ±15%:
too much to see a 2% cost. This isolates the part the pager adds. One process runs ``LLM`` in-process with the
plugin under ``vamp`` (so the layers keep their weights in shared memory and count routing), captures one MoE
layer's ``apply`` inputs from a batch-``--batch`` decode step, then calls the layer's ``apply``
(``PagedUnquantizedFusedMoEMethod``: the per-call path ``moetide::page_experts``, which counts the routing, finds no
routed offloaded expert and maps the ids, then vLLM's) and vLLM's own ``UnquantizedFusedMoEMethod.apply`` on those
inputs, in alternating order, ``--calls`` times each, on the CPU clock. Prints one JSON line: the median µs per
call of each, the added µs, and the added time over a whole decode step of the model (the added µs per call × MoE
layers ÷ the step's median µs, the step timed in the same process).

    .venv/bin/python benchmarks/vllm_pager_apply.py [--model DIR] [--batch 8] [--calls 3000]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="checkpoint folder (default: vllm_pager_hot_path.py's 4-layer qwen3_moe)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--core", type=int, default=os.cpu_count() - 1)
    args = parser.parse_args()
    os.sched_setaffinity(0, {args.core})
    os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", OMP_NUM_THREADS="1",
                      VLLM_CPU_OMP_THREADS_BIND=str(args.core))
    sys.path.insert(0, str(ROOT / "src"))
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from vllm_pager_hot_path import make_model

    from vllm import LLM, SamplingParams
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    from moetide.vllm import pager
    from moetide.vllm.settings import SCHEDULER_CLS, PluginSettings

    model = args.model or make_model(Path("/tmp/moetide-pager-bench"))
    llm = LLM(model=model, dtype="bfloat16", max_model_len=1024, enforce_eager=True, seed=0,
              kv_cache_memory_bytes=64 << 20, max_num_seqs=64, scheduler_cls=SCHEDULER_CLS,
              kv_transfer_config=PluginSettings(policy="vamp").kv_transfer_config())
    layers = pager.paged_layers()
    method = layers[0]
    if not method.line_enabled:
        raise SystemExit("the pager's layers have no slots: the plugin's vamp settings did not reach them")
    captured = {}
    apply = method.apply

    def capture(*call, **kw):
        captured["args"] = (call, kw)  # the last call: a decode step's
        return apply(*call, **kw)

    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(10, 500) for _ in range(64)]} for _ in range(args.batch)]
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)  # warm up; then capture a decode step's inputs
    method.apply = capture
    steps = []
    for _ in range(5):
        captured.clear()
        start = time.process_time()
        llm.generate(prompts, SamplingParams(max_tokens=33, temperature=0, ignore_eos=True), use_tqdm=False)
        steps.append((time.process_time() - start) / 33)
    method.apply = apply
    call, kw = captured["args"]
    names = ("layer", "x", "topk_weights", "topk_ids")
    tokens = int({**dict(zip(names, call)), **kw}["topk_ids"].shape[0])

    def stock(*c, **k):
        return UnquantizedFusedMoEMethod.apply(method, *c, **k)

    times: dict[str, list[int]] = {"pager": [], "vllm": []}
    order = [("pager", apply), ("vllm", stock)]
    for i in range(args.calls):
        for name, fn in order[i % 2:] + order[:i % 2]:
            start = time.process_time_ns()
            fn(*call, **kw)
            times[name].append(time.process_time_ns() - start)
    method.slots.counters.zero_()  # the counts the timing loop added
    us = {name: statistics.median(values) / 1e3 for name, values in times.items()}
    added = us["pager"] - us["vllm"]
    step_us = statistics.median(steps) * 1e6
    print(json.dumps({"model": model, "tokens_per_call": tokens, "calls": args.calls,
                      **{f"{name}_apply_us": round(value, 2) for name, value in us.items()},
                      "added_us_per_call": round(added, 2), "moe_layers": len(layers),
                      "decode_step_us": round(step_us, 1),
                      "added_share_of_decode_step": round(added * len(layers) / step_us, 4)}))

if __name__ == "__main__":
    main()
