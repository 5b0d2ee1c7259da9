"""The expert pager's cost with nothing offloaded: vLLM's decode with moetide's plugin loaded against stock vLLM.

With the plugin registered, vLLM builds ``moetide.vllm.pager.PagedUnquantizedFusedMoEMethod`` for every
unquantized MoE layer; where the policy cannot offload its ``apply`` is vLLM's, and where it can, each call runs the
pager's per-call path (``moetide::page_experts``) first, even with nothing offloaded. This measures what that
costs, in vLLM's default mode (a compiled forward) or ``--mode eager``. Four long-lived peers, each one process
running ``LLM`` in-process on one core:

* ``stock``: ``MOETIDE_VLLM_DISABLE=1``, vLLM as installed;
* ``pager``: the plugin loaded (so every MoE layer is the pager's method, nothing offloaded) and nothing else
  configured: the pager's hot path alone;
* ``plugin``: moetide's scheduler and connector configured too, with ``policy: vllm`` (the line never moves): the
  scheduler seam and the step costs run every step as well;
* ``vamp``: the same with ``policy: vamp`` and a KV cache that never runs short, so nothing is offloaded: every MoE
  call runs the per-call path (it counts the routing, finds no routed offloaded expert, maps the ids), and the
  workers send the counts to the scheduler's residency every step.

A round is, for each peer in turn (the order reversed every other round), two ``generate`` calls on the same
fresh prompts: one token, then ``1 + --decode-tokens``; the decode rate is ``batch × decode_tokens`` over the
difference. Warm-up rounds are discarded. Prints one JSON line per peer (decode tokens/s: min, median, max over the
rounds) and one per peer against stock: the median of per-round paired ratios with their quartiles and range; a
ratio whose paired range straddles 1.0 says so. The peers run one after another within a round, all pinned to the
same core (``--core``), and ``--clock cpu`` (the default) times the process's CPU seconds rather than the wall
clock, so time the core spends on other processes counts for no peer. Nothing asserts a speed.

    /work/venv-vllm/bin/python benchmarks/vllm_pager_hot_path.py [--model DIR] [--batch 8] [--rounds 7]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PEERS = ("stock", "pager", "plugin", "vamp")
PEER = r'''
import json, os, sys, time, random
from vllm import LLM, SamplingParams
spec = json.loads(sys.argv[1])
kwargs = dict(model=spec["model"], dtype="bfloat16", max_model_len=1024, enforce_eager=spec["eager"], seed=0,
              kv_cache_memory_bytes=64 << 20, max_num_seqs=64)
if spec["plugin"] in ("plugin", "vamp"):
    from moetide.vllm.settings import SCHEDULER_CLS, PluginSettings
    policy = "vllm" if spec["plugin"] == "plugin" else "vamp"
    kwargs.update(scheduler_cls=SCHEDULER_CLS, kv_transfer_config=PluginSettings(policy=policy).kv_transfer_config())
llm = LLM(**kwargs)
now = time.process_time if spec["clock"] == "cpu" else time.perf_counter
print("READY", flush=True)
for line in sys.stdin:
    seed, batch, decode = json.loads(line)
    rng = random.Random(seed)
    prompts = [{"prompt_token_ids": [rng.randrange(10, 500) for _ in range(64)]} for _ in range(batch)]
    times = []
    for n in (1, 1 + decode):
        start = now()
        llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True), use_tqdm=False)
        times.append(now() - start)
    print(json.dumps(times), flush=True)
'''


def start(model: str, peer: str, core: int, clock: str, eager: bool) -> subprocess.Popen:
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", OMP_NUM_THREADS="1", VLLM_CPU_OMP_THREADS_BIND=str(core),
               MOETIDE_VLLM_DISABLE="1" if peer == "stock" else "0", PYTHONPATH=str(ROOT / "src"))
    process = subprocess.Popen(["taskset", "-c", str(core), sys.executable, "-c", PEER,
                                json.dumps({"model": model, "plugin": peer, "clock": clock, "eager": eager})],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                               env=env)
    for line in process.stdout:
        if line.startswith("READY"):
            return process
    raise RuntimeError(f"the {peer} peer did not start")


def round_of(process: subprocess.Popen, seed: int, batch: int, decode: int) -> float:
    process.stdin.write(json.dumps([seed, batch, decode]) + "\n")
    process.stdin.flush()
    short, long = json.loads(process.stdout.readline())
    return batch * decode / max(long - short, 1e-9)


def make_model(workdir: Path) -> str:
    """A qwen3_moe checkpoint big enough that the MoE layers are a visible part of a decode step."""
    from moetide.engine.testmodel import TinyModelArgs, make_test_model

    out = workdir / "qwen3_moe-bf16"
    if not (out / "config.json").is_file():
        make_test_model(TinyModelArgs(arch="qwen3_moe", num_layers=4, hidden_size=512, num_attention_heads=8,
                                      num_kv_heads=2, head_dim=64, num_experts=16, moe_intermediate_size=256,
                                      dtype="bfloat16"), out)
    return str(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="checkpoint folder (default: a 4-layer qwen3_moe made in --workdir)")
    parser.add_argument("--workdir", default=str(Path(tempfile.gettempdir()) / "moetide-pager-bench"))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--core", type=int, default=os.cpu_count() - 1, help="the one core every peer runs on")
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                        help="time each generate call by the peer's CPU seconds (default) or the wall clock")
    parser.add_argument("--mode", choices=("default", "eager"), default="default",
                        help="vLLM's default (a compiled forward) or --enforce-eager")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "src"))
    model = args.model or make_model(Path(args.workdir))
    peers = {name: start(model, name, args.core, args.clock, args.mode == "eager") for name in PEERS}
    rates: dict[str, list[float]] = {name: [] for name in peers}
    try:
        for r in range(args.warmup + args.rounds):
            order = list(peers) if r % 2 == 0 else list(reversed(list(peers)))
            got = {name: round_of(peers[name], 1000 + r, args.batch, args.decode_tokens) for name in order}
            if r >= args.warmup:
                for name, rate in got.items():
                    rates[name].append(rate)
    finally:
        for process in peers.values():
            process.kill()
    for name, values in rates.items():
        print(json.dumps({"peer": name, "model": model, "mode": args.mode, "batch": args.batch, "decode_tokens_per_s": {
            "min": round(min(values), 1), "median": round(statistics.median(values), 1),
            "max": round(max(values), 1)}, "rounds": len(values)}))
    for name in PEERS[1:]:
        paired = [p / s for p, s in zip(rates[name], rates["stock"])]
        low, _, high = statistics.quantiles(paired, n=4) if len(paired) > 1 else (paired[0],) * 3
        print(json.dumps({"ratio": f"{name}/stock decode", "mode": args.mode, "clock": args.clock,
                          "value": round(statistics.median(paired), 4), "paired_q1": round(low, 4),
                          "paired_q3": round(high, 4), "paired_min": round(min(paired), 4),
                          "paired_max": round(max(paired), 4), "straddles_1": min(paired) < 1.0 < max(paired)}))


if __name__ == "__main__":
    main()
