"""Tiny random checkpoints that transformers and the engine both load: the parity tests' ground truth.

``make_test_model`` builds the transformers config each engine architecture names (``MoECausalLM.tiny_hf_config``),
instantiates it with ``AutoModelForCausalLM.from_config`` under ``torch.manual_seed(seed)``, and writes it with
``save_pretrained`` (safetensors + config.json + generation_config.json), so the files are exactly what
transformers produces. Beside them goes a byte-level BPE tokenizer trained locally with ``tokenizers`` on a small
built-in corpus and wrapped in ``PreTrainedTokenizerFast``, so ``AutoTokenizer.from_pretrained(DIR)`` works
offline. Its special token ``<|endoftext|>`` (id 0) is the model's bos, eos and pad id.

One deliberate difference from a fresh ``from_config`` model: transformers initializes every norm weight to a
constant (1, or 0 for Qwen3-Next's zero-centered norms) and ``dt_bias`` to 1, which would let an engine that
ignored those tensors, or mixed up ``weight`` with ``1 + weight``, pass a parity test. Every 1-D parameter
therefore gets seeded noise (std ``NOISE_STD``) before saving. Same arguments, same bytes.

The architectures are the engine's (``engine.defaults.ENGINE_ARCHS``, one class each in ``engine.models.MODEL_CLASSES``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moetide.engine.defaults import ENGINE_ARCHS
from moetide.errors import UserError

ARCHS = ENGINE_ARCHS
DTYPE_NAMES = ("float32", "bfloat16")
SPECIAL_TOKEN = "<|endoftext|>"
NOISE_STD = 0.1
MIN_VOCAB = 300  # 256 byte tokens + the special token + some merges
MAX_TOKENIZER_VOCAB = 257 + 400  # bytes + special + at most 400 merges: trains in well under a second

CORPUS = """\
Mixture-of-experts models route every token to a few experts out of many, so most weights sit idle at any step.
When accelerator memory runs short, the key-value cache and the expert weights compete for the same bytes.
A serving engine can keep cold experts in host memory and stage them in when the router asks for them.
It can also keep part of a long context in host memory and let the processor attend to it where it lies.
The quick brown fox jumps over the lazy dog; the five boxing wizards jump quickly.
Continuous batching packs the new tokens of many requests into one step: prompts, chunks of prompts, decodes.
Prefix caching keeps the blocks of a shared prompt so the next turn of a conversation starts where it left off.
Numbers matter too: 0 1 2 3 4 5 6 7 8 9 10 16 32 64 128 256 512 1024 2048 4096 8192.
def forward(self, x): return self.down_proj(silu(self.gate_proj(x)) * self.up_proj(x))
for layer in range(num_layers): hidden = layer(hidden, cache, positions)
The scheduler compares the cost of evicting a prefix, preempting a request and offloading an expert region.
Linear attention keeps a state of fixed size per sequence; full attention keeps a cache that grows with it.
"""


def model_class(arch: str) -> Any:
    """The engine's model class for ``arch`` (torch imported here, so the CLI's help needs none)."""
    from moetide.engine.models import MODEL_CLASSES

    return MODEL_CLASSES[arch]


@dataclass(frozen=True)
class TinyModelArgs:
    """What to build. ``num_layers=None`` means 2, or 4 for Qwen3-Next (its default puts full attention on every
    4th layer), or 3 for DeepSeek-V2 (a first dense layer). ``dense_layer_ids`` become transformers' ``mlp_only_layers`` (Qwen3 architectures only)."""

    arch: str
    num_layers: int | None = None
    hidden_size: int = 64
    num_experts: int = 4
    num_experts_per_tok: int = 2
    vocab_size: int = 512
    num_attention_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    moe_intermediate_size: int = 32
    linear_num_key_heads: int = 2
    linear_num_value_heads: int = 4
    linear_head_dim: int = 16
    kv_lora_rank: int | None = None  # deepseek_v2's MLA latent; None: 2 x head_dim (vLLM's CPU MLA needs 512)
    qk_rope_head_dim: int | None = None  # deepseek_v2's rope key; None: head_dim / 2 (vLLM's CPU MLA needs 64)
    dense_layer_ids: tuple[int, ...] = ()
    seed: int = 0
    dtype: str = "float32"
    max_position_embeddings: int = 4096  # the longest sequence the config declares (vLLM caps max_model_len at it)

    @property
    def layers(self) -> int:
        return self.num_layers if self.num_layers is not None else model_class(self.arch).tiny_num_layers

    def validate(self) -> None:
        if self.arch not in ARCHS:
            raise UserError(f"--arch: unknown architecture {self.arch!r}; choose from {', '.join(ARCHS)}")
        if self.dtype not in DTYPE_NAMES:
            raise UserError(f"--dtype: {self.dtype!r} is not supported; choose from {', '.join(DTYPE_NAMES)}")
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, int) and field.name != "seed" and value <= 0:
                raise UserError(f"{field.name} must be a positive integer, got {value}")
        checks = [
            (self.layers > 0, f"num_layers must be a positive integer, got {self.layers}"),
            (self.vocab_size >= MIN_VOCAB, f"vocab_size must be at least {MIN_VOCAB} to cover the byte-level "
                                           f"tokenizer, got {self.vocab_size}"),
            (self.num_experts_per_tok <= self.num_experts,
             f"top-k ({self.num_experts_per_tok}) exceeds the number of experts ({self.num_experts})"),
            (self.num_attention_heads % self.num_kv_heads == 0,
             f"attention heads ({self.num_attention_heads}) must be a multiple of KV heads ({self.num_kv_heads})"),
            (self.linear_num_value_heads % self.linear_num_key_heads == 0,
             f"linear value heads ({self.linear_num_value_heads}) must be a multiple of linear key heads "
             f"({self.linear_num_key_heads})"),
            (all(0 <= i < self.layers for i in self.dense_layer_ids) and len(self.dense_layer_ids) < self.layers,
             f"dense layers {list(self.dense_layer_ids)} must be in [0, {self.layers}) and leave a MoE layer"),
            (not self.dense_layer_ids or model_class(self.arch).tiny_dense_layers,
             f"{self.arch} has no dense MLP layers"),
        ]
        for ok, message in checks:
            if not ok:
                raise UserError(message)


