"""``moetide make-test-model``: offline, deterministic, loadable by transformers and the engine; bad input is one
line and exit code 2; listing the verbs never imports torch."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from moetide.cli import main


def make(tmp_path, name: str, *extra: str) -> tuple[int, object]:
    out = tmp_path / name
    return main(["make-test-model", "--out", str(out), *extra]), out


def test_cli_never_imports_torch_to_list_verbs():
    code = "import sys; from moetide.cli import build_parser; build_parser(); print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def test_writes_a_checkpoint_both_libraries_load(tmp_path, torch_one_thread, capsys):
    transformers = pytest.importorskip("transformers")
    from moetide.engine.loader import load_model

    rc, out = make(tmp_path, "m", "--arch", "mixtral", "--layers", "1", "--experts", "3", "--top-k", "1",
                   "--vocab", "400", "--seed", "7")
    assert rc == 0 and "wrote a mixtral test model" in capsys.readouterr().out
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in out.iterdir()}
    config = json.loads((out / "config.json").read_text())
    assert (config["num_hidden_layers"], config["num_local_experts"], config["num_experts_per_tok"],
            config["vocab_size"], config["eos_token_id"]) == (1, 3, 1, 400, 0)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert 257 < len(tokenizer) <= 400 and tokenizer.convert_ids_to_tokens(0) == "<|endoftext|>"
    assert tokenizer.decode(tokenizer("experts route tokens")["input_ids"]) == "experts route tokens"
    assert load_model(out).config.num_experts == 3


def test_same_arguments_same_bytes(tmp_path, torch_one_thread):
    pytest.importorskip("transformers")
    args = ("--arch", "qwen3_next", "--hidden", "32", "--seed", "3")
    (_, a), (_, b), (_, c) = (make(tmp_path, "a", *args), make(tmp_path, "b", *args),
                              make(tmp_path, "c", *args[:-1], "4"))
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()


def test_qwen3_next_flags_for_vllm_cpu(tmp_path, torch_one_thread):
    pytest.importorskip("transformers")
    rc, out = make(tmp_path, "n", "--arch", "qwen3_next", "--linear-head-dim", "128", "--dtype", "bfloat16",
                   "--linear-key-heads", "1", "--linear-value-heads", "2")
    config = json.loads((out / "config.json").read_text())
    assert rc == 0 and config["dtype"] == "bfloat16"
    assert (config["linear_key_head_dim"], config["linear_value_head_dim"], config["linear_num_key_heads"],
            config["linear_num_value_heads"]) == (128, 128, 1, 2)
    assert config["layer_types"].count("full_attention") == 1


def test_max_position_and_fp8_experts_for_vllm(tmp_path, torch_one_thread):
    """``--max-position`` sets the longest sequence the config declares (vLLM caps ``max_model_len`` at it);
    ``--quantization`` writes the routed experts in block FP8 with one float32 scale per 128 x 128 block."""
    pytest.importorskip("transformers")
    from safetensors import safe_open

    rc, out = make(tmp_path, "q", "--arch", "qwen3_moe", "--max-position", "32768", "--hidden", "128",
                   "--expert-intermediate", "256", "--dtype", "bfloat16", "--quantization", "fp8")
    config = json.loads((out / "config.json").read_text())
    assert rc == 0 and config["max_position_embeddings"] == 32768
    assert config["quantization_config"]["weight_block_size"] == [128, 128]
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        name = "model.layers.0.mlp.experts.0.gate_proj.weight"
        assert str(f.get_tensor(name).dtype) == "torch.float8_e4m3fn"
        assert tuple(f.get_tensor(name + "_scale_inv").shape) == (2, 1)  # 256 x 128 in 128 x 128 blocks
        assert str(f.get_tensor("model.layers.0.self_attn.q_proj.weight").dtype) == "torch.bfloat16"


@pytest.mark.parametrize("extra, message", [
    (("--arch", "mixtral", "--experts", "2", "--top-k", "3"), "top-k (3) exceeds the number of experts (2)"),
    (("--arch", "qwen3_moe", "--quantization", "fp8"), "--quantization fp8: --hidden (64) and --expert-intermediate"),
    (("--arch", "mixtral", "--quantization", "fp8"), "--quantization fp8: written for qwen3_moe only"),
    (("--arch", "qwen3_moe", "--vocab", "100"), "vocab_size must be at least 300"),
    (("--arch", "qwen3_moe", "--heads", "3"), "attention heads (3) must be a multiple of KV heads (2)"),
    (("--arch", "mixtral", "--hidden", "0"), "hidden_size must be a positive integer, got 0"),
])
def test_bad_arguments_are_one_line_and_exit_2(tmp_path, capsys, extra, message):
    rc, _ = make(tmp_path, "bad", *extra)
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith(f"moetide make-test-model: error: {message}") and err.count("\n") == 1


def test_refuses_a_non_empty_directory(tmp_path, capsys):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("mine")
    rc, _ = make(tmp_path, "full", "--arch", "mixtral")
    assert rc == 2 and "is not empty (pass --overwrite" in capsys.readouterr().err
