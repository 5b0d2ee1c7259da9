"""Read a Hugging Face ``config.json`` into a ``ModelSpec``.

One small parser per ``model_type`` behind a registry dict (no if-chains). Each parser reads exactly the fields
its transformers implementation uses to build parameters and caches, with that implementation's defaults only
where the official checkpoints also rely on them (e.g. ``decoder_sparse_step`` = 1). Facts the model cannot do
without are required: a missing ``head_dim`` for Qwen3 is an error, not ``hidden_size // num_attention_heads``.
Features the ModelSpec formulas do not cover (attention or MLP biases) are rejected rather than miscounted.

Every problem becomes a ``UserError`` naming the file and the field. The built-in presets go through the same
parsers (``presets/models.toml`` holds the official config.json values), so presets and user files cannot drift.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from moetide.errors import UserError
from moetide.specs.model import FULL_ATTENTION, LINEAR_ATTENTION, LinearAttentionSpec, MLASpec, ModelSpec

_MISSING = object()


class ConfigReader:
    """Typed access to one config dict; every error names ``origin`` (a file) and the field."""

    def __init__(self, data: dict[str, Any], origin: str) -> None:
        self.data = data
        self.origin = origin

    def fail(self, key: str, problem: str) -> UserError:
        return UserError(f"{self.origin}: field '{key}': {problem}")

    def _get(self, key: str, default: Any) -> Any:
        if key in self.data:
            return self.data[key]
        if default is _MISSING:
            model_type = self.data.get("model_type", "?")
            raise self.fail(key, f"missing (required for model_type '{model_type}')")
        return default

    def int(self, key: str, default: Any = _MISSING) -> int:
        value = self._get(key, default)
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(key, f"expected an integer, got {value!r}")
        return value

    def opt_int(self, key: str) -> int | None:
        """Required key whose value may be null (e.g. DeepSeek's q_lora_rank)."""
        value = self._get(key, _MISSING)
        return None if value is None else self.int(key)

    def bool(self, key: str, default: Any = _MISSING) -> bool:
        value = self._get(key, default)
        if not isinstance(value, bool):
            raise self.fail(key, f"expected true or false, got {value!r}")
        return value

    def int_list(self, key: str, default: Any = _MISSING) -> list[int]:
        value = self._get(key, default)
        if value is None:
            return []
        if not isinstance(value, list) or any(isinstance(v, bool) or not isinstance(v, int) for v in value):
            raise self.fail(key, f"expected a list of integers, got {value!r}")
        return value

    def str_list(self, key: str) -> list[str]:
        value = self._get(key, _MISSING)
        if not isinstance(value, list) or any(not isinstance(v, str) for v in value):
            raise self.fail(key, f"expected a list of strings, got {value!r}")
        return value

    def reject_true(self, *keys: str) -> None:
        for key in keys:
            if self.bool(key, False):
                raise self.fail(key, "true is not supported (moetide's parameter formulas assume no biases)")

    def experts(self, *spellings: str) -> int:
        """Number of routed experts under any of its spellings; they must agree when several are present."""
        present = {k: self.int(k) for k in spellings if k in self.data}
        if not present:
            raise self.fail(" or ".join(spellings), "missing (number of routed experts)")
        if len(set(present.values())) > 1:
            raise self.fail(spellings[0], f"disagrees with another spelling: {present}")
        return next(iter(present.values()))


def _common(r: ConfigReader) -> dict[str, Any]:
    r.reject_true("attention_bias")
    return dict(
        model_type=r.data["model_type"],
        num_layers=r.int("num_hidden_layers"),
        hidden_size=r.int("hidden_size"),
        vocab_size=r.int("vocab_size"),
        tie_word_embeddings=r.bool("tie_word_embeddings", False),
        num_attention_heads=r.int("num_attention_heads"),
        num_experts_per_tok=r.int("num_experts_per_tok"),
    )


def _qwen_dense_layers(r: ConfigReader, num_layers: int) -> tuple[int, ...]:
    """transformers Qwen3 MoE rule: a layer is MoE unless listed in mlp_only_layers or off the sparse step."""
    mlp_only = set(r.int_list("mlp_only_layers", []))
    step = r.int("decoder_sparse_step", 1)
    if step <= 0:
        raise r.fail("decoder_sparse_step", f"must be >= 1, got {step}")
    return tuple(i for i in range(num_layers) if i in mlp_only or (i + 1) % step != 0)


def _qwen3_moe(r: ConfigReader) -> dict[str, Any]:
    fields = _common(r)
    fields.update(
        num_kv_heads=r.int("num_key_value_heads"),
        head_dim=r.int("head_dim"),
        layer_types=(FULL_ATTENTION,) * fields["num_layers"],
        num_experts=r.experts("num_experts", "num_local_experts"),
        moe_intermediate_size=r.int("moe_intermediate_size"),
        intermediate_size=r.int("intermediate_size", 0),
        dense_mlp_layer_ids=_qwen_dense_layers(r, fields["num_layers"]),
        qk_norm=True,
    )
    return fields


def _qwen3_next_layer_types(r: ConfigReader, num_layers: int) -> tuple[str, ...]:
    if "layer_types" in r.data:
        return tuple(r.str_list("layer_types"))
    if "full_attention_interval" not in r.data:
        raise r.fail("layer_types", "missing, and so is 'full_attention_interval' (one is required)")
    interval = r.int("full_attention_interval")
    if interval <= 0:
        raise r.fail("full_attention_interval", f"must be >= 1, got {interval}")
    return tuple(FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(num_layers))


def _qwen3_next(r: ConfigReader) -> dict[str, Any]:
    fields = _qwen3_moe(r)
    shared_width = r.int("shared_expert_intermediate_size")
    fields.update(
        layer_types=_qwen3_next_layer_types(r, fields["num_layers"]),
        num_shared_experts=1 if shared_width > 0 else 0,
        shared_expert_intermediate_size=shared_width,
        shared_expert_gate=shared_width > 0,
        attention_output_gate=True,
        linear_attention=LinearAttentionSpec(
            num_key_heads=r.int("linear_num_key_heads"),
            num_value_heads=r.int("linear_num_value_heads"),
            key_head_dim=r.int("linear_key_head_dim"),
            value_head_dim=r.int("linear_value_head_dim"),
            conv_kernel_size=r.int("linear_conv_kernel_dim"),
        ),
    )
    return fields


def _mixtral(r: ConfigReader) -> dict[str, Any]:
    fields = _common(r)
    # Mixtral's official config.json has no head_dim; transformers' MixtralAttention defines it as
    # hidden_size // num_attention_heads when absent, so that *is* the architecture's head size.
    head_dim = r.data.get("head_dim")
    fields.update(
        num_kv_heads=r.int("num_key_value_heads"),
        head_dim=r.int("head_dim") if head_dim is not None else fields["hidden_size"] // fields["num_attention_heads"],
        layer_types=(FULL_ATTENTION,) * fields["num_layers"],
        num_experts=r.experts("num_local_experts", "num_experts"),
        moe_intermediate_size=r.int("intermediate_size"),  # Mixtral's intermediate_size is the expert width
    )
    return fields


def _deepseek_v2(r: ConfigReader) -> dict[str, Any]:
    fields = _common(r)
    r.reject_true("mlp_bias")
    num_layers = fields["num_layers"]
    first_dense, freq = r.int("first_k_dense_replace", 0), r.int("moe_layer_freq", 1)
    if freq <= 0:
        raise r.fail("moe_layer_freq", f"must be >= 1, got {freq}")
    mla = MLASpec(kv_lora_rank=r.int("kv_lora_rank"), q_lora_rank=r.opt_int("q_lora_rank"),
                  qk_nope_head_dim=r.int("qk_nope_head_dim"), qk_rope_head_dim=r.int("qk_rope_head_dim"),
                  v_head_dim=r.int("v_head_dim"))
    num_shared = r.data.get("n_shared_experts")
    num_shared = 0 if num_shared is None else r.int("n_shared_experts")
    moe_width = r.int("moe_intermediate_size")
    kv_heads = r.data.get("num_key_value_heads")
    fields.update(
        num_kv_heads=fields["num_attention_heads"] if kv_heads is None else r.int("num_key_value_heads"),
        head_dim=mla.qk_head_dim,
        layer_types=(FULL_ATTENTION,) * num_layers,
        num_experts=r.int("n_routed_experts"),
        moe_intermediate_size=moe_width,
        intermediate_size=r.int("intermediate_size"),
        # modeling_deepseek.py: a layer is MoE when layer_idx >= first_k_dense_replace and layer_idx % freq == 0
        dense_mlp_layer_ids=tuple(i for i in range(num_layers) if i < first_dense or i % freq != 0),
        num_shared_experts=num_shared,
        shared_expert_intermediate_size=moe_width if num_shared else 0,
        mla=mla,
    )
    return fields


PARSERS: dict[str, Callable[[ConfigReader], dict[str, Any]]] = {
    "qwen3_moe": _qwen3_moe,
    "qwen3_next": _qwen3_next,
    "mixtral": _mixtral,
    "deepseek_v2": _deepseek_v2,
}


def model_from_hf_dict(data: Any, name: str, origin: str, source: str = "") -> ModelSpec:
    """Build a ModelSpec from a parsed config dict; ``origin`` names the file in error messages."""
    if not isinstance(data, dict):
        raise UserError(f"{origin}: expected a JSON object at the top level, got {type(data).__name__}")
    reader = ConfigReader(data, origin)
    model_type = data.get("model_type")
    if model_type is None:
        raise reader.fail("model_type", f"missing; supported: {', '.join(sorted(PARSERS))}")
    if model_type not in PARSERS:
        raise reader.fail("model_type", f"unsupported value {model_type!r}; supported: {', '.join(sorted(PARSERS))}")
    try:
        fields = PARSERS[model_type](reader)
        return ModelSpec(name=name, source=source or origin, **fields)
    except ValueError as exc:
        raise UserError(f"{origin}: {exc}") from None


def _name_for(path: Path) -> str:
    """A checkpoint directory's name for .../Qwen3-30B-A3B/config.json; otherwise the file's stem."""
    if path.name == "config.json" and path.parent.name not in ("", "."):
        return path.parent.name
    return path.stem


def model_from_hf_config_file(path: str | Path) -> ModelSpec:
    """A config.json, or a checkpoint folder holding one (what ``--model`` names in every verb)."""
    path = Path(path)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UserError(f"{path}: a folder without a config.json (give a checkpoint folder or its config.json)")
        path = path / "config.json"
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise UserError(f"{path}: cannot read model config: {exc.strerror or exc}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}: not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})") from None
    return model_from_hf_dict(data, name=_name_for(path), origin=str(path))
