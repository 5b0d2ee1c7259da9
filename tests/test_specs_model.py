"""ModelSpec: pinned facts of the preset models, the transformers cross-check, config.json reading and errors."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from moetide.errors import UserError
from moetide.specs import FULL_ATTENTION, LINEAR_ATTENTION, ModelSpec, get_model
from moetide.specs.loader import model_preset_hf_config, preset_names

MiB, GiB = 2**20, 2**30
MODEL_PRESETS = ["qwen3-next-80b-a3b", "qwen3-30b-a3b", "deepseek-v2-lite", "mixtral-8x7b"]


def write_config(tmp_path: Path, data: object, dirname: str = "ckpt") -> Path:
    path = tmp_path / dirname / "config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))
    return path


# ---- pinned facts ------------------------------------------------------------------------------------------


def test_preset_names_are_the_four_models():
    assert preset_names("model") == MODEL_PRESETS


def test_qwen3_next_parameters_exact():
    spec = get_model("qwen3-next-80b-a3b")
    assert spec.params_total == 79_674_391_296
    assert spec.params_active == 3_874_929_408


def test_qwen3_next_expert_bytes():
    spec = get_model("qwen3-next-80b-a3b")
    assert spec.expert_bytes() == 6 * MiB  # 3 x 2048 x 512 x 2 B
    assert spec.routed_expert_bytes_total() == 144 * GiB  # 48 layers x 512 experts x 6 MiB
    assert spec.non_expert_bytes() + spec.routed_expert_bytes_total() == 2 * spec.params_total


def test_qwen3_next_layer_split_and_kv():
    spec = get_model("qwen3-next-80b-a3b")
    assert spec.full_attention_layer_ids == tuple(range(3, 48, 4))
    assert len(spec.linear_attention_layer_ids) == 36
    assert spec.kv_bytes_per_token() == 24_576  # 12 layers x 2 x 2 kv heads x 256 x 2 B
    assert spec.attention_output_gate and spec.shared_expert_gate and spec.num_shared_experts == 1


def test_qwen3_next_linear_state_from_hf_shapes():
    la = get_model("qwen3-next-80b-a3b").linear_attention
    assert la is not None and la.conv_dim == 8192  # 2 x 16 x 128 + 32 x 128
    per_layer = 8192 * 4 + 32 * 128 * 128  # conv state + recurrent state
    assert get_model("qwen3-next-80b-a3b").linear_state_bytes_per_seq() == 36 * per_layer * 2
    assert get_model("qwen3-next-80b-a3b").linear_state_bytes_per_seq(4) == 36 * per_layer * 4


@pytest.mark.parametrize("name, kv_bytes", [
    ("qwen3-30b-a3b", 98_304), ("mixtral-8x7b", 131_072), ("deepseek-v2-lite", 31_104)])
def test_kv_bytes_per_token(name, kv_bytes):
    spec = get_model(name)
    assert spec.kv_bytes_per_token() == kv_bytes
    assert spec.kv_bytes_per_token(1) * 2 == kv_bytes
    assert spec.linear_state_bytes_per_seq() == 0


def test_head_dim_is_read_not_derived():
    spec = get_model("qwen3-30b-a3b")
    assert spec.head_dim == 128 != spec.hidden_size // spec.num_attention_heads


def test_deepseek_v2_lite_structure():
    spec = get_model("deepseek-v2-lite")
    assert spec.mla is not None and spec.mla.q_lora_rank is None and spec.mla.kv_cache_dim == 576
    assert spec.dense_mlp_layer_ids == (0,) and spec.num_moe_layers == 26
    assert (spec.num_shared_experts, spec.shared_expert_intermediate_size) == (2, 1408)
    assert spec.params_total == 15_706_484_224


def test_other_totals_and_active():
    assert (get_model("qwen3-30b-a3b").params_total, get_model("qwen3-30b-a3b").params_active) == (
        30_532_122_624, 3_353_032_704)
    assert (get_model("mixtral-8x7b").params_total, get_model("mixtral-8x7b").params_active) == (
        46_702_792_704, 12_879_925_248)
    assert get_model("mixtral-8x7b").expert_bytes() == 336 * MiB


def test_flops_helpers():
    spec = get_model("mixtral-8x7b")
    assert spec.matmul_flops_per_token == 2 * (spec.params_active - 32_000 * 4096)
    assert spec.attention_flops_per_token(1000) == 32 * 2 * 32 * 256 * 1000
    assert get_model("qwen3-next-80b-a3b").attention_flops_per_token(0) == 0


def test_names_are_case_insensitive():
    assert get_model("Qwen3-Next-80B-A3B") == get_model("qwen3-next-80b-a3b")


def test_unknown_model_lists_valid_names():
    with pytest.raises(UserError, match="valid names: qwen3-next-80b-a3b, qwen3-30b-a3b"):
        get_model("llama-7b")


# ---- cross-check against transformers on the meta device ----------------------------------------------------


def _transformers_counts(hf_config: dict) -> tuple[int, int, object]:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = dict(hf_config)
    config = transformers.AutoConfig.for_model(config.pop("model_type"), **config)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
    return total, experts, model


@pytest.mark.parametrize("name", MODEL_PRESETS)
def test_parameter_count_matches_transformers(name):
    spec = get_model(name)
    total, experts, _ = _transformers_counts(model_preset_hf_config(name))
    assert (spec.params_total, spec.params_routed_experts) == (total, experts)


VARIANTS = [  # small configs that exercise branches the presets do not
    dict(model_type="qwen3_moe", num_hidden_layers=4, hidden_size=64, vocab_size=100, num_attention_heads=4,
         num_key_value_heads=2, head_dim=32, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=24,
         intermediate_size=80, mlp_only_layers=[1], decoder_sparse_step=1, tie_word_embeddings=True),
    dict(model_type="qwen3_moe", num_hidden_layers=4, hidden_size=64, vocab_size=100, num_attention_heads=4,
         num_key_value_heads=4, head_dim=16, num_local_experts=4, num_experts_per_tok=1, moe_intermediate_size=24,
         intermediate_size=48, decoder_sparse_step=2),
    dict(model_type="qwen3_next", num_hidden_layers=6, hidden_size=64, vocab_size=100, num_attention_heads=4,
         num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
         shared_expert_intermediate_size=32, intermediate_size=40, mlp_only_layers=[0],
         layer_types=["linear_attention", "full_attention"] * 3, linear_num_key_heads=2,
         linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12, linear_conv_kernel_dim=3),
    dict(model_type="deepseek_v2", num_hidden_layers=4, hidden_size=64, vocab_size=100, num_attention_heads=4,
         num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=48, qk_nope_head_dim=16, qk_rope_head_dim=8,
         v_head_dim=12, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=20,
         first_k_dense_replace=2, moe_layer_freq=1, intermediate_size=72),
    dict(model_type="mixtral", num_hidden_layers=2, hidden_size=64, vocab_size=100, num_attention_heads=4,
         num_key_value_heads=1, head_dim=24, num_local_experts=4, num_experts_per_tok=2, intermediate_size=40),
]


@pytest.mark.parametrize("hf_config", VARIANTS, ids=lambda c: c["model_type"])
def test_variant_parameter_count_matches_transformers(tmp_path, hf_config):
    spec = ModelSpec.from_hf_config(write_config(tmp_path, hf_config))
    total, experts, _ = _transformers_counts(hf_config)
    assert (spec.params_total, spec.params_routed_experts) == (total, experts)


def test_linear_attention_shapes_match_transformers():
    _, _, model = _transformers_counts(model_preset_hf_config("qwen3-next-80b-a3b"))
    layer = model.model.layers[0].linear_attn
    la = get_model("qwen3-next-80b-a3b").linear_attention
    assert (layer.conv_dim, layer.conv_kernel_size) == (la.conv_dim, la.conv_kernel_size)
    assert (layer.num_v_heads, layer.head_k_dim, layer.head_v_dim) == (
        la.num_value_heads, la.key_head_dim, la.value_head_dim)


# ---- from_hf_config round trips -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", MODEL_PRESETS)
def test_from_hf_config_round_trip(tmp_path, name):
    path = write_config(tmp_path, model_preset_hf_config(name), dirname="My-Model")
    spec = ModelSpec.from_hf_config(path)
    assert spec.name == "My-Model" and spec.source == str(path)
    assert spec == dataclasses.replace(get_model(name), name="My-Model", source=str(path))


def test_qwen3_moe_accepts_num_local_experts_spelling(tmp_path):
    config = model_preset_hf_config("qwen3-30b-a3b")
    config["num_local_experts"] = config.pop("num_experts")  # transformers >= 5.24 writes this
    assert ModelSpec.from_hf_config(write_config(tmp_path, config)).num_experts == 128


def test_expert_spellings_must_agree(tmp_path):
    config = dict(model_preset_hf_config("qwen3-30b-a3b"), num_local_experts=64)
    with pytest.raises(UserError, match="num_experts"):
        ModelSpec.from_hf_config(write_config(tmp_path, config))


def test_qwen3_next_needs_layer_types_or_interval(tmp_path):
    config = model_preset_hf_config("qwen3-next-80b-a3b")
    del config["full_attention_interval"]
    with pytest.raises(UserError, match="layer_types"):
        ModelSpec.from_hf_config(write_config(tmp_path, config))
    config["layer_types"] = [LINEAR_ATTENTION] * 47 + [FULL_ATTENTION]
    assert ModelSpec.from_hf_config(write_config(tmp_path, config)).full_attention_layer_ids == (47,)


# ---- error paths --------------------------------------------------------------------------------------------


def test_malformed_json_names_file_and_line(tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{"model_type": "mixtral",\n  "hidden_size": }')
    with pytest.raises(UserError, match=rf"{path}: not valid JSON \(line 2"):
        ModelSpec.from_hf_config(path)


@pytest.mark.parametrize("mutate, pattern", [
    (lambda c: c.pop("head_dim"), "field 'head_dim': missing"),
    (lambda c: c.update(hidden_size="2048"), "field 'hidden_size': expected an integer"),
    (lambda c: c.update(model_type="llama"), "unsupported value 'llama'; supported: deepseek_v2, mixtral"),
    (lambda c: c.pop("model_type"), "field 'model_type': missing"),
    (lambda c: c.update(attention_bias=True), "field 'attention_bias': true is not supported"),
    (lambda c: c.update(num_experts_per_tok=200), "num_experts_per_tok \\(200\\) exceeds num_experts"),
    (lambda c: c.update(tie_word_embeddings="no"), "field 'tie_word_embeddings': expected true or false"),
])
def test_bad_config_is_a_user_error_naming_file_and_field(tmp_path, mutate, pattern):
    config = model_preset_hf_config("qwen3-30b-a3b")
    mutate(config)
    path = write_config(tmp_path, config)
    with pytest.raises(UserError, match=pattern) as info:
        ModelSpec.from_hf_config(path)
    assert str(path) in str(info.value)


def test_missing_file_and_non_object(tmp_path):
    with pytest.raises(UserError, match="cannot read model config"):
        ModelSpec.from_hf_config(tmp_path / "nope" / "config.json")
    with pytest.raises(UserError, match="expected a JSON object"):
        ModelSpec.from_hf_config(write_config(tmp_path, [1, 2]))


def test_deepseek_q_lora_rank_must_be_present(tmp_path):
    config = model_preset_hf_config("deepseek-v2-lite")
    del config["q_lora_rank"]  # transformers would silently default to 1536: not a fact
    with pytest.raises(UserError, match="field 'q_lora_rank': missing"):
        ModelSpec.from_hf_config(write_config(tmp_path, config))


# ---- dataclass validation -----------------------------------------------------------------------------------


@pytest.mark.parametrize("change, pattern", [
    (dict(head_dim=0), "head_dim must be a positive integer"),
    (dict(layer_types=(FULL_ATTENTION,) * 3), "layer_types has 3 entries, num_layers is 48"),
    (dict(layer_types=("sliding",) * 48), "unknown layer_types"),
    (dict(layer_types=(LINEAR_ATTENTION,) * 48), "linear_attention must be given"),
    (dict(num_kv_heads=5), "must be a multiple of num_kv_heads"),
    (dict(dense_mlp_layer_ids=(3, 1)), "dense_mlp_layer_ids must be sorted"),
    (dict(dense_mlp_layer_ids=(1,), intermediate_size=0), "need intermediate_size > 0"),
    (dict(num_shared_experts=1), "must both be 0 or both positive"),
    (dict(shared_expert_gate=True), "shared_expert_gate needs at least one shared expert"),
    (dict(dense_mlp_layer_ids=tuple(range(48)), intermediate_size=8), "every layer is dense"),
])
def test_model_spec_validation(change, pattern):
    with pytest.raises(ValueError, match=pattern):
        dataclasses.replace(get_model("qwen3-30b-a3b"), **change)


def test_dtype_bytes_must_be_positive():
    with pytest.raises(ValueError, match="dtype_bytes"):
        get_model("mixtral-8x7b").kv_bytes_per_token(0)
