"""Decode and prefill throughput of the moetide engine against vLLM's CPU build (and optionally transformers'
``generate``), side by side on real-sized MoE checkpoints.

Checkpoints (``--models``, written once into ``--workdir`` by the same code as ``moetide make-test-model``): 4
layers, hidden 512, 8 heads of 64 (2 KV heads), top-2, random weights —

* ``qwen3_moe-fp32`` / ``qwen3_moe-bf16``: 16 experts of width 256;
* ``mixtral-fp32`` / ``mixtral-bf16``: 8 experts of width 512;
* ``qwen3_next-bf16``: 3 Gated DeltaNet layers (2 key / 4 value heads of 128: vLLM's CPU kernel takes nothing
  else, and only bf16) + 1 full attention, 16 experts of width 256 and a shared expert of 256.
* ``deepseek_v2-fp32`` / ``deepseek_v2-bf16``: MLA (8 heads of 64 + 64 rope, values of 64, over DeepSeek-V2's
  latent of 512 plus a rope key of 64: vLLM's CPU MLA takes nothing else), a first dense layer, then 16 routed
  experts of width 256 (top-2 of the best of 2 groups) and a shared expert of 256.

Why it is built this way (each rule fixes a way an earlier version misled): every peer is one **long-lived**
process, pinned with its threads to one core (``--cpu``), started once per checkpoint, so start-up, lazy
compilation and first-call allocation never fall in a timed round; rounds are **interleaved** (moetide, vLLM,
... then the reverse order the next round) so load from other users of the machine hits every peer alike;
**warm-up** runs at least ``--warmup`` rounds per batch size and continues (to ``--max-warmup``) until every
peer's last two warm-up rates agree within ``--settle``, and each result says whether its first timed round was
still an outlier; every rate is printed with its **spread** (min, median, max over ``--repeats`` rounds); and a
ratio is the median of the per-round **paired** ratios (two peers measured back to back), **withheld**
(``value`` null) when its paired spread [min, max] straddles 1.0 — then the run cannot say which peer is
faster. The load average (``os.getloadavg``) is printed beside every checkpoint's results. Every rate is also
measured on the process's CPU time (``*_cpu``: each peer is one pinned thread, so time the core spent on other
users' work does not count), the steadier figure on a shared machine; a round whose short call outlasted its
long one (a load spike) gives no rate and is counted in ``invalid_rounds``.

A round, identical for every peer: two generate calls on ``batch`` fresh random prompts of ``--prompt-tokens``
tokens, one generating 1 token and one generating ``1 + --decode-tokens``; decode rate = ``batch ×
decode_tokens / (t_long − t_short)`` (prefill and first-token costs cancel), prefill rate = ``batch ×
prompt_tokens / t_short``. Fresh prompts every call (no prefix-cache hits), the same prompts for every peer.
Greedy, eos ignored. After the rounds each peer generates greedily for a fixed prompt set and the result says
whether its tokens equal moetide's (bf16 peers may differ by rounding).

Output: one JSON line per (checkpoint, peer, batch) with ``decode_tokens_per_s``, ``prefill_tokens_per_s`` and
their ``_per_cpu_s`` twins {min, median, max}, ``warmup_rounds``, ``first_round_outlier``,
``tokens_match_moetide``; then one line per (checkpoint, batch, metric (decode, prefill, decode_cpu,
prefill_cpu), peer) ratio ``moetide/<peer>`` (above 1: moetide is faster). Nothing asserts a speed.

Run from the repository root: ``.venv/bin/python benchmarks/engine_throughput.py`` (all seven checkpoints, batch
1, 8 and 32: about 20 minutes on an idle core). vLLM runs under ``--vllm-python`` (default
``/work/venv-vllm/bin/python``) in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) with ``dtype`` the checkpoint's
(its ``"auto"`` would run a float32 checkpoint in bfloat16); if it cannot be imported the script says so and
measures the rest.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

BENCHMARK = "engine_throughput"
CHECK_SEED = 12345
MLA = dict(kv_lora_rank=512, qk_rope_head_dim=64)  # DeepSeek-V2's: vLLM's CPU MLA kernels take no other
MODELS = {  # name -> make-test-model arguments (moetide.engine.testmodel.TinyModelArgs fields)
    "qwen3_moe-fp32": dict(arch="qwen3_moe", num_experts=16, moe_intermediate_size=256, dtype="float32"),
    "qwen3_moe-bf16": dict(arch="qwen3_moe", num_experts=16, moe_intermediate_size=256, dtype="bfloat16"),
    "mixtral-fp32": dict(arch="mixtral", num_experts=8, moe_intermediate_size=512, dtype="float32"),
    "mixtral-bf16": dict(arch="mixtral", num_experts=8, moe_intermediate_size=512, dtype="bfloat16"),
    "qwen3_next-bf16": dict(arch="qwen3_next", num_experts=16, moe_intermediate_size=256, dtype="bfloat16",
                            linear_num_key_heads=2, linear_num_value_heads=4, linear_head_dim=128),
    "deepseek_v2-fp32": dict(arch="deepseek_v2", num_experts=16, moe_intermediate_size=256, dtype="float32", **MLA),
    "deepseek_v2-bf16": dict(arch="deepseek_v2", num_experts=16, moe_intermediate_size=256, dtype="bfloat16", **MLA),
}
COMMON = dict(num_layers=4, hidden_size=512, num_attention_heads=8, num_kv_heads=2, head_dim=64,
              num_experts_per_tok=2, vocab_size=1024)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--workdir", default="/tmp/moetide-bench-engine", help="where the checkpoints are written (reused)")
    add("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    add("--peers", nargs="+", default=["moetide", "vllm"], choices=["moetide", "vllm", "transformers"])
    add("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    add("--prompt-tokens", type=int, default=32)
    add("--decode-tokens", type=int, default=32)
    add("--repeats", type=int, default=5, help="timed rounds per batch size")
    add("--warmup", type=int, default=2, help="least warm-up rounds per batch size")
    add("--max-warmup", type=int, default=6, help="most warm-up rounds per batch size")
    add("--settle", type=float, default=0.15, help="warm-up ends when the last two rates differ by less")
    add("--cpu", type=int, default=None, help="the core every peer is pinned to (default: the last one)")
    add("--seed", type=int, default=0)
    add("--vllm-python", default="/work/venv-vllm/bin/python")
    add("--worker", help=argparse.SUPPRESS)
    add("--model", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


# ---- workers: one peer, one checkpoint, long-lived; one JSON command per stdin line --------------------------


def moetide_peer(model: str):
    from moetide.engine.runner import Engine

    engine = Engine(model, kv_cache_memory=256 * 2**20, ignore_eos=True)
    return lambda prompts, n: [o.token_ids for o in engine.generate(prompts, n).outputs]


def transformers_peer(model: str):
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    net = transformers.AutoModelForCausalLM.from_pretrained(model, dtype="auto").eval()

    def generate(prompts, n):
        ids = torch.tensor(prompts)
        with torch.no_grad():
            out = net.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                               do_sample=False, pad_token_id=0)
        return out[:, ids.shape[1]:].tolist()

    return generate


def vllm_peer(model: str, max_len: int):
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    config = json.loads((Path(model) / "config.json").read_text())
    dtype = config.get("dtype", config.get("torch_dtype"))
    extra = {}
    if config.get("kv_lora_rank") and dtype == "float32":
        extra["attention_backend"] = "CPU_MLA"  # vLLM picks AMX_MLA on an AMX CPU, which takes no fp32
    # the checkpoint's dtype, as moetide runs it: vLLM's "auto" downcasts a float32 checkpoint to bfloat16
    llm = LLM(model=model, dtype=dtype, max_model_len=max_len, seed=0, **extra)

    def generate(prompts, n):
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    return generate


def random_prompts(seed: int, batch: int, num_tokens: int, vocab: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(num_tokens)] for _ in range(batch)]


def run_worker(args: argparse.Namespace) -> None:
    """Answer commands until stdin closes: ``round`` (one timed pair), ``check`` (greedy tokens), ``rss``."""
    import torch

    torch.set_num_threads(1)
    max_len = args.prompt_tokens + args.decode_tokens + 8
    generate = {"moetide": lambda: moetide_peer(args.model), "transformers": lambda: transformers_peer(args.model),
                "vllm": lambda: vllm_peer(args.model, max_len)}[args.worker]()
    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    print("READY", flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "round":
            b, seed = cmd["batch"], cmd["seed"]
            t0 = (time.perf_counter(), time.process_time())
            generate(random_prompts(2 * seed, b, args.prompt_tokens, vocab), 1)
            t1 = (time.perf_counter(), time.process_time())
            generate(random_prompts(2 * seed + 1, b, args.prompt_tokens, vocab), 1 + args.decode_tokens)
            t2 = (time.perf_counter(), time.process_time())
            reply = {}
            for c, suffix in enumerate(("", "_cpu")):
                short, decode_s = t1[c] - t0[c], (t2[c] - t1[c]) - (t1[c] - t0[c])
                # a load spike in the short call can make decode_s <= 0: that round has no rate
                reply["decode" + suffix] = b * args.decode_tokens / decode_s if decode_s > 0 else None
                reply["prefill" + suffix] = b * args.prompt_tokens / short if short > 0 else None
        elif cmd["op"] == "check":
            reply = dict(tokens=generate(random_prompts(CHECK_SEED, cmd["batch"], args.prompt_tokens, vocab),
                                         args.decode_tokens))
        else:
            reply = dict(peak_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
            if args.worker == "moetide":
                from moetide.engine import native

                reply["native_kernels"] = native.available() or native.unavailable_reason()
        print("REPLY " + json.dumps(reply), flush=True)


class Peer:
    """A worker process and its command channel."""

    def __init__(self, name: str, args: argparse.Namespace, model: Path, cpu: int) -> None:
        self.name = name
        python = args.vllm_python if name == "vllm" else sys.executable
        cmd = ["taskset", "-c", str(cpu), python, __file__, "--worker", name, "--model", str(model),
               "--prompt-tokens", str(args.prompt_tokens), "--decode-tokens", str(args.decode_tokens)]
        env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0",
                   TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1", VLLM_CPU_OMP_THREADS_BIND=str(cpu),
                   PYTHONPATH=str(Path(__file__).resolve().parents[1] / "src"))
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env=env)
        self.error = self._wait_for("READY")

    def _wait_for(self, prefix: str) -> str | None:
        for line in self.proc.stdout:
            if line.startswith(prefix):
                self.last = line[len(prefix):].strip()
                return None
        tail = (self.proc.stderr.read().strip().splitlines() or ["no output"])[-1]
        return f"exit {self.proc.wait()}: {tail}"

    def ask(self, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        error = self._wait_for("REPLY ")
        if error is not None:
            raise RuntimeError(f"{self.name}: {error}")
        return json.loads(self.last)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)


# ---- coordinator -------------------------------------------------------------------------------------------


def make_checkpoint(workdir: Path, name: str) -> Path:
    model = workdir / name
    if not (model / "config.json").is_file():
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
        from moetide.engine.testmodel import TinyModelArgs, make_test_model

        make_test_model(TinyModelArgs(**COMMON, **MODELS[name]), model)
    return model


def spread(xs: list[float | None]) -> dict:
    valid = [x for x in xs if x is not None]
    if not valid:
        return dict(min=None, median=None, max=None, invalid_rounds=len(xs))
    return dict(min=round(min(valid), 2), median=round(statistics.median(valid), 2), max=round(max(valid), 2),
                invalid_rounds=len(xs) - len(valid))


def interleaved(peers: list[Peer], batch: int, seed: int, flip: bool) -> dict[str, dict]:
    """One round of every peer on the same prompts; every other round in the reverse order."""
    order = peers[::-1] if flip else peers
    return {p.name: p.ask(op="round", batch=batch, seed=seed) for p in order}


def measure_batch(peers: list[Peer], args: argparse.Namespace, batch: int) -> tuple[dict, int]:
    """{peer: [round results]} over the timed rounds, after warm-up; and the warm-up rounds run."""
    history: dict[str, list[float]] = {p.name: [] for p in peers}
    seed, warmup = args.seed * 100_000 + batch * 1000, 0
    while warmup < args.max_warmup:
        for name, r in interleaved(peers, batch, seed + warmup, warmup % 2 == 1).items():
            history[name].append(r["decode"] or 0.0)
        warmup += 1
        settled = all(len(h) >= 2 and abs(h[-1] - h[-2]) <= args.settle * max(h[-1], h[-2])
                      for h in history.values())
        if warmup >= args.warmup and settled:
            break
    rounds = [interleaved(peers, batch, seed + 500 + i, i % 2 == 1) for i in range(args.repeats)]
    return {p.name: [r[p.name] for r in rounds] for p in peers}, warmup


def first_round_outlier(xs: list[float | None]) -> bool:
    """Whether the first timed round lies outside the others' range by more than a fifth (or gave no rate)."""
    rest = [x for x in xs[1:] if x is not None]
    return bool(rest) and (xs[0] is None or not 0.8 * min(rest) <= xs[0] <= 1.25 * max(rest))


