"""An offline Hugging Face hub cache holding the models vLLM's scheduler tests name, config and tokenizer only.

vLLM's tests under tests/v1/core build a ``ModelConfig`` from a hub id (``facebook/opt-125m`` for most of them), and
``StructuredOutputManager`` loads its tokenizer; neither reads weights. This machine and CI reach no model hub, so
``build(HF_HOME)`` lays out a hub cache (``hub/models--ORG--NAME/{refs/main,snapshots/REV/}``) that
``huggingface_hub`` reads under ``HF_HUB_OFFLINE=1``: the test files then run unmodified, with the ids they name.

What stands in for each model (the substitution, in full):

* ``config.json``: the model's own published config, field for field (written out below; the scheduler reads
  ``max_position_embeddings``, the layer and head counts for KV sizing, and the multimodal fields).
* ``preprocessor_config.json`` / ``processor_config.json`` for the multimodal models (LLaVA-1.5, Qwen2.5-VL): the
  published ones (vLLM builds the HF processor to size the encoder budget from dummy images).
* the tokenizer: NOT the published one (not shipped by any package). A byte-level BPE trained here on a few lines,
  padded with never-produced filler tokens to the published base vocabulary size, with the published special
  tokens at their published ids (OPT: ``<s> <pad> </s> <unk>`` = 0..3, len 50265; LLaMA: ``<unk> <s> </s>`` = 0..2,
  ``<image>`` = 32000, ``<pad>`` = 32001; Qwen2: ``<|endoftext|>`` = 151643 and the Qwen2.5 specials after it).
  The tests use token ids they write themselves; a tokenizer is loaded, and the multimodal processors find their
  placeholder tokens by these ids.
* ``generation_config.json``: the published one where vLLM reads it (the tests set their own EOS id).

No weights: nothing in these tests loads a model.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

FORMAT = 3  # bump when what ``build`` writes changes (the cache dir is keyed on it)

CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]

OPT_125M = {
    "_remove_final_layer_norm": False, "activation_dropout": 0.0, "activation_function": "relu",
    "architectures": ["OPTForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 2, "do_layer_norm_before": True,
    "dropout": 0.1, "eos_token_id": 2, "ffn_dim": 3072, "hidden_size": 768, "init_std": 0.02, "layerdrop": 0.0,
    "max_position_embeddings": 2048, "model_type": "opt", "num_attention_heads": 12, "num_hidden_layers": 12,
    "pad_token_id": 1, "prefix": "</s>", "torch_dtype": "float16", "transformers_version": "4.21.0.dev0",
    "use_cache": True, "vocab_size": 50272, "word_embed_proj_dim": 768,
}
OPT_350M = dict(OPT_125M, do_layer_norm_before=False, ffn_dim=4096, hidden_size=1024, num_attention_heads=16,
                num_hidden_layers=24, word_embed_proj_dim=512)
OPT_GENERATION = {"_from_model_config": True, "bos_token_id": 2, "eos_token_id": 2, "pad_token_id": 1,
                  "transformers_version": "4.27.0.dev0"}

LLAVA_15_7B = {
    "architectures": ["LlavaForConditionalGeneration"], "ignore_index": -100, "image_token_index": 32000,
    "model_type": "llava", "pad_token_id": 32001, "projector_hidden_act": "gelu",
    "text_config": {"_name_or_path": "lmsys/vicuna-7b-v1.5", "architectures": ["LlamaForCausalLM"],
                    "max_position_embeddings": 4096, "model_type": "llama", "rms_norm_eps": 1e-05,
                    "torch_dtype": "float16", "vocab_size": 32064},
    "tie_word_embeddings": False, "torch_dtype": "float16", "transformers_version": "4.36.0.dev0",
    "vision_config": {"hidden_size": 1024, "image_size": 336, "intermediate_size": 4096,
                      "model_type": "clip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 24,
                      "patch_size": 14, "projection_dim": 768, "vocab_size": 32000},
    "vision_feature_layer": -2, "vision_feature_select_strategy": "default", "vocab_size": 32064,
}
LLAVA_PREPROCESSOR = {
    "crop_size": {"height": 336, "width": 336}, "do_center_crop": True, "do_convert_rgb": True,
    "do_normalize": True, "do_rescale": True, "do_resize": True, "image_mean": CLIP_MEAN,
    "image_processor_type": "CLIPImageProcessor", "image_std": CLIP_STD, "processor_class": "LlavaProcessor",
    "resample": 3, "rescale_factor": 0.00392156862745098, "size": {"shortest_edge": 336},
}
LLAVA_PROCESSOR = {"image_token": "<image>", "num_additional_image_tokens": 1, "patch_size": 14,
                   "processor_class": "LlavaProcessor", "vision_feature_select_strategy": "default"}
LLAVA_GENERATION = {"_from_model_config": True, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 32001,
                    "transformers_version": "4.36.0.dev0"}

QWEN3_06B = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 1024,
    "initializer_range": 0.02, "intermediate_size": 3072, "max_position_embeddings": 40960,
    "max_window_layers": 28, "model_type": "qwen3", "num_attention_heads": 16, "num_hidden_layers": 28,
    "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000,
    "sliding_window": None, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
}
QWEN3_GENERATION = {"bos_token_id": 151643, "do_sample": True, "eos_token_id": [151645, 151643],
                    "pad_token_id": 151643, "temperature": 0.6, "top_k": 20, "top_p": 0.95,
                    "transformers_version": "4.51.0"}
QWEN15_7B = {
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 11008, "max_position_embeddings": 32768, "max_window_layers": 28, "model_type": "qwen2",
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32, "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.37.0", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
}
QWEN25_VL_3B = {
    "architectures": ["Qwen2_5_VLForConditionalGeneration"], "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151645, "vision_start_token_id": 151652, "vision_end_token_id": 151653,
    "vision_token_id": 151654, "image_token_id": 151655, "video_token_id": 151656, "hidden_act": "silu",
    "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 11008, "max_position_embeddings": 128000,
    "max_window_layers": 70, "model_type": "qwen2_5_vl", "num_attention_heads": 16, "num_hidden_layers": 36,
    "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16", "transformers_version": "4.41.2", "use_cache": True,
    "use_sliding_window": False,
    "vision_config": {"depth": 32, "hidden_act": "silu", "hidden_size": 1280, "intermediate_size": 3420,
                      "num_heads": 16, "in_chans": 3, "out_hidden_size": 2048, "patch_size": 14,
                      "spatial_merge_size": 2, "spatial_patch_size": 14, "window_size": 112,
                      "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2, "temporal_patch_size": 2},
    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}, "vocab_size": 151936,
}
QWEN25_VL_PREPROCESSOR = {
    "min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2,
    "image_mean": CLIP_MEAN, "image_std": CLIP_STD, "image_processor_type": "Qwen2VLImageProcessor",
    "processor_class": "Qwen2_5_VLProcessor",
}
QWEN25_VL_GENERATION = {"bos_token_id": 151643, "pad_token_id": 151643, "do_sample": True,
                        "eos_token_id": [151645, 151643], "repetition_penalty": 1.05, "temperature": 0.1,
                        "top_p": 0.001, "top_k": 1, "transformers_version": "4.49.0"}
QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
                 "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
                 "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>",
                 "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
                 "<|repo_name|>", "<|file_sep|>"]
QWEN_CHAT_TEMPLATE = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] "
                      "+ '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
                      "{% endif %}")

# (tokenizer family) -> leading specials, base vocabulary size (specials included), specials added after the base,
# and the tokenizer's named tokens
TOKENIZERS = {
    "gpt2": (["<s>", "<pad>", "</s>", "<unk>"], 50265, [],
             dict(bos_token="</s>", eos_token="</s>", unk_token="</s>", pad_token="<pad>")),
    "llama": (["<unk>", "<s>", "</s>"], 32000, ["<image>", "<pad>"],
              dict(bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>")),
    "qwen2": ([], 151643, QWEN_SPECIALS, dict(eos_token="<|endoftext|>", pad_token="<|endoftext|>")),
}

# hub id -> (files, tokenizer family)
MODELS = {
    "facebook/opt-125m": ({"config.json": OPT_125M, "generation_config.json": OPT_GENERATION}, "gpt2"),
    "facebook/opt-350m": ({"config.json": OPT_350M, "generation_config.json": OPT_GENERATION}, "gpt2"),
    "llava-hf/llava-1.5-7b-hf": ({"config.json": LLAVA_15_7B, "preprocessor_config.json": LLAVA_PREPROCESSOR,
                                  "processor_config.json": LLAVA_PROCESSOR,
                                  "generation_config.json": LLAVA_GENERATION}, "llama"),
    "Qwen/Qwen3-0.6B": ({"config.json": QWEN3_06B, "generation_config.json": QWEN3_GENERATION}, "qwen2"),
    "Qwen/Qwen1.5-7B": ({"config.json": QWEN15_7B}, "qwen2"),
    "Qwen/Qwen2.5-VL-3B-Instruct": ({"config.json": QWEN25_VL_3B, "preprocessor_config.json": QWEN25_VL_PREPROCESSOR,
                                     "generation_config.json": QWEN25_VL_GENERATION}, "qwen2"),
}

CORPUS = """\
The scheduler admits requests while the key-value cache has free blocks for them.
Prefix caching lets a request reuse the blocks another request already computed.
When the pool runs short, the newest running request is preempted and waits again.
A chunked prefill splits a long prompt over several steps of the token budget.
The quick brown fox jumps over the lazy dog; the five boxing wizards jump quickly.
0123456789 + - * / = ( ) [ ] { } < > , . ; : ! ? ' " _ @ # $ % ^ & | ~ `
"""


def _tokenizer(family: str):
    """A byte-level BPE with ``family``'s special tokens at their published ids (module docstring)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    leading, base, added, named = TOKENIZERS[family]
    trained = Tokenizer(models.BPE())
    trained.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=leading, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    trained.train_from_iterator(CORPUS.splitlines(), trainer=trainer)
    model = json.loads(trained.to_str())["model"]
    vocab: dict[str, int] = dict(model["vocab"])
    for i in range(len(vocab), base):  # never produced: no merge yields them
        vocab[f"<|filler_{i}|>"] = i
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in leading + added])
    out = PreTrainedTokenizerFast(tokenizer_object=tok, **named)
    for i, t in enumerate(leading):
        assert out.convert_tokens_to_ids(t) == i, (family, t)
    for i, t in enumerate(added):
        assert out.convert_tokens_to_ids(t) == base + i, (family, t)
    return out


