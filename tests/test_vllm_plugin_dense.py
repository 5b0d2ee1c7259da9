"""``policy: vllm`` (the plugin's default, "nothing changes") on a dense model, and an offloading policy refused in
one line where the model's experts cannot be read.

The dense checkpoint is transformers' Llama, made here with random weights and the test tokenizer
(``engine.testmodel.train_tokenizer``). Under ``vllm`` the plugin reads nothing of the model's, so vLLM with
moetide's scheduler and connector must give exactly stock vLLM's greedy tokens: the same pool, the same batches.
"""

from __future__ import annotations

import types

import pytest
from greedy import run_vllm

from moetide.vllm.line import model_experts
from moetide.vllm.settings import PluginSettings

LLAMA = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1, head_dim=64, max_position_embeddings=1024, tie_word_embeddings=False)


def fake_vllm_config(hf: dict):
    """The two fields ``model_experts`` reads of vLLM's config, for a model vLLM would load with this config."""
    import torch  # noqa: F401  (dtype.itemsize)

    hf_config = types.SimpleNamespace(to_dict=lambda: dict(hf))
    return types.SimpleNamespace(model_config=types.SimpleNamespace(hf_config=hf_config, dtype=torch.bfloat16),
                                 parallel_config=types.SimpleNamespace(tensor_parallel_size=1))


def test_policy_vllm_reads_nothing_of_the_model():
    assert model_experts(PluginSettings(policy="vllm"), vllm_config=None) == (None, None)


@pytest.mark.parametrize("hf, expect", [
    ({"model_type": "llama", **LLAMA}, "'model_type'"),
    ({"model_type": "qwen3_moe"}, "num_hidden_layers"),
])
def test_an_offloading_policy_names_the_experts_setting_where_the_model_says_none(hf, expect):
    pytest.importorskip("torch")
    with pytest.raises(ValueError) as info:
        model_experts(PluginSettings(policy="vamp"), fake_vllm_config(hf))
    message = str(info.value)
    assert "\n" not in message and expect in message and "kv_connector_extra_config.experts" in message
    assert message.startswith("moetide: policy 'vamp' offloads experts")


@pytest.fixture(scope="module")
def llama_checkpoint(tmp_path_factory):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from moetide.engine.testmodel import SPECIAL_TOKEN, train_tokenizer

    out = tmp_path_factory.mktemp("dense") / "llama"
    tokenizer = train_tokenizer(LLAMA["vocab_size"])
    special = tokenizer.convert_tokens_to_ids(SPECIAL_TOKEN)
    config = transformers.LlamaConfig(**LLAMA, bos_token_id=special, eos_token_id=special, pad_token_id=special)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.mark.slow
def test_policy_vllm_serves_a_dense_model_as_stock_vllm(llama_checkpoint):
    pytest.importorskip("vllm", reason="vLLM 0.32 is not installed here (scripts/install_vllm.sh installs it)")
    spec = {"model": str(llama_checkpoint), "max_model_len": 512, "kv_cache_memory": 4 << 20, "max_tokens": 16,
            "batches": [[f"dense {i} " + "word " * (20 + 9 * i) for i in range(6)]], "plugin": {"policy": "vllm"}}
    plugin = run_vllm(spec, plugin=True)
    stock = run_vllm({**spec, "plugin": None}, plugin=False)
    assert plugin["prompts"] == stock["prompts"]
    assert plugin["outputs"] == stock["outputs"]
    assert plugin["line"] == {"routed_steps": 0, "hotness": None}  # moetide's scheduler ran, and kept no experts