# ---- transformers configs ----------------------------------------------------------------------------------


def _common_fields(args: TinyModelArgs, special_id: int) -> dict[str, Any]:
    return dict(vocab_size=args.vocab_size, hidden_size=args.hidden_size, num_hidden_layers=args.layers,
                num_attention_heads=args.num_attention_heads, num_key_value_heads=args.num_kv_heads,
                head_dim=args.head_dim, num_experts_per_tok=args.num_experts_per_tok,
                max_position_embeddings=args.max_position_embeddings, bos_token_id=special_id,
                eos_token_id=special_id,
                pad_token_id=special_id, tie_word_embeddings=False)


def hf_config(args: TinyModelArgs, special_id: int) -> Any:
    return model_class(args.arch).tiny_hf_config(args, _common_fields(args, special_id))


# ---- tokenizer and weights ---------------------------------------------------------------------------------


def train_tokenizer(vocab_size: int) -> Any:
    """Byte-level BPE trained on ``CORPUS``; at most ``vocab_size`` tokens, special token first (id 0)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=min(vocab_size, MAX_TOKENIZER_VOCAB), special_tokens=[SPECIAL_TOKEN],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(CORPUS.splitlines(), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=SPECIAL_TOKEN, eos_token=SPECIAL_TOKEN,
                                   pad_token=SPECIAL_TOKEN)


def random_model(args: TinyModelArgs, special_id: int) -> Any:
    """transformers' own random init under ``seed``, then seeded noise on every 1-D parameter (see module doc)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(hf_config(args, special_id), dtype=torch.float32)
    generator = torch.Generator().manual_seed(args.seed + 1)
    with torch.no_grad():
        for _, param in sorted(model.named_parameters()):
            if param.ndim == 1:
                param.add_(torch.randn(param.shape, generator=generator) * NOISE_STD)
    return model.to(getattr(torch, args.dtype))


def make_test_model(args: TinyModelArgs, out: str | Path) -> Path:
    """Write the checkpoint and tokenizer into ``out`` (created if needed); returns the directory."""
    args.validate()
    out = Path(out)
    tokenizer = train_tokenizer(args.vocab_size)
    if len(tokenizer) > args.vocab_size:
        raise UserError(f"the tokenizer has {len(tokenizer)} tokens, more than the model's vocab {args.vocab_size}")
    special_id = tokenizer.convert_tokens_to_ids(SPECIAL_TOKEN)
    model = random_model(args, special_id)
    try:
        out.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
    except OSError as exc:
        raise UserError(f"{out}: cannot write the checkpoint: {exc.strerror or exc}") from None
    return out
