"""DeepSeek-V2 in the engine, beyond the parity tests every architecture runs (test_engine_runner, test_engine_spill):
the latent KV's bytes against the replay's spec, the router against transformers' on the same weights, YaRN's
frequencies against transformers', and the configs it refuses."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from moetide.engine.loader import build_model, load_model  # noqa: E402
from moetide.engine.models.deepseek_v2 import DeepseekV2EngineConfig  # noqa: E402
from moetide.engine.models.norm_rope import Yarn  # noqa: E402
from moetide.engine.storage import KVLayout  # noqa: E402
from moetide.errors import UserError  # noqa: E402
from moetide.specs.hf_config import model_from_hf_dict  # noqa: E402
from moetide.specs.loader import model_preset_hf_config  # noqa: E402

# DeepSeek-V2-Lite's config.json fields the replay's preset leaves out (huggingface.co/deepseek-ai/DeepSeek-V2-Lite)
LITE_ROPE = dict(rope_theta=10000, rms_norm_eps=1e-6, hidden_act="silu", max_position_embeddings=163840,
                 topk_method="greedy", n_group=1, topk_group=1, routed_scaling_factor=1.0, scoring_func="softmax",
                 rope_scaling=dict(type="yarn", factor=40, original_max_position_embeddings=4096, beta_fast=32,
                                   beta_slow=1, mscale=0.707, mscale_all_dim=0.707))


def lite_config() -> dict:
    return {**model_preset_hf_config("deepseek-v2-lite"), **LITE_ROPE}


@pytest.mark.parametrize(("dtype", "dtype_bytes"), [(torch.bfloat16, 2), (torch.float32, 4)])
def test_latent_kv_bytes_equal_the_replay_spec(tiny_checkpoint, dtype, dtype_bytes):
    """A token's KV is one latent plus the rope key per layer, stored once: the replay's MLA spec, byte for byte,
    for DeepSeek-V2-Lite (built on the meta device) and for the tiny checkpoint."""
    tiny = json.loads((tiny_checkpoint("deepseek_v2") / "config.json").read_text())
    for config in (lite_config(), tiny):
        spec = model_from_hf_dict(config, name="x", origin="config")
        layout = KVLayout.of(build_model(config, "config", dtype, device="meta"), block_size=16)
        assert layout.values_in_keys and layout.num_kv_heads == 1
        assert layout.bytes_per_token == spec.kv_bytes_per_token(dtype_bytes)
        assert layout.block_bytes == 16 * spec.kv_bytes_per_token(dtype_bytes)
    lite = KVLayout.of(build_model(lite_config(), "lite", torch.bfloat16, device="meta"), block_size=16)
    assert lite.bytes_per_token == 27 * 576 * 2  # 31,104 bytes a token
    # 8.9x less than the 16 heads' keys (192) and values (128) that transformers' unabsorbed cache would expand
    assert 27 * 16 * (192 + 128) * 2 / lite.bytes_per_token == pytest.approx(8.89, abs=0.01)


def test_yarn_frequencies_equal_transformers():
    from transformers import DeepseekV2Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = DeepseekV2Config(**{k: v for k, v in lite_config().items() if k not in ("rope_scaling", "rope_theta")},
                              rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, **{
                                  k: v for k, v in LITE_ROPE["rope_scaling"].items() if k != "type"}))
    want, want_factor = ROPE_INIT_FUNCTIONS["yarn"](config)
    yarn = DeepseekV2EngineConfig.from_hf(lite_config(), "lite").yarn
    assert torch.equal(yarn.inv_freq(64, 10000.0), want)
    assert yarn.cos_sin_factor() == pytest.approx(want_factor, rel=1e-12)
    assert Yarn(factor=40, original_max_position_embeddings=4096).cos_sin_factor() == pytest.approx(
        0.1 * torch.log(torch.tensor(40.0)).item() + 1)


def test_router_picks_transformers_experts_within_the_kept_groups(tiny_checkpoint, hf_model):
    """Group-limited greedy routing: the same expert ids and scaled weights as transformers' router on the same
    hidden states, every token's experts inside its ``topk_group`` best groups."""
    engine, hf = load_model(tiny_checkpoint("deepseek_v2")), hf_model("deepseek_v2")
    x = torch.randn(64, engine.config.hidden_size, generator=torch.Generator().manual_seed(3))
    moe = engine.layers[1].mlp
    weights, ids = moe.route(x)
    _, want_weights, want_ids = hf.model.layers[1].mlp.gate(x)
    order, want_order = ids.sort(dim=-1), want_ids.sort(dim=-1)
    assert torch.equal(order.values, want_order.values)
    torch.testing.assert_close(weights.gather(1, order.indices), want_weights.gather(1, want_order.indices))
    per_group = engine.config.num_experts // engine.config.n_group
    assert all(len(set((row // per_group).tolist())) <= engine.config.topk_group for row in ids)
    assert weights.dtype == torch.float32 and moe.scaling == 1.5


@pytest.mark.parametrize(("change", "field"), [
    (dict(scoring_func="sigmoid"), "scoring_func"),
    (dict(topk_method="noaux_tc"), "topk_method"),
    (dict(num_key_value_heads=8), "num_key_value_heads"),
    (dict(rope_scaling=dict(type="linear", factor=2.0)), "rope_parameters"),
    (dict(rope_scaling=dict(type="yarn")), "rope_parameters"),
    (dict(rope_scaling=dict(type="yarn", factor=40, original_max_position_embeddings=4096, mscale="big")),
     "rope_parameters"),
    (dict(topk_method="group_limited_greedy", n_group=5, topk_group=1), "n_group"),
    (dict(attention_bias=True), "attention_bias"),
    (dict(routed_scaling_factor="two"), "routed_scaling_factor"),
])
def test_configs_it_cannot_run_are_one_line_errors(change, field):
    with pytest.raises(UserError, match=f"field '{field}'"):
        DeepseekV2EngineConfig.from_hf({**lite_config(), **change}, "config.json")


def test_make_test_model_writes_the_mla_sizes_it_is_given(tmp_path, capsys):
    """``--kv-lora-rank`` and ``--rope-head-dim``: vLLM's CPU MLA kernels take only DeepSeek's 512 + 64."""
    from moetide.cli import main

    out = tmp_path / "ds"
    assert main(["make-test-model", "--arch", "deepseek_v2", "--out", str(out), "--kv-lora-rank", "64",
                 "--rope-head-dim", "16", "--head-dim", "32"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert (config["kv_lora_rank"], config["qk_rope_head_dim"], config["qk_nope_head_dim"]) == (64, 16, 32)
    assert config["first_k_dense_replace"] == 1 and config["num_hidden_layers"] == 3
    assert KVLayout.of(load_model(out), block_size=16).bytes_per_token == 3 * (64 + 16) * 4
