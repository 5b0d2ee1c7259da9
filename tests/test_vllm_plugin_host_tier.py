"""WriteScope's host KV tier in a running vLLM 0.32 on the CPU (``vllm.host_tier``, ``vllm.split_attn``).

The device KV cache is 2 MiB (2,048 tokens of the qwen3_moe and mixtral test checkpoints: 2 layers x 2 KV heads x
64 dims in bf16 is 1 KiB a token); the host tier is 64 MiB. A 16K-token prompt, eight times the device pool, is
served, where stock vLLM with the same device KV refuses to start; its greedy tokens equal stock vLLM's with the
whole KV on the device (64 MiB), up to stock vLLM's own near-ties (``tests/greedy.py``). The modes: vLLM's default
(compiled forward) and eager, in-process and with vLLM's multiprocessing, and tensor parallelism 2. The split
policies (all streamed, all on the CPU in place, a fixed share, the planner's) give identical tokens, each with the
split it claims. Each engine runs in a fresh process (``tests/vllm_generate.py``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from greedy import check_greedy, run_vllm, stock_scorer

pytest.importorskip("vllm", reason="vLLM 0.32 is not installed here (scripts/install_vllm.sh installs it)")

DEVICE_KV = 2 << 20
HOST_KV = 64 << 20
WHOLE_KV = 64 << 20  # stock vLLM with every block on the device
LONG = 16_000
MAX_MODEL_LEN = 17_000


def prompt(seed: int, length: int) -> list[int]:
    return [(7 * seed + 13 * j + (j * j) % 11) % 500 + 3 for j in range(length)]


MIXED = [[prompt(0, 5_000), prompt(1, 300), prompt(2, 3_000), prompt(3, 40)],  # 8.3K tokens of KV at once
         [prompt(4, 2_500), prompt(0, 5_000)]]  # a prefix-cache hit on host blocks


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    pytest.importorskip("transformers")
    from moetide.engine.testmodel import TinyModelArgs, make_test_model

    root = tmp_path_factory.mktemp("vllm_host_tier")
    args = {arch: TinyModelArgs(arch=arch, head_dim=64, dtype="bfloat16", max_position_embeddings=20_000)
            for arch in ("qwen3_moe", "mixtral")}
    return {arch: make_test_model(a, root / arch) for arch, a in args.items()}


def generate(model: Path, batches: list, *, host_tier: dict | None, eager: bool = False,
             multiprocessing: bool = False, max_tokens: int = 12) -> dict:
    spec = {"model": str(model), "max_model_len": MAX_MODEL_LEN, "max_tokens": max_tokens,
            "token_batches": batches, "enforce_eager": eager,
            "kv_cache_memory": WHOLE_KV if host_tier is None else DEVICE_KV, "plugin": host_tier}
    return run_vllm(spec, plugin=host_tier is not None, multiprocessing=multiprocessing)


def tier(policy: str = "writescope", **extra) -> dict:
    return {"kv_host_memory": HOST_KV, "split_policy": policy, **extra}


def check_equal(model: Path, result: dict, stock: dict, eager: bool) -> None:
    def flat(batches: list) -> list:
        return [seq for batch in batches for seq in batch]

    report = check_greedy(flat(result["outputs"]), flat(stock["outputs"]), flat(result["prompts"]),
                          stock_scorer(model, enforce_eager=eager))
    print("greedy against stock vLLM with the whole KV on the device:", report)


@pytest.fixture(scope="module")
def stock(checkpoints):
    runs: dict[tuple, dict] = {}

    def outputs(arch: str, batches_name: str, eager: bool) -> dict:
        key = (arch, batches_name, eager)
        if key not in runs:
            runs[key] = generate(checkpoints[arch], BATCHES[batches_name], host_tier=None, eager=eager)
        return runs[key]

    return outputs


BATCHES = {"long": [[prompt(5, LONG), prompt(6, 200)]], "mixed": MIXED}


@pytest.mark.slow
def test_stock_vllm_refuses_the_long_context_with_the_same_device_kv(checkpoints):
    spec = {"model": str(checkpoints["qwen3_moe"]), "max_model_len": MAX_MODEL_LEN, "max_tokens": 1,
            "token_batches": [[prompt(0, 10)]], "kv_cache_memory": DEVICE_KV, "plugin": None}
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", MOETIDE_VLLM_DISABLE="1")
    done = subprocess.run([sys.executable, str(Path(__file__).with_name("vllm_generate.py")), json.dumps(spec)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode != 0
    assert f"max seq len ({MAX_MODEL_LEN})" in done.stderr and "larger than the available KV cache memory" in \
        done.stderr, done.stderr[-2000:]


@pytest.mark.slow
def test_a_16k_prompt_eight_times_the_device_pool_is_served_as_stock_serves_it_whole(checkpoints, stock):
    model = checkpoints["qwen3_moe"]
    result = generate(model, BATCHES["long"], host_tier=tier())
    check_equal(model, result, stock("qwen3_moe", "long", False), eager=False)
    (stats,) = result["host_tier"]
    device_blocks = stats["peak_device_blocks"]
    assert stats["peak_host_blocks"] >= 6 * device_blocks > 0, stats  # 16K tokens in 128-token blocks, 16 on device
    assert stats["host_tokens_written"] >= LONG - 2_048, stats
    assert stats["cpu_blocks"] + stats["streamed_blocks"] > 0 and stats["peak_kv_tokens"] >= LONG, stats


@pytest.mark.slow
@pytest.mark.parametrize("arch, eager, multiprocessing", [
    ("qwen3_moe", True, False), ("qwen3_moe", False, True), ("mixtral", True, False)])
def test_mixed_batches_and_prefix_hits_on_host_blocks_equal_stock(checkpoints, stock, arch, eager, multiprocessing):
    model = checkpoints[arch]
    result = generate(model, MIXED, host_tier=tier(), eager=eager, multiprocessing=multiprocessing)
    check_equal(model, result, stock(arch, "mixed", eager), eager=eager)
    (stats,) = result["host_tier"]
    assert stats["host_blocks_written"] > 0 and stats["steps"] > 0, stats


@pytest.mark.slow
def test_tensor_parallel_ranks_each_hold_their_shard_of_the_host_blocks(checkpoints):
    """TP 2 (two worker processes, vLLM's default mode): one scheduler hands out the host block ids, each rank
    writes and attends its KV head's shard of them; greedy tokens equal stock vLLM's at TP 2 with the whole KV on
    the device."""
    model = checkpoints["qwen3_moe"]
    runs = {}
    for name, host_tier in (("stock", None), ("tier", tier())):
        spec = {"model": str(model), "max_model_len": MAX_MODEL_LEN, "max_tokens": 12, "token_batches": MIXED,
                "kv_cache_memory": WHOLE_KV if host_tier is None else DEVICE_KV, "plugin": host_tier,
                "tensor_parallel_size": 2}
        runs[name] = run_vllm(spec, plugin=host_tier is not None, multiprocessing=True,
                              env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"})  # vLLM's 'auto' wants a NUMA node a rank
    check_equal(model, runs["tier"], runs["stock"], eager=False)
    ranks = runs["tier"]["host_tier"]
    assert len(ranks) == 2 and ranks[0]["host_blocks_written"] == ranks[1]["host_blocks_written"] > 0, ranks


SWEEP = {"transfer-all": {}, "cpu-all": {}, "fixed-ratio": {"split_fixed_ratio": 0.5}, "writescope": {}}


@pytest.mark.slow
def test_every_split_gives_the_same_tokens_and_the_split_it_names(checkpoints):
    model = checkpoints["qwen3_moe"]
    runs = {policy: generate(model, MIXED, host_tier=tier(policy, **extra), eager=True)
            for policy, extra in SWEEP.items()}
    outputs = {policy: run["outputs"] for policy, run in runs.items()}
    assert all(out == outputs["writescope"] for out in outputs.values()), outputs
    stats = {policy: run["host_tier"][0] for policy, run in runs.items()}
    for policy, s in stats.items():
        print(policy, {k: s[k] for k in ("cpu_blocks", "streamed_blocks", "correction_factor")},
              f"{runs[policy]['seconds']:.2f} s")
    assert stats["transfer-all"]["cpu_blocks"] == 0 < stats["transfer-all"]["streamed_blocks"]
    assert stats["cpu-all"]["streamed_blocks"] == 0 < stats["cpu-all"]["cpu_blocks"]
    assert stats["fixed-ratio"]["cpu_blocks"] > 0 and stats["fixed-ratio"]["streamed_blocks"] > 0


@pytest.mark.slow
def test_the_documented_server_serves_past_its_device_kv_and_reports_the_host_tier(checkpoints):
    """``moetide serve --engine vllm --kv-host-memory`` (vLLM's default mode, multiprocessing): a prompt three
    times the device pool completes, and ``/metrics`` shows the host tier's series."""
    pytest.importorskip("openai")
    from vllm_server import Server

    server = Server(checkpoints["qwen3_moe"], "--kv-cache-memory", "2MiB", "--kv-host-memory", "64MiB",
                    "--max-model-len", str(MAX_MODEL_LEN), "--dtype", "bfloat16")
    try:
        answers = server.complete_all(["long " * 2_400, "a short one"])
        written = server.metric("moetide:kv_host_blocks_written_total")
        used = server.metric("moetide:kv_host_blocks_used")
        share = server.metric("moetide:kv_host_cpu_share")
    finally:
        server.close()
    assert len(answers[0][0]) > 3 * 2_048
    assert written >= (len(answers[0][0]) - 2_048) // 128 and used > 0 and 0 <= share <= 1, (written, used, share)
