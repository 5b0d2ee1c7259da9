"""The real engine: PyTorch models of the supported MoE architectures, the safetensors loader, and test checkpoints.

``engine.models`` holds the architectures and their hooks (attention backend, linear-attention state store, expert
provider); ``engine.loader.load_model(dir)`` builds one from an HF checkpoint directory; ``engine.testmodel`` writes
tiny random checkpoints with transformers. This package's ``__init__`` imports nothing, so the CLI can list verbs
without importing torch.
"""
