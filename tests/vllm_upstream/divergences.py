"""Tests of vLLM's that pass on stock vLLM and not with moetide's scheduler, each with its cause (``check.py``)."""

EXPLAINED: dict[str, str] = {}
