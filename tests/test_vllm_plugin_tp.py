"""Tensor parallelism through the plugin (vllm-cpu 0.32, two worker processes): each rank pages its own shard of
every expert (the line sizes an expert at its bytes over the ranks), every rank applies the same line op at the same
step, and greedy tokens equal stock vLLM's at the same tensor-parallel size, in vLLM's default (compiled) mode and
eager. The ranks' counters are summed as vLLM sums connector stats over workers (``vllm.metrics``)."""

from __future__ import annotations

import pytest
from greedy import check_greedy, run_vllm, stock_scorer

pytest.importorskip("vllm", reason="vLLM 0.32 is not installed here (scripts/install_vllm.sh installs it)")

PLUGIN = {"policy": "static-offload", "max_offload_ratio": 0.5, "line_cycle_steps": 5,
          "costs": {"prefill_s_per_token": 1e-4, "copy_s_per_expert": 1e-6}}
BATCHES = [[f"request {i} " + "word " * (60 + 25 * i) for i in range(8)],
           [f"again {i} " + "token " * (50 + 20 * i) for i in range(6)]]
TP_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}  # vLLM's 'auto' binding wants a NUMA node per rank


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    pytest.importorskip("transformers")
    from moetide.engine.testmodel import TinyModelArgs, make_test_model

    out = tmp_path_factory.mktemp("ckpt-tp")
    make_test_model(TinyModelArgs(arch="qwen3_moe", num_layers=2, hidden_size=128, num_experts=8,
                                  num_experts_per_tok=2, moe_intermediate_size=256, num_attention_heads=4,
                                  num_kv_heads=2, head_dim=64, dtype="bfloat16"), out)
    return out


def generate(model, *, plugin: dict | None, eager: bool) -> dict:
    spec = {"model": str(model), "max_model_len": 1024, "kv_cache_memory": 2 << 20, "max_tokens": 24,
            "batches": BATCHES, "plugin": plugin, "enforce_eager": eager, "tensor_parallel_size": 2}
    return run_vllm(spec, plugin=plugin is not None, multiprocessing=True, env=TP_ENV)


@pytest.mark.slow
@pytest.mark.parametrize("eager", [False])  # vLLM's default; eager TP 2 gave the same tokens (docs/vllm_plugin.md)
def test_tensor_parallel_ranks_move_the_line_together_with_stock_tokens(checkpoint, eager):
    from moetide.vllm.metrics import MoetideConnectorStats

    stock = generate(checkpoint, plugin=None, eager=eager)
    result = generate(checkpoint, plugin=PLUGIN, eager=eager)
    flat = [seq for batch in result["outputs"] for seq in batch]
    reference = [seq for batch in stock["outputs"] for seq in batch]
    prompts = [seq for batch in result["prompts"] for seq in batch]
    check_greedy(flat, reference, prompts, stock_scorer(checkpoint, enforce_eager=eager))
    ranks = result["stats"]
    assert len(ranks) == 2
    histories = [[grow for grow, *_ in rank["history"]] for rank in ranks]
    assert histories[0] == histories[1] and True in histories[0] and False in histories[0]  # both ways, together
    shard = 3 * 128 * 256 * 2 // 2  # one expert's bf16 bytes over two ranks
    for rank in ranks:
        pager = rank["pager"]
        assert pager["home_bytes"] == 2 * 8 * shard and pager["unstaged"] == 0 and pager["stagings"] > 0
        assert rank["reserve_bytes"] == rank["lent_bytes"] or rank["granted_blocks"] == 0
    assert ranks[0]["pager"]["stagings"] == ranks[1]["pager"]["stagings"]  # same routing, same stagings
    summed = MoetideConnectorStats({"stagings": ranks[0]["pager"]["stagings"]}).aggregate(
        MoetideConnectorStats({"stagings": ranks[1]["pager"]["stagings"]}))
    assert summed.reduce()["stagings"] == 2 * ranks[0]["pager"]["stagings"]
