"""``moetide serve --engine vllm``: vLLM's own OpenAI server with the plugin, driven by the OpenAI client, on
qwen3_moe, mixtral and qwen3_next checkpoints.

A burst of requests sharing a prefix, the last one longer than the base KV pool holds (2 MiB), sent twice against
``--policy vamp``: the line moves to admit it (``moetide:line_moves_total`` > 0 on ``/metrics``, beside vLLM's own
series), the offloaded experts (the coldest, by the workers' routing counts) are staged from their host copies
when routed (``moetide:stagings_total``) and none is routed without being staged (``moetide:unstaged_total`` 0),
every request completes, and the greedy tokens of both rounds equal ``--policy vllm``'s on a pool large enough for
the burst, up to stock vLLM's own near-ties (``tests/greedy.py``: how vLLM batches a burst depends on its pool, and
on these random-weight checkpoints that flips tokens whose log-probabilities are a few thousandths of a nat apart,
in stock vLLM too). In vLLM's default mode (the documented command: a compiled forward) on every architecture,
and with ``--enforce-eager`` on qwen3_moe; the two modes are compared each with itself, as their kernels differ.
"""

from __future__ import annotations

import pytest
from greedy import check_greedy, stock_scorer
from vllm_server import KEY, Server

pytest.importorskip("vllm", reason="vLLM 0.32 is not installed here (scripts/install_vllm.sh installs it)")
pytest.importorskip("openai")

SHARED = "shared " * 250
# the last request's length per architecture: longer than its base pool holds (qwen3_next's 640-token blocks and
# its linear-attention states need a longer one)
LONG_WORDS = {"qwen3_moe": 600, "mixtral": 600, "qwen3_next": 800}


EXPERT_BYTES = 3 * 64 * 4096 * 2  # one expert's w13 and w2 rows: hidden 64, width 4096, bf16


def plugin_flags(policy: str, kv_cache_memory: str) -> tuple[str, ...]:
    return ("--policy", policy, "--max-offload-ratio", "0.5", "--kv-cache-memory", kv_cache_memory, "--dtype",
            "bfloat16", "--max-num-seqs", "16")


def prompts(arch: str) -> list[str]:
    return [SHARED + f"tail {i} " + "x " * (20 + 15 * i) for i in range(8)] + [SHARED + "long " * LONG_WORDS[arch]]


@pytest.fixture(scope="module", params=list(LONG_WORDS))
def checkpoint(request, tmp_path_factory):
    pytest.importorskip("transformers")
    from moetide.engine.testmodel import TinyModelArgs, make_test_model

    # experts of 1.5 MiB each, so that the offload cap of a tiny model is worth KV blocks
    extra = {"linear_head_dim": 128} if request.param == "qwen3_next" else {}
    return request.param, make_test_model(
        TinyModelArgs(arch=request.param, head_dim=64, dtype="bfloat16", moe_intermediate_size=4096, **extra),
        tmp_path_factory.mktemp("vllm_serve") / request.param)


MODES = {"default": (), "eager": ("--enforce-eager",)}


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(MODES))
def test_vamp_moves_the_line_for_a_burst_and_answers_as_vllm(checkpoint, mode):
    arch, model = checkpoint
    if mode == "eager" and arch != "qwen3_moe":
        pytest.skip("--enforce-eager runs once, on qwen3_moe: the server's path through the plugin is the same for "
                    "every architecture, and the default mode runs all three")
    server = Server(model, *plugin_flags("vamp", "2MiB"), *MODES[mode])
    try:
        vamp_answers = [server.complete_all(prompts(arch)) for _ in range(2)]
        moves = server.metric("moetide:line_moves_total")
        granted = server.metric("moetide:kv_blocks_granted")
        ratio = server.metric("moetide:expert_offload_ratio")
        stagings = server.metric("moetide:stagings_total")
        staged_bytes = server.metric("moetide:staged_bytes_total")
        unstaged = server.metric("moetide:unstaged_total")
        assert server.refuses_without_the_key()
    finally:
        server.close()
    assert KEY not in server.output()
    assert moves > 0 and granted > 0 and 0 < ratio <= 0.5
    assert unstaged == 0  # no offloaded expert computed from memory the KV cache holds
    assert staged_bytes == stagings * EXPERT_BYTES  # whole experts, copied when routed
    # the residency offloads the coldest experts (the workers' routing counts): the qwen3_moe and qwen3_next bursts
    # route to them, mixtral's (deterministically) never does
    assert stagings > 0 or arch == "mixtral"
    server = Server(model, *plugin_flags("vllm", "8MiB"), *MODES[mode])
    try:
        vllm_answers = server.complete_all(prompts(arch))
        assert server.metric("moetide:line_moves_total") == 0
    finally:
        server.close()
    stock = [tokens for _, tokens in vllm_answers]
    for answers in vamp_answers:
        assert [prompt for prompt, _ in answers] == [prompt for prompt, _ in vllm_answers]
        report = check_greedy([tokens for _, tokens in answers], stock, [prompt for prompt, _ in answers],
                              stock_scorer(model, enforce_eager=mode == "eager"))
        print("greedy against stock vLLM:", report)
