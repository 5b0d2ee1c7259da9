"""Block-FP8 test checkpoints: a tiny checkpoint's routed experts rewritten as FP8 the way FP8 MoE checkpoints ship
(Qwen3-Next-80B-A3B-Instruct-FP8, DeepSeek-V3): ``float8_e4m3fn`` weights with one ``float32`` scale per 128 x 128
block, everything else left in the model's dtype. Two formats, as vLLM reads them:

* ``fp8``: ``quantization_config = {"quant_method": "fp8", "weight_block_size": [128, 128], ...}``, scales named
  ``<weight>_scale_inv``, and every module that is not an expert named in ``modules_to_not_convert``;
* ``compressed-tensors``: a ``float-quantized`` config group with ``strategy: block``, scales named
  ``<weight>_scale``, and the modules that are not experts ignored by pattern.

A block's scale is its largest magnitude over 448 (the format's largest value), as the usual converters compute it.
moetide's engine does not read these checkpoints (its loader refuses a ``quantization_config``); vLLM does, which
is what they are for: the expert pager's FP8 path against vLLM's own.
"""

from __future__ import annotations

import json
from pathlib import Path

from moetide.errors import UserError

BLOCK = 128
QUANTIZATIONS = ("fp8", "compressed-tensors")
EXPERT_ARCHS = {"qwen3_moe": ".mlp.experts."}  # where each architecture's routed experts' tensors are named


def quantize_block(weight):
    """``weight`` (2-D) as FP8 and its per-block scales ``[ceil(n/128), ceil(k/128)]``: weight ~= fp8 * scale."""
    import torch

    n, k = weight.shape
    nb, kb = -(-n // BLOCK), -(-k // BLOCK)
    padded = torch.zeros(nb * BLOCK, kb * BLOCK, dtype=torch.float32)
    padded[:n, :k] = weight.float()
    blocks = padded.view(nb, BLOCK, kb, BLOCK)
    fmax = torch.finfo(torch.float8_e4m3fn).max
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / fmax
    fp8 = (blocks / scale[:, None, :, None]).clamp(-fmax, fmax).to(torch.float8_e4m3fn)
    return fp8.view(nb * BLOCK, kb * BLOCK)[:n, :k].contiguous(), scale


def check_quantizable(quantization: str, arch: str, hidden: int, expert_intermediate: int) -> None:
    """``UserError`` for an architecture or size ``quantize_experts`` does not cover (checked before anything is
    written)."""
    if quantization not in QUANTIZATIONS:
        raise UserError(f"--quantization: {quantization!r} is not one of {', '.join(QUANTIZATIONS)}")
    if arch not in EXPERT_ARCHS:
        raise UserError(f"--quantization {quantization}: written for {', '.join(EXPERT_ARCHS)} only, not {arch}")
    if hidden % BLOCK or expert_intermediate % BLOCK:
        raise UserError(f"--quantization {quantization}: --hidden ({hidden}) and --expert-intermediate "
                        f"({expert_intermediate}) must be multiples of {BLOCK}, the FP8 block")


def quantize_experts(out: Path, quantization: str, arch: str) -> int:
    """Rewrite the checkpoint in ``out`` with its routed experts in block FP8 (module docstring; sizes checked by
    ``check_quantizable``); returns how many expert weights were quantized."""
    from safetensors.torch import load_file, save_file

    path = out / "model.safetensors"
    tensors, done = load_file(path), 0
    suffix = "_scale_inv" if quantization == "fp8" else "_scale"
    for name in [n for n in tensors if EXPERT_ARCHS[arch] in n and n.endswith(".weight")]:
        tensors[name], tensors[name + suffix] = quantize_block(tensors[name])
        done += 1
    save_file(tensors, path, metadata={"format": "pt"})
    config_path = out / "config.json"
    config = json.loads(config_path.read_text())
    config["quantization_config"] = quantization_config(quantization, config["num_hidden_layers"])
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    return done


def quantization_config(quantization: str, num_layers: int) -> dict:
    """The ``quantization_config`` vLLM reads for experts-only block FP8 (module docstring)."""
    if quantization == "fp8":
        keep = [f"model.layers.{i}.{name}" for i in range(num_layers)
                for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate")]
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": [BLOCK, BLOCK], "modules_to_not_convert": keep + ["lm_head"]}
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": "block",
               "block_structure": [BLOCK, BLOCK]}
    activations = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True, "strategy": "group",
                   "group_size": BLOCK}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": activations}},
            "ignore": ["lm_head", "re:.*mlp.gate$", "re:.*self_attn.*"]}
