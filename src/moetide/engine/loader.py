"""Load a Hugging Face checkpoint directory (config.json + safetensors) into an engine model, by HF tensor names.

Invariant: a model comes back only if every parameter was filled from the checkpoint, with the shape config.json
implies, and every tensor on disk was used (or is one inference ignores, e.g. Qwen3-Next's ``mtp.*`` or a tied
``lm_head.weight``). The check reads only safetensors headers, before any weight is read, and a problem becomes
one ``UserError`` naming the tensor and its file ("DIR/model.safetensors: missing tensor '...' (expected shape
[..])"), never a half-loaded model.

Expert layouts: transformers 5.19's ``save_pretrained`` writes experts one tensor per expert and projection, under
the pre-v5 names (``mlp.experts.{e}.gate_proj.weight``; Mixtral ``block_sparse_moe.experts.{e}.w1.weight``), which
is also what the released checkpoints hold. transformers v5 holds them in memory fused as ``mlp.experts.
gate_up_proj`` [E, 2I, H] and ``mlp.experts.down_proj`` [E, H, I]; a checkpoint saved in that form is accepted
too. The layout is chosen per checkpoint (fused when any ``.experts.gate_up_proj`` tensor is present), and the
engine keeps experts fused either way. Sharded checkpoints go through ``model.safetensors.index.json``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from moetide.engine.models import MODEL_CLASSES, MoECausalLM
from moetide.errors import UserError

CONFIG_NAME = "config.json"
INDEX_NAME = "model.safetensors.index.json"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class DiskTensor:
    file: Path
    shape: tuple[int, ...]


def _shape(shape: tuple[int, ...] | torch.Size) -> str:
    return "[" + ", ".join(str(n) for n in shape) + "]"


def read_config(ckpt_dir: Path) -> dict[str, Any]:
    path = ckpt_dir / CONFIG_NAME
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise UserError(f"{path}: cannot read model config: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}: not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a JSON object at the top level")
    return data


def resolve_dtype(config: dict[str, Any], dtype: torch.dtype | str | None, origin: str) -> torch.dtype:
    """The explicit ``dtype``, else config.json's ``dtype`` (v5) or ``torch_dtype`` (v4), else float32."""
    if isinstance(dtype, torch.dtype):
        return dtype
    name = dtype or config.get("dtype") or config.get("torch_dtype") or "float32"
    if name not in DTYPES:
        raise UserError(f"{origin}: dtype {name!r} is not supported; use one of {', '.join(DTYPES)}")
    return DTYPES[name]


def build_model(config: dict[str, Any], origin: str, dtype: torch.dtype,
                device: torch.device | str = "cpu") -> MoECausalLM:
    """An engine model with uninitialized weights on ``device`` (built on the meta device, so no init cost)."""
    model_type = config.get("model_type")
    quantization = config.get("quantization_config")
    if quantization is not None:
        method = quantization.get("quant_method", "?") if isinstance(quantization, dict) else quantization
        raise UserError(f"{origin}: field 'quantization_config': a {method!r} checkpoint; moetide's engine reads "
                        f"unquantized weights only (serve it with --engine vllm)")
    if model_type not in MODEL_CLASSES:
        raise UserError(f"{origin}: field 'model_type': {model_type!r} has no engine model; supported: "
                        f"{', '.join(sorted(MODEL_CLASSES))}")
    model_cls = MODEL_CLASSES[model_type]
    engine_config = model_cls.config_class.from_hf(config, origin)
    with torch.device("meta"):
        model = model_cls(engine_config).to(dtype)
    return model.to_empty(device=device).requires_grad_(False).eval()


# ---- what is on disk ---------------------------------------------------------------------------------------


def _header(file: Path) -> dict[str, tuple[int, ...]]:
    try:
        with safe_open(str(file), framework="pt") as f:
            return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    except (OSError, SafetensorError) as exc:
        raise UserError(f"{file}: not a readable safetensors file ({exc})") from None


