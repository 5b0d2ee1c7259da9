"""``moetide make-test-model``: write a tiny random checkpoint (safetensors + config.json + tokenizer) for an engine
architecture, made by transformers itself (``from_config`` + ``save_pretrained``), offline and deterministic: the
same arguments give the same bytes of weights. See ``moetide.engine.testmodel`` for what is built and why norm
weights carry seeded noise. torch and transformers are imported only when the verb runs.

For vLLM's CPU backend, Qwen3-Next needs ``--linear-head-dim 128 --dtype bfloat16`` (its Gated DeltaNet kernel
accepts nothing else).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from moetide.engine.testmodel import ARCHS, DTYPE_NAMES, TinyModelArgs, make_test_model
from moetide.engine.testmodel_fp8 import QUANTIZATIONS, check_quantizable, quantize_experts
from moetide.errors import UserError

DEFAULTS = TinyModelArgs(arch=ARCHS[0])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--arch", required=True, choices=ARCHS, help="model architecture (HF model_type)")
    add("--out", required=True, metavar="DIR", help="directory to write (created; must be empty unless --overwrite)")
    add("--overwrite", action="store_true", help="write into a non-empty DIR, replacing files of the same name")
    add("--layers", type=int, metavar="N", help="decoder layers (default 2; 4 for qwen3_next: 3 linear + 1 full; 3 "
                                                "for deepseek_v2: 1 dense + 2 MoE)")
    add("--hidden", type=int, default=DEFAULTS.hidden_size, metavar="H", help="hidden size (default %(default)s)")
    add("--experts", type=int, default=DEFAULTS.num_experts, metavar="E", help="routed experts (default %(default)s)")
    add("--top-k", type=int, default=DEFAULTS.num_experts_per_tok, metavar="K",
        help="experts per token (default %(default)s)")
    add("--expert-intermediate", type=int, default=DEFAULTS.moe_intermediate_size, metavar="I",
        help="width of one expert, and of qwen3_next's shared expert (default %(default)s)")
    add("--vocab", type=int, default=DEFAULTS.vocab_size, metavar="V", help="vocabulary size (default %(default)s)")
    add("--heads", type=int, default=DEFAULTS.num_attention_heads, help="attention heads (default %(default)s)")
    add("--kv-heads", type=int, default=DEFAULTS.num_kv_heads, help="KV heads (default %(default)s)")
    add("--head-dim", type=int, default=DEFAULTS.head_dim, help="attention head size (default %(default)s)")
    add("--linear-key-heads", type=int, default=DEFAULTS.linear_num_key_heads,
        help="qwen3_next: Gated DeltaNet key heads (default %(default)s)")
    add("--linear-value-heads", type=int, default=DEFAULTS.linear_num_value_heads,
        help="qwen3_next: Gated DeltaNet value heads (default %(default)s)")
    add("--linear-head-dim", type=int, default=DEFAULTS.linear_head_dim,
        help="qwen3_next: Gated DeltaNet key and value head size (default %(default)s; vLLM-CPU needs 128)")
    add("--kv-lora-rank", type=int, metavar="R",
        help="deepseek_v2: MLA's compressed latent (default 2 x head dim; vLLM's CPU MLA needs 512)")
    add("--rope-head-dim", type=int, metavar="R",
        help="deepseek_v2: MLA's rope key (default head dim / 2; vLLM's CPU MLA needs 64)")
    add("--seed", type=int, default=DEFAULTS.seed, help="torch seed for the weights (default %(default)s)")
    add("--dtype", choices=DTYPE_NAMES, default=DEFAULTS.dtype, help="weight dtype (default %(default)s)")
    add("--max-position", type=int, default=DEFAULTS.max_position_embeddings, metavar="N",
        help="the config's max_position_embeddings: the longest sequence vLLM lets it serve (default %(default)s)")
    add("--quantization", choices=QUANTIZATIONS,
        help="write the routed experts in block FP8 (128 x 128 scales) as vLLM reads this format (qwen3_moe; "
             "moetide's engine does not read it)")


def _tiny_args(args: argparse.Namespace) -> TinyModelArgs:
    return TinyModelArgs(arch=args.arch, num_layers=args.layers, hidden_size=args.hidden, num_experts=args.experts,
                         num_experts_per_tok=args.top_k, vocab_size=args.vocab, num_attention_heads=args.heads,
                         num_kv_heads=args.kv_heads, head_dim=args.head_dim,
                         moe_intermediate_size=args.expert_intermediate,
                         linear_num_key_heads=args.linear_key_heads, linear_num_value_heads=args.linear_value_heads,
                         linear_head_dim=args.linear_head_dim, kv_lora_rank=args.kv_lora_rank,
                         qk_rope_head_dim=args.rope_head_dim, seed=args.seed, dtype=args.dtype,
                         max_position_embeddings=args.max_position)


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out}: exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not args.overwrite:
        raise UserError(f"--out {out}: directory is not empty (pass --overwrite to write into it)")
    tiny = _tiny_args(args)
    if args.quantization is not None:  # its sizes checked before anything is written
        check_quantizable(args.quantization, tiny.arch, tiny.hidden_size, tiny.moe_intermediate_size)
    make_test_model(tiny, out)
    experts = ""
    if args.quantization is not None:
        count = quantize_experts(out, args.quantization, tiny.arch)
        experts = f", {count} expert weights in block FP8 ({args.quantization})"
    print(f"wrote a {tiny.arch} test model to {out}: {tiny.layers} layers, hidden {tiny.hidden_size}, "
          f"{tiny.num_experts} experts (top-{tiny.num_experts_per_tok}), vocab {tiny.vocab_size}, {tiny.dtype}, "
          f"seed {tiny.seed}{experts}")
    return 0
