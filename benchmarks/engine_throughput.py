"""Decode throughput of the moetide engine against transformers' ``generate`` and vLLM's CPU build, side by side.

Checkpoint: a random Qwen3-MoE made by ``moetide make-test-model`` (4 layers, hidden 256, 4 heads of 64 — vLLM's
CPU attention rejects the default head size 16 — 2 KV heads, 16 experts of width 32, top-2, fp32), written once
into ``--workdir``. Every peer runs in its own
subprocess (so each one's peak RSS is its own), one batch size at a time, in the order moetide, transformers,
vLLM; vLLM runs under its own interpreter (``--vllm-python``, default ``/work/.venv-vllm/bin/python``) with
``HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0``; if it cannot be imported the
script says so plainly and compares the other two.

Method, identical for every peer: a timed pair is two ``generate`` calls on ``batch`` fresh random prompts of
``--prompt-tokens`` tokens each — one generating 1 token, one generating ``1 + --decode-tokens`` — and the decode
rate is ``batch × decode_tokens / (t_long − t_short)``: prefill and first-token costs cancel, what remains is
``decode_tokens`` decode steps. Fresh prompts for every call, so no peer's prefix cache helps it. Greedy, eos
ignored (transformers: ``min_new_tokens``; vLLM: ``ignore_eos``). ``--warmup`` untimed pairs, then
``--repeats`` timed pairs; the median is reported with min and max. Each peer also generates greedily for one
fixed prompt set, and the coordinator reports whether its tokens equal moetide's.

torch threads: moetide and transformers get ``--threads`` (default 1: on a 2-core machine OpenMP spinning makes
tiny ops slower); vLLM's OpenMP threads are bound to as many cores (``VLLM_CPU_OMP_THREADS_BIND=0`` for one,
``0-(N-1)`` for N; an exported value wins).

Output: one JSON line per (peer, batch) — ``decode_tokens_per_s`` {median, min, max}, ``peak_rss_mib``,
``tokens_match_moetide``, and for moetide ``native_kernels`` (true, or why its native CPU kernels did not run;
``MOETIDE_NATIVE=0`` in the environment measures its torch paths) — then one line per batch and peer ratio,
``moetide/transformers`` and ``moetide/vllm`` (above 1: moetide is faster). Nothing asserts a speed.

Run: ``.venv/bin/python benchmarks/engine_throughput.py`` from the repository root (a few minutes).
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
PEERS = ("moetide", "transformers", "vllm")
CHECK_SEED = 12345


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--workdir", default="/tmp/moetide-bench-engine", help="where the checkpoint is written (reused)")
    add("--batch-sizes", type=int, nargs="+", default=[1, 8])
    add("--prompt-tokens", type=int, default=32)
    add("--decode-tokens", type=int, default=32)
    add("--repeats", type=int, default=5)
    add("--warmup", type=int, default=1)
    add("--threads", type=int, default=1)
    add("--seed", type=int, default=0)
    add("--vllm-python", default="/work/.venv-vllm/bin/python")
    add("--no-vllm", action="store_true")
    add("--worker", choices=PEERS, help=argparse.SUPPRESS)
    add("--model", help=argparse.SUPPRESS)
    add("--batch", type=int, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


# ---- workers (one peer, one batch size, in a subprocess) ---------------------------------------------------


def prompt_sets(args: argparse.Namespace, vocab: int):
    """Fresh prompt sets, identical across peers: the seed fixes the sequence."""
    rng = random.Random(args.seed * 1000 + args.batch)
    while True:
        yield [[rng.randrange(1, vocab) for _ in range(args.prompt_tokens)] for _ in range(args.batch)]


def check_prompts(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    rng = random.Random(CHECK_SEED)
    return [[rng.randrange(1, vocab) for _ in range(args.prompt_tokens)] for _ in range(args.batch)]


def moetide_generate(args: argparse.Namespace):
    import torch

    from moetide.engine.runner import Engine

    torch.set_num_threads(args.threads)
    engine = Engine(args.model, kv_budget_mib=64, ignore_eos=True)
    return (lambda prompts, n: [o.token_ids for o in engine.generate(prompts, n).outputs]), \
        engine.parts.model.config.vocab_size


def transformers_generate(args: argparse.Namespace):
    import torch
    import transformers

    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()

    def generate(prompts, n):
        ids = torch.tensor(prompts)
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                 do_sample=False, pad_token_id=0)
        return out[:, ids.shape[1]:].tolist()

    return generate, model.config.vocab_size


def vllm_generate(args: argparse.Namespace):
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=args.model, dtype="float32", max_model_len=args.prompt_tokens + args.decode_tokens + 8,
              seed=0)

    def generate(prompts, n):
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    return generate, json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]


def run_worker(args: argparse.Namespace) -> None:
    generate, vocab = {"moetide": moetide_generate, "transformers": transformers_generate,
                       "vllm": vllm_generate}[args.worker](args)
    prompts = prompt_sets(args, vocab)
    rates = []
    for i in range(args.warmup + args.repeats):
        start = time.perf_counter()
        generate(next(prompts), 1)
        short = time.perf_counter() - start
        start = time.perf_counter()
        generate(next(prompts), 1 + args.decode_tokens)
        long = time.perf_counter() - start
        if i >= args.warmup:
            rates.append(args.batch * args.decode_tokens / max(long - short, 1e-9))
    tokens = generate(check_prompts(args, vocab), args.decode_tokens)
    peak_rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    result = dict(rates=rates, tokens=tokens, peak_rss_mib=peak_rss_mib)
    if args.worker == "moetide":  # whether its native CPU kernels ran (MOETIDE_NATIVE=0 measures the torch paths)
        from moetide.engine import native

        result["native_kernels"] = native.available() or native.unavailable_reason()
    print("RESULT " + json.dumps(result), flush=True)


# ---- coordinator -------------------------------------------------------------------------------------------


def make_checkpoint(workdir: Path) -> Path:
    model = workdir / "qwen3_moe-l4-h256-d64-e16-k2"
    if not (model / "config.json").is_file():
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
        from moetide.engine.testmodel import TinyModelArgs, make_test_model

        make_test_model(TinyModelArgs(arch="qwen3_moe", num_layers=4, hidden_size=256, num_experts=16,
                                      num_experts_per_tok=2, head_dim=64), model)
    return model


def spawn(args: argparse.Namespace, peer: str, model: Path, batch: int) -> dict | str:
    python = args.vllm_python if peer == "vllm" else sys.executable
    cmd = [python, __file__, "--worker", peer, "--model", str(model), "--batch", str(batch)]
    for name in ("prompt_tokens", "decode_tokens", "repeats", "warmup", "threads", "seed"):
        cmd += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0",
               TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1] / "src")
    # vLLM's CPU build binds its own OpenMP threads (all cores by default): give it the same cores as the others
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0" if args.threads == 1 else f"0-{args.threads - 1}")
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
    return f"exit {done.returncode}: {tail}"


def vllm_status(args: argparse.Namespace) -> str | None:
    """None if vLLM imports under its interpreter, else why not."""
    if args.no_vllm:
        return "--no-vllm"
    if not Path(args.vllm_python).is_file():
        return f"{args.vllm_python} does not exist"
    probe = subprocess.run([args.vllm_python, "-c", "import vllm"], capture_output=True, text=True,
                           env=dict(os.environ, HF_HUB_OFFLINE="1"))
    return None if probe.returncode == 0 else (probe.stderr.strip().splitlines() or ["import failed"])[-1]


def summarize(peer: str, batch: int, result: dict, reference: list | None) -> dict:
    rates = result["rates"]
    return dict(benchmark=BENCHMARK, peer=peer, batch=batch,
                decode_tokens_per_s=dict(median=statistics.median(rates), min=min(rates), max=max(rates)),
                peak_rss_mib=round(result["peak_rss_mib"], 1),
                tokens_match_moetide=None if reference is None else result["tokens"] == reference,
                **{k: result[k] for k in ("native_kernels",) if k in result})


def main() -> int:
    args = parse_args()
    if args.worker:
        run_worker(args)
        return 0
    model = make_checkpoint(Path(args.workdir))
    absent = vllm_status(args)
    peers = [p for p in PEERS if p != "vllm" or absent is None]
    print(json.dumps(dict(benchmark=BENCHMARK, model=str(model), prompt_tokens=args.prompt_tokens,
                          decode_tokens=args.decode_tokens, repeats=args.repeats, threads=args.threads,
                          python=sys.version.split()[0])), flush=True)
    if absent is not None:
        print(json.dumps(dict(peer="vllm", status="absent", reason=absent)), flush=True)
    for batch in args.batch_sizes:
        medians, reference = {}, None
        for peer in peers:
            result = spawn(args, peer, model, batch)
            if isinstance(result, str):
                print(json.dumps(dict(benchmark=BENCHMARK, peer=peer, batch=batch, status="failed",
                                      reason=result)), flush=True)
                continue
            line = summarize(peer, batch, result, reference)
            reference = result["tokens"] if peer == "moetide" else reference
            medians[peer] = line["decode_tokens_per_s"]["median"]
            print(json.dumps(line), flush=True)
        for peer in ("transformers", "vllm"):
            if "moetide" in medians and peer in medians:
                print(json.dumps(dict(benchmark=BENCHMARK, ratio=f"moetide/{peer}", batch=batch,
                                      value=medians["moetide"] / medians[peer])), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
