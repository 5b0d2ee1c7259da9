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
             num_key_value_heads=1, head_dim=64, max_position_embeddings=4096, tie_word_embeddings=False)


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


@pytest.mark.slow
def test_the_documented_command_serves_a_dense_model_keeps_its_key_and_drains_on_sigterm(llama_checkpoint):
    """``moetide serve --engine vllm --model DIR`` as documented: policy ``vllm`` and the default KV size (no
    flag), ``$MOETIDE_API_KEY`` enforced and never logged, a flag moetide's server shares passed to vLLM, and
    SIGTERM under load: every streaming client answered before the server exits, within the drain bound."""
    pytest.importorskip("vllm", reason="vLLM 0.32 is not installed here (scripts/install_vllm.sh installs it)")
    pytest.importorskip("openai")
    import signal
    import time
    from concurrent.futures import ThreadPoolExecutor

    from vllm_server import KEY, Server, stream_until_done

    from moetide.vllm.server import SHUTDOWN_TIMEOUT_S

    server = Server(llama_checkpoint, "--max-num-queued-reqs", "64")
    try:
        assert server.refuses_without_the_key()
        answers = server.complete_all([f"dense {i} " + "word " * (10 + 7 * i) for i in range(4)])
        assert all(len(tokens) == 12 for _, tokens in answers)
        started: list = []
        with ThreadPoolExecutor(8) as pool:
            streams = [pool.submit(stream_until_done, server.port, f"load {i} " * 30, 600, started) for i in range(8)]
            deadline = time.monotonic() + 60
            while len(started) < 8 and time.monotonic() < deadline:  # every stream under way
                time.sleep(0.2)
            signalled = time.monotonic()
            server.process.send_signal(signal.SIGTERM)
            ends = [stream.result() for stream in streams]
        code = server.process.wait(timeout=SHUTDOWN_TIMEOUT_S + 30)
        exited = time.monotonic() - signalled
    finally:
        server.close()
    log = server.output()
    print(f"SIGTERM: server exited after {exited:.1f} s;", [(e["end"], e["events"]) for e in ends])
    assert KEY not in log
    # vLLM got the drain bound and the shared flag, and drained
    assert f"'shutdown_timeout': {SHUTDOWN_TIMEOUT_S}" in log and "'max_num_queued_reqs': 64" in log
    assert f"mode=drain timeout={SHUTDOWN_TIMEOUT_S}s" in log
    assert code == 0 and exited < SHUTDOWN_TIMEOUT_S + 10
    assert all(e["end"] in ("length", "error") and e["closed_at"] - signalled < SHUTDOWN_TIMEOUT_S + 10 for e in ends)
    assert sum(e["end"] == "length" for e in ends) == 8  # 600 tokens drain well within the bound
