"""The per-GPU memory budget against numbers computed by hand, with the arithmetic written out."""

from __future__ import annotations

import pytest

from moetide.errors import UserError
from moetide.perf import (
    block_bytes_per_gpu,
    default_activation_reserve_bytes,
    kv_budget_bytes,
    memory_budget,
    num_kv_blocks,
    weights_per_gpu,
)
from moetide.specs import all_models, get_gpu, get_model
from moetide.perf.budget import default_block_size, hybrid_block_size

GiB = 2**30


def test_weights_at_tp1_are_every_parameter_once():
    for model in all_models():
        assert weights_per_gpu(model).total_bytes == model.params_total * 2, model.name


def test_qwen3_30b_tp4_matches_vllm_load_log():
    # vLLM 0.8.5 logs "Model loading took 14.2474 GiB" per rank for Qwen3-30B-A3B at TP=4
    # (vllm-project/vllm#17327); the rest is vLLM's padding and buffers.
    per_gpu = weights_per_gpu(get_model("qwen3-30b-a3b"), tp=4).total_bytes / GiB
    assert per_gpu == pytest.approx(14.2474, rel=2e-3)


def test_qwen3_30b_on_one_h100():
    budget = memory_budget(get_model("qwen3-30b-a3b"), get_gpu("h100"))
    usable = int(0.9 * 80 * GiB)  # 77,309,411,328
    weights = 30_532_122_624 * 2  # every parameter, bf16: 61,064,245,248 (56.87 GiB)
    # 8192 tokens x 2 B x (8 x 2048 hidden copies + top-8 x (3 x 768 + 2048) fused-MoE buffers) + 1 GiB runtime
    reserve = 8192 * 2 * (8 * 2048 + 8 * (3 * 768 + 2048)) + GiB  # 1,912,602,624
    kv = usable - weights - reserve
    assert (budget.weights_bytes_per_gpu, budget.activation_reserve_bytes) == (weights, reserve)
    assert budget.kv_budget_bytes == kv == 14_332_563_456  # 13.35 GiB
    assert budget.block_bytes == 16 * 48 * 2 * 4 * 128 * 2 == 1_572_864  # 16 tokens x 98,304 B
    assert budget.num_blocks == kv // 1_572_864 == 9_112
    assert budget.max_tokens == 9_112 * 16 == 145_792
    assert (budget.state_bytes_per_seq, budget.state_blocks_per_request) == (0, 0)
    assert not budget.kv_budget_from_user


