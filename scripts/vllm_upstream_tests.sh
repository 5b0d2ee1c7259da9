#!/usr/bin/env bash
# vLLM's own scheduler and prefix-caching tests (tests/v1/core of the installed vLLM's source distribution, run with
# -m cpu_test as vLLM's CPU CI runs them), once on stock vLLM and once with moetide's scheduler (policy vllm, its
# connector configured) in place of vLLM's Scheduler/AsyncScheduler; prints one JSON line per run and one comparing
# them. Exit 1 on a test that passes stock and not with moetide unless tests/vllm_upstream/divergences.py explains it;
# exit 3 when vLLM is not installed or its source cannot be fetched. Details: tests/vllm_upstream/check.py.
#
#   scripts/vllm_upstream_tests.sh                 # all of -m cpu_test v1/core (~15 min on 2 cores)
#   scripts/vllm_upstream_tests.sh --quick         # the subset tests/test_vllm_upstream.py runs
#   scripts/vllm_upstream_tests.sh --targets v1/core/test_scheduler.py -- -k preempt
#
# PYTHON (default .venv/bin/python) runs it; the download, vLLM's test-only dependency and the offline model configs
# are cached under ${MOETIDE_VLLM_UPSTREAM_CACHE:-~/.cache/moetide/vllm-upstream}/VERSION.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
exec "$PY" tests/vllm_upstream/check.py --python "$PY" "$@"