def build(hf_home: Path) -> Path:
    """Write the cache under ``hf_home/hub`` (idempotent: a complete one is kept); returns ``hf_home``."""
    hub = Path(hf_home) / "hub"
    done = hub / f".moetide_offline_hub_{FORMAT}"
    if done.exists():
        return Path(hf_home)
    tokenizers = {}
    for repo_id, (files, family) in MODELS.items():
        repo = hub / ("models--" + repo_id.replace("/", "--"))
        revision = hashlib.sha1(f"moetide-offline-{FORMAT}-{repo_id}".encode()).hexdigest()
        snapshot = repo / "snapshots" / revision
        snapshot.mkdir(parents=True, exist_ok=True)
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / "main").write_text(revision)
        for name, content in files.items():
            (snapshot / name).write_text(json.dumps(content, indent=2) + "\n")
        if family not in tokenizers:
            tokenizers[family] = _tokenizer(family)
        tokenizers[family].save_pretrained(snapshot)
        if family == "qwen2":  # the published tokenizer_config carries the chat template
            config_path = snapshot / "tokenizer_config.json"
            config = json.loads(config_path.read_text())
            config["chat_template"] = QWEN_CHAT_TEMPLATE
            config_path.write_text(json.dumps(config, indent=2) + "\n")
    done.write_text("complete\n")
    return Path(hf_home)


if __name__ == "__main__":
    print(build(Path(sys.argv[1])))