def _sharded_tensors(ckpt_dir: Path) -> dict[str, DiskTensor]:
    index_path = ckpt_dir / INDEX_NAME
    try:
        weight_map = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UserError(f"{index_path}: not a readable safetensors index with a 'weight_map' ({exc})") from None
    headers: dict[str, dict[str, tuple[int, ...]]] = {}
    tensors = {}
    for name, file_name in weight_map.items():
        file = ckpt_dir / file_name
        if file_name not in headers:
            if not file.is_file():
                raise UserError(f"{index_path}: tensor '{name}' is mapped to {file_name}, which does not exist")
            headers[file_name] = _header(file)
        if name not in headers[file_name]:
            raise UserError(f"{index_path}: tensor '{name}' is mapped to {file_name}, which does not hold it")
        tensors[name] = DiskTensor(file, headers[file_name][name])
    return tensors


def disk_tensors(ckpt_dir: Path) -> tuple[dict[str, DiskTensor], Path]:
    """Every tensor of the checkpoint with its file and shape, and the file to blame for a missing tensor."""
    if (ckpt_dir / INDEX_NAME).is_file():
        return _sharded_tensors(ckpt_dir), ckpt_dir / INDEX_NAME
    files = sorted(ckpt_dir.glob("*.safetensors"))
    if not files:
        raise UserError(f"{ckpt_dir}: no *.safetensors files (and no {INDEX_NAME})")
    tensors: dict[str, DiskTensor] = {}
    for file in files:
        for name, shape in _header(file).items():
            if name in tensors:
                raise UserError(f"{file}: tensor '{name}' is also in {tensors[name].file.name}")
            tensors[name] = DiskTensor(file, shape)
    return tensors, files[0] if len(files) == 1 else ckpt_dir


# ---- matching and loading ----------------------------------------------------------------------------------


def _ignored(model: MoECausalLM, name: str) -> bool:
    if model.lm_head is None and name == "lm_head.weight":
        return True  # tied embeddings: the head is the embedding matrix
    return name.startswith(model.ignored_checkpoint_prefixes)


def check_tensors(model: MoECausalLM, targets: dict[str, torch.Tensor], on_disk: dict[str, DiskTensor],
                  missing_where: Path) -> None:
    """Raise one UserError for the first missing, then unexpected, then mis-shaped tensor (in model order)."""
    missing = [name for name in targets if name not in on_disk]
    if missing:
        more = f" (and {len(missing) - 1} more missing)" if len(missing) > 1 else ""
        raise UserError(f"{missing_where}: missing tensor '{missing[0]}' (expected shape "
                        f"{_shape(targets[missing[0]].shape)}){more}")
    extra = [name for name in on_disk if name not in targets and not _ignored(model, name)]
    if extra:
        more = f" (and {len(extra) - 1} more unexpected)" if len(extra) > 1 else ""
        entry = on_disk[extra[0]]
        raise UserError(f"{entry.file}: unexpected tensor '{extra[0]}' (shape {_shape(entry.shape)}): the "
                        f"model config.json describes has no such weight{more}")
    for name, target in targets.items():
        entry = on_disk[name]
        if entry.shape != tuple(target.shape):
            raise UserError(f"{entry.file}: tensor '{name}' has shape {_shape(entry.shape)}, config.json implies "
                            f"{_shape(target.shape)}")


def fill(targets: dict[str, torch.Tensor], on_disk: dict[str, DiskTensor]) -> None:
    """Copy every target from its file (one open per file), converting dtype and device as needed."""
    by_file: dict[Path, list[str]] = {}
    for name in targets:
        by_file.setdefault(on_disk[name].file, []).append(name)
    with torch.no_grad():
        for file, names in by_file.items():
            with safe_open(str(file), framework="pt") as f:
                for name in names:
                    targets[name].copy_(f.get_tensor(name))


def load_model(path: str | Path, *, dtype: torch.dtype | str | None = None,
               device: torch.device | str = "cpu") -> MoECausalLM:
    """The engine model for checkpoint directory ``path``, every weight loaded and checked."""
    ckpt_dir = Path(path)
    if not ckpt_dir.is_dir():
        raise UserError(f"{ckpt_dir}: not a checkpoint directory")
    config = read_config(ckpt_dir)
    origin = str(ckpt_dir / CONFIG_NAME)
    model = build_model(config, origin, resolve_dtype(config, dtype, origin), device)
    on_disk, missing_where = disk_tensors(ckpt_dir)
    fused = any(name.endswith(".experts.gate_up_proj") for name in on_disk)
    targets = model.checkpoint_targets(fused_experts=fused)
    check_tensors(model, targets, on_disk, missing_where)
    fill(targets, on_disk)
    return model
