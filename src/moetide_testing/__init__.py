"""Harnesses that drive moetide's vLLM plugin for tests and benchmarks, kept out of the runtime package ``moetide``:
vLLM's real scheduler step by step with no model (``vllm_harness``), and the differential driver that runs it
beside moetide's core (``vllm_differential``). They need vLLM."""