def ratio_line(model: str, batch: int, metric: str, peer: str, ours: list, theirs: list) -> dict:
    """The median of the rounds' paired ratios, withheld when their [min, max] straddles 1.0."""
    paired = sorted(a / b for a, b in zip(ours, theirs) if a is not None and b is not None)
    line = dict(benchmark=BENCHMARK, model=model, batch=batch, metric=metric, ratio=f"moetide/{peer}",
                rounds=len(paired))
    if not paired:
        return dict(line, value=None, withheld="no round gave both peers a rate")
    line.update(paired_min=round(paired[0], 3), paired_max=round(paired[-1], 3))
    if paired[0] < 1.0 < paired[-1]:
        return dict(line, value=None, withheld="the paired ratios straddle 1.0: this run cannot rank the peers")
    return dict(line, value=round(statistics.median(paired), 3))


def bench_model(args: argparse.Namespace, name: str, cpu: int) -> None:
    model = make_checkpoint(Path(args.workdir), name)
    peers = []
    for peer_name in args.peers:
        peer = Peer(peer_name, args, model, cpu)
        if peer.error is not None:
            print(json.dumps(dict(benchmark=BENCHMARK, model=name, peer=peer_name, status="failed",
                                  reason=peer.error)), flush=True)
        else:
            peers.append(peer)
    print(json.dumps(dict(benchmark=BENCHMARK, model=name, path=str(model), peers=[p.name for p in peers], cpu=cpu,
                          loadavg_start=os.getloadavg())), flush=True)
    try:
        for batch in args.batch_sizes:
            results, warmup = measure_batch(peers, args, batch)
            checks = {p.name: p.ask(op="check", batch=batch)["tokens"] for p in peers}
            for p in peers:
                decode = [r["decode"] for r in results[p.name]]
                rates = {f"{m}_tokens_per_{c}": spread([r[m + suffix] for r in results[p.name]])
                         for m in ("decode", "prefill") for c, suffix in (("s", ""), ("cpu_s", "_cpu"))}
                print(json.dumps(dict(
                    benchmark=BENCHMARK, model=name, peer=p.name, batch=batch, **rates, warmup_rounds=warmup,
                    first_round_outlier=first_round_outlier(decode),
                    tokens_match_moetide=checks[p.name] == checks["moetide"] if "moetide" in checks else None,
                    loadavg=os.getloadavg())), flush=True)
            if "moetide" not in results:
                continue
            for p in peers:
                for metric in ("decode", "prefill", "decode_cpu", "prefill_cpu") if p.name != "moetide" else ():
                    ours = [r[metric] for r in results["moetide"]]
                    print(json.dumps(ratio_line(name, batch, metric, p.name, ours,
                                                [r[metric] for r in results[p.name]])), flush=True)
        for p in peers:
            print(json.dumps(dict(benchmark=BENCHMARK, model=name, peer=p.name, **p.ask(op="rss"))), flush=True)
    finally:
        for p in peers:
            p.close()


def main() -> int:
    args = parse_args()
    if args.worker:
        run_worker(args)
        return 0
    cpu = args.cpu if args.cpu is not None else max(os.sched_getaffinity(0))
    print(json.dumps(dict(benchmark=BENCHMARK, prompt_tokens=args.prompt_tokens, decode_tokens=args.decode_tokens,
                          repeats=args.repeats, warmup=[args.warmup, args.max_warmup], settle=args.settle,
                          python=sys.version.split()[0], loadavg=os.getloadavg())), flush=True)
    for name in args.models:
        bench_model(args, name, cpu)
    return 0


if __name__ == "__main__":
    sys.exit(main())
