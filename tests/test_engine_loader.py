"""The safetensors loader: names as transformers 5.19 writes them, sharded and fused layouts, and one clear error
per damaged checkpoint, naming the tensor and the file."""

from __future__ import annotations

import json
import re

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from safetensors.torch import load_file, save_file  # noqa: E402

from moetide.engine.loader import load_model  # noqa: E402
from moetide.engine.models import ContiguousKVCache, StepBatch, StepContext  # noqa: E402
from moetide.errors import UserError  # noqa: E402

EXPERT = "model.layers.1.block_sparse_moe.experts.3.w3.weight"  # Mixtral's up projection of expert 3


def rewrite(path, change) -> None:
    """Apply ``change(tensors)`` to the safetensors file at ``path``."""
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def logits(model, tokens: list[int]):
    ctx = StepContext(StepBatch.of([(0, len(tokens), 0)]), ContiguousKVCache(), model.new_linear_state_store())
    with torch.no_grad():
        return model(torch.tensor(tokens), ctx, all_logits=True)


def same_weights(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_transformers_names_on_disk(tiny_checkpoint):
    """What transformers 5.19's save_pretrained writes: per-expert tensors under the pre-v5 names."""
    names = set(load_file(tiny_checkpoint("mixtral") / "model.safetensors"))
    assert EXPERT in names and "model.layers.0.block_sparse_moe.gate.weight" in names
    names = set(load_file(tiny_checkpoint("qwen3_next") / "model.safetensors"))
    assert {"model.layers.0.mlp.experts.2.gate_proj.weight", "model.layers.0.mlp.shared_expert_gate.weight",
            "model.layers.0.linear_attn.in_proj_qkvz.weight", "model.layers.3.self_attn.q_norm.weight"} <= names
    assert not any(name.endswith("gate_up_proj") for name in names)
    config = json.loads((tiny_checkpoint("qwen3_moe") / "config.json").read_text())
    assert "num_local_experts" in config and "num_experts" not in config  # 5.19 already writes this spelling


def test_missing_tensor_is_named_with_its_file_and_shape(copy_checkpoint):
    ckpt = copy_checkpoint("mixtral")
    rewrite(ckpt / "model.safetensors", lambda t: t.pop(EXPERT))
    with pytest.raises(UserError) as err:
        load_model(ckpt)
    assert str(err.value) == f"{ckpt}/model.safetensors: missing tensor '{EXPERT}' (expected shape [32, 64])"


def test_extra_tensor_is_named(copy_checkpoint):
    ckpt = copy_checkpoint("qwen3_moe")
    rewrite(ckpt / "model.safetensors", lambda t: t.update({"model.layers.0.mlp.experts.9.up_proj.weight":
                                                             torch.zeros(32, 64)}))
    with pytest.raises(UserError, match=re.escape(
            f"{ckpt}/model.safetensors: unexpected tensor 'model.layers.0.mlp.experts.9.up_proj.weight' "
            f"(shape [32, 64])")):
        load_model(ckpt)


def test_wrong_shape_is_named_with_both_shapes(copy_checkpoint):
    ckpt = copy_checkpoint("qwen3_next")
    name = "model.layers.3.self_attn.q_proj.weight"
    rewrite(ckpt / "model.safetensors", lambda t: t.update({name: torch.zeros(64, 64)}))
    with pytest.raises(UserError) as err:
        load_model(ckpt)
    assert str(err.value) == (f"{ckpt}/model.safetensors: tensor '{name}' has shape [64, 64], config.json "
                              f"implies [128, 64]")


def test_sharded_checkpoint_loads_like_the_single_file(tiny_checkpoint, hf_model, tmp_path):
    hf_model("qwen3_next").save_pretrained(tmp_path, max_shard_size="100KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert same_weights(load_model(tmp_path), load_model(tiny_checkpoint("qwen3_next")))
    shard = sorted(set(index["weight_map"].values()))[-1]
    (tmp_path / shard).unlink()
    with pytest.raises(UserError, match=f"model.safetensors.index.json: tensor '.*' is mapped to {shard}, which "
                                        f"does not exist"):
        load_model(tmp_path)


def test_fused_expert_layout_loads_too(tiny_checkpoint, hf_model, tmp_path):
    """transformers v5's in-memory names (fused gate_up_proj / down_proj, Mixtral's router under mlp.)."""
    tensors = {name: t.contiguous() for name, t in hf_model("mixtral").state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in tensors
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_bytes((tiny_checkpoint("mixtral") / "config.json").read_bytes())
    assert same_weights(load_model(tmp_path), load_model(tiny_checkpoint("mixtral")))


def test_config_spellings_and_ignored_tensors(copy_checkpoint):
    ckpt = copy_checkpoint("qwen3_next")
    reference = logits(load_model(ckpt), [5, 6, 7])
    config = json.loads((ckpt / "config.json").read_text())
    config["num_local_experts"] = config.pop("num_experts")
    config["rope_theta"] = config.pop("rope_parameters")["rope_theta"]  # pre-v5 layout; partial factor top level
    (ckpt / "config.json").write_text(json.dumps(config))
    rewrite(ckpt / "model.safetensors", lambda t: t.update({"mtp.fc.weight": torch.zeros(2, 2)}))
    torch.testing.assert_close(logits(load_model(ckpt), [5, 6, 7]), reference, rtol=0, atol=0)


def test_dtype_comes_from_config_unless_given(tiny_checkpoint):
    model = load_model(tiny_checkpoint("mixtral"), dtype="bfloat16")
    assert model.lm_head.weight.dtype == torch.bfloat16
    assert load_model(tiny_checkpoint("mixtral")).lm_head.weight.dtype == torch.float32


@pytest.mark.parametrize("damage, message", [
    (lambda c: c.update(model_type="llama"), "field 'model_type': 'llama' has no engine model"),
    (lambda c: c.pop("num_local_experts"), "field 'num_local_experts or num_experts': missing"),
    (lambda c: c.update(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4}), "rope_type 'yarn'"),
    (lambda c: c.update(hidden_act="gelu"), "field 'hidden_act': only 'silu'"),
])
def test_bad_config_is_one_user_error(copy_checkpoint, damage, message):
    ckpt = copy_checkpoint("mixtral")
    config = json.loads((ckpt / "config.json").read_text())
    damage(config)
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match=re.escape(message)):
        load_model(ckpt)


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(UserError, match="cannot read model config"):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "mixtral"')
    with pytest.raises(UserError, match="not valid JSON"):
        load_model(tmp_path)