def test_qwen3_next_80b_on_two_h200_tp2():
    model = get_model("qwen3-next-80b-a3b")
    budget = memory_budget(model, get_gpu("h200"), tp=2)
    # replicated on both GPUs: per layer two norms 4,096 + router 512 x 2048 + shared-expert gate 2,048;
    # qk-norms 2 x 256 in the 12 full-attention layers; the final norm 2,048. Everything else is split in half.
    replicated = 48 * (4_096 + 512 * 2048 + 2_048) + 12 * 512 + 2_048  # 50,634,752
    weights = ((79_674_391_296 - replicated) // 2 + replicated) * 2
    assert budget.weights_bytes_per_gpu == weights == 79_725_026_048  # 74.25 GiB
    reserve = 8192 * 2 * (8 * 2048 + 10 * (3 * 512 + 2048)) + GiB  # 1,929,379,840
    kv = int(0.9 * 141 * GiB) - weights - reserve
    assert budget.kv_budget_bytes == kv == 54_603_431_577  # 50.85 GiB
    # 12 full-attention layers x (K, V) x 1 of 2 KV heads x 256 x 2 B = 12,288 B per token on each GPU
    assert budget.kv_bytes_per_token == 12_288 and budget.block_bytes == 16 * 12_288 == 196_608
    assert budget.num_blocks == kv // 196_608 == 277_727
    # linear state: 36 layers x 557,056 elements x 2 B = 40,108,032 B per sequence, split 2 ways
    assert budget.state_bytes_per_seq == 40_108_032 // 2 == 20_054_016
    assert budget.state_blocks_per_request == 102  # ceil(20,054,016 / 196,608) = 102 exactly
    assert budget.blocks_for(64, 32_769) == 64 * (2_049 + 102)


def test_state_checkpoints_charge_a_state_copy_per_block():
    budget = memory_budget(get_model("qwen3-next-80b-a3b"), get_gpu("h200"), tp=2, state_checkpoints=True)
    assert budget.charged_block_bytes == 196_608 + 20_054_016
    assert budget.num_blocks == 54_603_431_577 // 20_250_624 == 2_696  # ~100x fewer blocks than without
    assert budget.state_blocks_per_request == 1


def test_kv_heads_are_replicated_when_fewer_than_tp():
    model = get_model("qwen3-30b-a3b")  # 4 KV heads
    assert block_bytes_per_gpu(model, 16, 1) == 1_572_864
    assert block_bytes_per_gpu(model, 16, 2) == 1_572_864 // 2
    assert block_bytes_per_gpu(model, 16, 8) == 16 * 48 * 2 * 1 * 128 * 2 == 1_572_864 // 4  # one head each


def test_mla_latent_is_whole_on_every_gpu():
    model = get_model("deepseek-v2-lite")
    assert block_bytes_per_gpu(model, 16, 1) == block_bytes_per_gpu(model, 16, 2) == 16 * 27 * 576 * 2


def test_user_kv_budget():
    model, h100 = get_model("qwen3-30b-a3b"), get_gpu("h100")
    budget = memory_budget(model, h100, kv_cache_memory=10 * GiB)
    assert budget.kv_budget_bytes == 10 * GiB and budget.kv_budget_from_user
    assert budget.num_blocks == 10 * GiB // 1_572_864 == 6_826
    with pytest.raises(UserError, match=r"KV budget 30.00 GiB per GPU does not fit beside the weights"):
        kv_budget_bytes(model, h100, kv_cache_memory=30 * GiB)  # 56.87 + 1.78 + 30 > 80 GiB


def test_weights_that_do_not_fit_are_one_clear_error():
    with pytest.raises(UserError) as info:
        memory_budget(get_model("qwen3-next-80b-a3b"), get_gpu("a100-40gb"))
    message = str(info.value)
    assert "\n" not in message
    for needle in ("148.41 GiB per GPU", "36.00 GiB is usable", "0.9 x 40.00 GiB", "--tensor-parallel-size",
                   "more memory"):
        assert needle in message


def test_pool_too_small_for_one_hybrid_request():
    with pytest.raises(UserError, match="fewer than one request needs"):
        memory_budget(get_model("qwen3-next-80b-a3b"), get_gpu("h200"), tp=2, kv_cache_memory=int(0.01 * GiB))


def test_arguments_out_of_range():
    model, h100 = get_model("qwen3-30b-a3b"), get_gpu("h100")
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        kv_budget_bytes(model, h100, gpu_memory_utilization=1.2)
    with pytest.raises(ValueError, match="block_size"):
        block_bytes_per_gpu(model, 0)
    with pytest.raises(ValueError, match="tp=3"):
        weights_per_gpu(model, tp=3)


def test_helpers():
    assert num_kv_blocks(10, 3) == 3 and num_kv_blocks(10, 3, state_bytes_per_block=2) == 2
    model = get_model("qwen3-30b-a3b")
    assert default_activation_reserve_bytes(model, max_num_batched_tokens=1) == 2 * (8 * 2048 + 8 * 4352) + GiB


def test_describe_shows_the_arithmetic():
    rows = dict(memory_budget(get_model("qwen3-next-80b-a3b"), get_gpu("h200"), tp=2).describe())
    assert rows["KV blocks"] == "277,727 (= 54,603,431,577 // 196,608)"
    assert rows["state per sequence"] == "20,054,016 B = 102 blocks (ceil(20,054,016 / 196,608))"
    assert "74.25 GiB" in rows["weights per GPU"]


def test_default_block_size_is_vllms_hybrid_page_alignment():
    """vLLM raises a hybrid model's attention block size until one attention page (block_size tokens of one
    full-attention layer) holds one linear-attention layer's state, rounded up to a multiple of 16.
    Qwen3-Next at TP=2: state per layer (16 v-heads x 128 x 128 + conv 4096 x 4) x 2 B = 557,056 B; one token of
    one attention layer 2 x 1 KV head x 256 x 2 B = 1,024 B -> 544 tokens (vLLM logs 544 for this model)."""
    nxt = get_model("qwen3-next-80b-a3b")
    assert hybrid_block_size(nxt, tp=2) == 544 == default_block_size(nxt, tp=2)
    assert default_block_size(nxt, tp=4) == 272  # half the state per GPU, one KV head still replicated
    for name in ("qwen3-30b-a3b", "mixtral-8x7b", "deepseek-v2-lite"):
        assert hybrid_block_size(get_model(name)) is None and default_block_size(get_model(name)) == 16
    budget = memory_budget(nxt, get_gpu("h200"), tp=2, block_size=544)
    assert budget.state_blocks_per_request == 3  # 36 linear layers' state = 3 pages of 12 attention layers


def test_replay_config_records_the_block_size_it_used():
    from moetide.sim.setup import ReplayConfig, build_replay
    from moetide.workloads import generate_agent_sessions
    built = build_replay(generate_agent_sessions(0, num_sessions=1),
                         ReplayConfig(model="qwen3-next-80b-a3b", gpu="h200", tp=2))
    assert built.config.block_size == 544 and built.replay.scheduler.kv.block_size == 544
    built = build_replay(generate_agent_sessions(0, num_sessions=1), ReplayConfig(block_size=32))
    assert built.config.block_size == 32
