"""1M tokens of KV held and decoded by the engine on CPU: host KV spill and split attention at scale.

Checkpoint: a random Qwen3-MoE made by ``moetide.engine.testmodel`` (2 layers, hidden 64, 4 query heads over 1 KV
head of 16, 4 experts of width 32, top-2, fp32): 256 bytes of KV per token, so 1M tokens are 256 MiB. Written once
into ``--workdir``.

Method, two turns of one conversation per sequence, greedy, eos ignored:

1. **prefill**: ``--num-seqs`` random prompts of ``--prompt-tokens`` tokens (default 512 × 2048 = 1,048,576
   tokens), one ``Engine.generate`` call of 1 token each, in steps of ``--max-num-batched-tokens``. The device KV
   budget (``--device-kv-mib``, default 64 MiB, a quarter of the KV) fills first; every later block is a host block
   (``--host-kv-mib``, default: what the rest needs plus 5%). A finished request's blocks stay in the prefix cache.
2. **decode**: the same sequences, each extended by its first token, in a second call of ``1 + --decode-tokens``
   tokens each. Every prompt block is a prefix-cache hit — the first turn's blocks, where they were written,
   nothing recomputed or moved — so every sequence is admitted at once (``max_num_seqs`` = the number of
   sequences), one step computes the last prompt token of each, and then every decode step attends every
   sequence's whole context: more than 1M tokens of KV per step, device and host blocks together.

The first call's steps are all prefill (``prefill_tokens_per_s``); the second call's steps after its first are
pure decode (``decode_tokens_per_s`` = sequences × steps / time). Each policy (``--policies``) runs in its own
subprocess, so its peak RSS is its own.

Output: one JSON line per policy: ``kv_tokens_held`` (the most KV tokens one decode step attended, all sequences),
``device_kv_bytes`` / ``host_kv_bytes`` (capacity) and ``*_used_bytes`` (at the step that held the most),
``peak_rss_mib``, ``prefill_tokens_per_s`` (tokens of steps that were not pure decode / their time),
``decode_tokens_per_s`` (pure decode steps: sequences × steps / time), the split counters (blocks per region,
measured and predicted CPU time, the correction factor) and the engine's other counters. On a machine without an
accelerator the "device" is the CPU too: the policies do the same work on the same cores, so their tokens/s differ
by threading and kernel choice, not by a link — nothing here is a GPU measurement.

Run: ``.venv/bin/python benchmarks/engine_1m_tokens.py`` from the repository root (a few minutes on 2 cores);
``--num-seqs 64 --prompt-tokens 1024`` for a quick look.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import subprocess
import sys
import time
from pathlib import Path

BENCHMARK = "engine_1m_tokens"
MODEL = dict(arch="qwen3_moe", num_layers=2, hidden_size=64, num_experts=4, num_experts_per_tok=2,
             num_attention_heads=4, num_kv_heads=1, head_dim=16, moe_intermediate_size=32)
MiB = 2**20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from moetide.core.splits import SPLIT_POLICIES

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--workdir", default="/tmp/moetide-bench-1m", help="where the checkpoint is written (reused)")
    add("--num-seqs", type=int, default=512)
    add("--prompt-tokens", type=int, default=2048)
    add("--decode-tokens", type=int, default=8, help="decode steps after the first token")
    add("--device-kv-mib", type=float, default=64.0)
    add("--host-kv-mib", type=float, help="default: the KV the device budget cannot hold, plus 5%%")
    add("--block-size", type=int, default=16)
    add("--max-num-batched-tokens", type=int, default=8192)
    add("--policies", default="writescope", help=f"comma-separated, from {', '.join(SPLIT_POLICIES)}; or 'all'")
    add("--threads", type=int, default=1, help="torch threads per thread (the CPU worker has its own)")
    add("--seed", type=int, default=0)
    add("--cpu", default=None, metavar="NAME|FILE",
        help="host preset or `moetide calibrate` file the split policy prices the CPU with (default: the engine's)")
    add("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    policies = list(SPLIT_POLICIES) if args.policies == "all" else args.policies.split(",")
    bad = [p for p in policies if p not in SPLIT_POLICIES]
    if bad or min(args.num_seqs, args.prompt_tokens, args.block_size, args.threads) < 1 or args.decode_tokens < 0:
        parser.error(f"bad arguments (unknown policies: {bad})" if bad else "counts must be positive")
    args.policy_list = policies
    return args


def checkpoint(workdir: str) -> Path:
    from moetide.engine.testmodel import TinyModelArgs, make_test_model

    path = Path(workdir) / "qwen3_moe-2l-h64-kv1x16"
    if not (path / "config.json").exists():
        make_test_model(TinyModelArgs(**MODEL), path)
    return path


def run_worker(args: argparse.Namespace) -> dict:
    import torch

    from moetide.engine.loader import load_model
    from moetide.engine.runner import Engine
    from moetide.specs import get_gpu, host_for
    from moetide.engine.storage import KVLayout
    from moetide.perf.budget import cdiv

    torch.set_num_threads(args.threads)
    model = checkpoint(args.workdir)
    kv = KVLayout.of(load_model(model), args.block_size)
    bytes_per_token, block_bytes = kv.bytes_per_token, kv.block_bytes
    tokens_per_seq = args.prompt_tokens + args.decode_tokens + 1
    total_tokens = args.num_seqs * tokens_per_seq
    blocks = args.num_seqs * cdiv(tokens_per_seq, args.block_size)
    host_mib = args.host_kv_mib
    if host_mib is None:
        host_mib = max(1.0, 1.05 * (blocks * block_bytes - args.device_kv_mib * MiB) / MiB)
    start = time.perf_counter()
    engine = Engine(model, kv_cache_memory=int(args.device_kv_mib * 2**20), kv_host_memory=int(host_mib * 2**20),
                    split_policy=args.worker,
                    block_size=args.block_size, max_num_seqs=args.num_seqs,
                    max_num_batched_tokens=args.max_num_batched_tokens, ignore_eos=True,
                    **({"cpu": args.cpu} if args.cpu else {}))
    build_s = time.perf_counter() - start
    rng = random.Random(args.seed)
    vocab = engine.parts.model.config.vocab_size
    prompts = [[rng.randrange(1, vocab) for _ in range(args.prompt_tokens)] for _ in range(args.num_seqs)]
    first = engine.generate(prompts, 1)
    prefill = first.stats
    turn2 = [p + o.token_ids for p, o in zip(prompts, first.outputs)]
    result = engine.generate(turn2, 1 + args.decode_tokens)
    stats, split = result.stats, result.stats.split
    device_blocks = engine.storage.arena.num_kv_blocks
    line = dict(
        bench=BENCHMARK, policy=args.worker, num_seqs=args.num_seqs, prompt_tokens=args.prompt_tokens,
        decode_steps=args.decode_tokens, threads=args.threads, block_size=args.block_size,
        cpu=host_for(engine.config.cpu, get_gpu(engine.config.split_gpu)),
        kv_bytes_per_token=bytes_per_token, kv_tokens_planned=total_tokens,
        kv_tokens_held=split.get("peak_kv_tokens", 0),
        device_kv_bytes=device_blocks * block_bytes, host_kv_bytes=engine.host_kv.nbytes,
        device_kv_used_bytes=split.get("peak_device_blocks", 0) * block_bytes,
        host_kv_used_bytes=split.get("peak_host_blocks", 0) * block_bytes,
        peak_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        prefill_tokens=prefill.prefill_tokens, prefill_s=prefill.prefill_s,
        prefill_tokens_per_s=prefill.prefill_tokens / prefill.prefill_s if prefill.prefill_s else None,
        prefill_split=prefill.split, decode_prefix_hit_tokens=stats.prefix_hit_tokens,
        decode_tokens=stats.decode_tokens, decode_s=stats.decode_s,
        decode_tokens_per_s=stats.decode_tokens / stats.decode_s if stats.decode_s else None,
        decode_step_s=stats.decode_s / args.decode_tokens if args.decode_tokens else None,
        build_s=build_s, wall_s=prefill.wall_s + stats.wall_s, steps=prefill.steps + stats.steps,
        preemptions=prefill.preemptions + stats.preemptions, prefix_evictions=stats.prefix_evictions,
        failed_requests=prefill.failed_requests + stats.failed_requests, split=split,
        all_complete=all(len(o.token_ids) == 1 + args.decode_tokens for o in result.outputs),
    )
    return line


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        print(json.dumps(run_worker(args)), flush=True)
        return 0
    checkpoint(args.workdir)  # once, before the workers
    forward = list(argv if argv is not None else sys.argv[1:])
    status = 0
    for policy in args.policy_list:
        proc = subprocess.run([sys.executable, __file__, *forward, "--worker", policy], capture_output=True,
                              text=True)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        if proc.returncode or not lines:
            print(json.dumps(dict(bench=BENCHMARK, policy=policy, error=proc.stderr.strip().splitlines()[-3:])),
                  flush=True)
            status = 1
            continue
        print(lines[-1], flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
