"""moetide inside vLLM 0.32: a general plugin, a scheduler whose memory decisions are moetide's policy's, and a
KV connector that carries the line's moves to the workers (docs/vllm_plugin.md).

Nothing here imports vLLM at package import: ``settings`` and ``costs`` are plain Python; the modules that touch
vLLM's classes (``plugin``'s patches, ``pool``, ``scheduler``, ``connector``, ``harness``) import it themselves.
"""
