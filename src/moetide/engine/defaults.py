"""What the engine runs and its defaults, importable without torch (the CLI's parsers and help read them).

``ENGINE_ARCHS``: the Hugging Face ``model_type`` values the engine has a model for (``engine.models.MODEL_CLASSES``
holds the classes and checks that it matches). ``ENGINE_DEFAULTS``: the engine's values for ``ServingConfig``'s
options left unset (``engine.build.EngineConfig``); ``block_size`` is not among them: as in vLLM it depends on the
model (16, or for a hybrid model the size whose page holds one layer's state: ``engine.build.engine_block_size``).
"""

from __future__ import annotations

from moetide.core.config import DEFAULT_KV_CACHE_MEMORY

ENGINE_ARCHS = ("qwen3_moe", "mixtral", "qwen3_next", "deepseek_v2")
ENGINE_DEFAULTS = dict(kv_cache_memory=DEFAULT_KV_CACHE_MEMORY, max_num_seqs=256, max_num_batched_tokens=8192)
