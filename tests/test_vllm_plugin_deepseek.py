"""The plugin's ``vamp`` in a running vLLM 0.32 on the CPU with a DeepSeek-V2 checkpoint: the line sized from the
checkpoint's own config (``specs.hf_config``: routed experts of the MoE layers after ``first_k_dense_replace``,
shared experts apart), moved under pressure, offloaded experts staged when routed, and greedy tokens equal to stock
vLLM's in the same mode (vLLM's default, compiled, and eager), up to stock vLLM's own near-ties
(``tests/greedy.py``).

vLLM's CPU MLA kernels take only DeepSeek's latent of 512 plus a rope key of 64 (``get_supported_head_sizes``:
[576]), so the checkpoint has those; bf16, which the AMX kernel vLLM picks on an AMX CPU needs. Experts of 1.5 MiB,
so the offload cap is worth KV blocks. Each engine runs in a fresh process (``tests/vllm_generate.py``)."""

from __future__ import annotations

import json
import random

import pytest
from greedy import check_greedy, run_vllm, stock_scorer

pytest.importorskip("vllm", reason="vLLM 0.32 is not installed here (scripts/install_vllm.sh installs it)")

MODES = {"default": False, "eager": True}  # enforce_eager
_RNG = random.Random(0)  # random token ids: the tiny model's continuations of repeated words are one token
TOKEN_BATCHES = [[[_RNG.randrange(1, 512) for _ in range(n)] for n in lengths]
                 for lengths in ([100 + 40 * i for i in range(8)], [80 + 30 * i for i in range(6)])]
PLUGIN = {"policy": "vamp", "max_offload_ratio": 0.5}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    pytest.importorskip("transformers")
    from moetide.engine.testmodel import TinyModelArgs, make_test_model

    return make_test_model(TinyModelArgs(arch="deepseek_v2", head_dim=32, kv_lora_rank=512, qk_rope_head_dim=64,
                                         moe_intermediate_size=4096, dtype="bfloat16"),
                           tmp_path_factory.mktemp("vllm_deepseek") / "deepseek_v2")


def generate(model, *, plugin: dict | None, mode: str) -> dict:
    spec = {"model": str(model), "max_model_len": 1024, "kv_cache_memory": 4 << 20, "max_tokens": 24,
            "token_batches": TOKEN_BATCHES, "plugin": plugin, "enforce_eager": MODES[mode]}
    return run_vllm(spec, plugin=plugin is not None)


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(MODES))
def test_vamp_moves_the_line_on_deepseek_v2_with_stock_tokens(checkpoint, mode):
    from moetide.specs.hf_config import model_from_hf_dict

    spec = model_from_hf_dict(json.loads((checkpoint / "config.json").read_text()), name="ds", origin="config")
    assert (len(spec.moe_layer_ids), spec.num_experts, spec.num_shared_experts) == (2, 4, 1)  # layer 0 is dense
    stock = generate(checkpoint, plugin=None, mode=mode)
    result = generate(checkpoint, plugin=PLUGIN, mode=mode)
    flat = lambda batches: [seq for batch in batches for seq in batch]  # noqa: E731
    assert result["prompts"] == stock["prompts"]
    report = check_greedy(flat(result["outputs"]), flat(stock["outputs"]), flat(result["prompts"]),
                          stock_scorer(checkpoint, enforce_eager=MODES[mode]))
    print("greedy against stock vLLM:", report)
    (stats,) = result["stats"]
    grows = [h for h in stats["history"] if h[0]]
    assert grows and all(lent > 0 for *_, lent in grows), stats["history"]  # granted blocks are expert pages
    pager = stats["pager"]
    assert pager["offloaded_experts"] > 0 and pager["stagings"] > 0 and pager["unstaged"] == 0, pager
    line = result["line"]  # the scheduler's books: the two MoE layers' four experts each, routed
    assert len(line["hotness"]) == 2 and all(len(row) == 4 for row in line["hotness"]) and line["routed_steps"] > 0
