#!/usr/bin/env bash
# Runs moetide's no-model scheduler checks (tests/test_vllm_plugin_scheduler.py, tests/test_vllm_pool.py) on vLLM
# releases the plugin does not serve, each in its own venv outside the repository, and prints one JSON line per
# version: pytest's counts, the failed tests, and the line the plugin refuses that version with in production.
#
#   scripts/vllm_versions_check.sh [VERSION ...]        # default: 0.33.0 0.34.0
#
# Venvs: ${MOETIDE_VLLM_VENVS:-/tmp/moetide-vllm-venvs}/vllm-VERSION, reused when they import that vLLM, else built
# (about 3 GB each). No CPU build of these releases exists: the venv holds vLLM's CUDA wheel without its
# dependencies (--no-deps), the CPU torch 2.13.0, PyPI's triton, and what importing vLLM's scheduler needs. Its
# native ops never load: nothing here runs a model. vLLM is pointed at its CPU platform (VLLM_TARGET_DEVICE=cpu,
# and an empty CUDA_VISIBLE_DEVICES, which 0.34 needs).
#
# The plugin's version gate is passed by the harness alone, in-process (moetide_testing.vllm_harness.
# scheduler_side_only), for these checks; docs/vllm_plugin/versions.md says what they cover and what they do not.
set -uo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
VENVS=${MOETIDE_VLLM_VENVS:-/tmp/moetide-vllm-venvs}
PYTHON=${MOETIDE_VLLM_PYTHON:-python3.11}
TESTS=(tests/test_vllm_plugin_scheduler.py tests/test_vllm_pool.py)
# what vLLM's scheduler imports (vLLM's own requirements, less the CUDA stack), and the tests' own
DEPS=(packaging pydantic regex numpy psutil pyzmq urllib3 aiohttp requests pillow pybase64 cachetools cbor2 msgspec
      cloudpickle uvloop py-cpuinfo prometheus_client "llguidance>=1.7.0,<1.8.0" xgrammar einops openai fastapi
      partial-json-parser oss-harmony pyyaml transformers tokenizers huggingface_hub triton pytest hypothesis)
[ $# -gt 0 ] && VERSIONS=("$@") || VERSIONS=(0.33.0 0.34.0)
export CUDA_VISIBLE_DEVICES= VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 PYTHONPATH="$REPO/src"

constraints() {  # torch pinned to the CPU build; transformers & co. in the ranges this vLLM requires
  echo "torch==2.13.0"
  case "$1" in
    0.33.*) printf '%s\n' "transformers>=5.16.1,<5.21.0" "huggingface_hub>=1.31.0" "tokenizers>=0.23.2" ;;
    0.34.*) printf '%s\n' "transformers>=5.16.1,<5.23.0" "huggingface_hub>=2.0.0" "tokenizers>=0.23.3" ;;
    *) echo "vllm_versions_check.sh: no dependency ranges recorded for vLLM $1" >&2; return 1 ;;
  esac
}

has_vllm() {  # VENV VERSION: the venv imports that vLLM and its scheduler
  [ -x "$1/bin/python" ] && "$1/bin/python" -c "
import sys, vllm, vllm.v1.core.sched.scheduler
sys.exit(vllm.__version__ != '$2')" >/dev/null 2>&1
}

build() {  # VENV VERSION LOG
  local venv=$1 version=$2 log=$3 c
  c=$(mktemp) && constraints "$version" >"$c" || return 1
  {
    "$PYTHON" -m venv "$venv" &&
      "$venv/bin/pip" install -q -c "$c" torch==2.13.0 &&
      "$venv/bin/pip" install -q --no-deps "vllm==$version" &&
      "$venv/bin/pip" install -q -c "$c" "${DEPS[@]}"
  } >>"$log" 2>&1
  local rc=$?
  rm -f "$c"
  return $rc
}

run_tests() {  # VENV VERSION LOG: pytest in-process under the harness option; writes the JSON line to stdout
  (cd "$REPO" && "$1/bin/python" - "$2" "${TESTS[@]}" 3>&1 >>"$3" 2>&1 <<'PY'
import json, os, sys
import pytest
from moetide.vllm import plugin
from moetide_testing.vllm_harness import scheduler_side_only

version, tests = sys.argv[1], sys.argv[2:]
try:
    plugin.check_supported()
    refused = None
except RuntimeError as e:
    refused = str(e)

class Counts:
    """pytest's outcome counts and the failed tests' ids."""
    stats: dict = {}

    def pytest_terminal_summary(self, terminalreporter):
        Counts.stats = {k: [r.nodeid for r in v if hasattr(r, "nodeid")] for k, v in terminalreporter.stats.items()}

with scheduler_side_only():
    rc = pytest.main(["-q", "-p", "no:cacheprovider", *tests], plugins=[Counts()])
counts = {k: len(Counts.stats.get(k, ())) for k in ("passed", "failed", "error", "skipped")}
line = {"vllm": version, "tests": tests, "exit": int(rc), **counts,
        "failed_tests": Counts.stats.get("failed", []) + Counts.stats.get("error", []), "production": refused}
os.write(3, (json.dumps(line) + "\n").encode())
PY
  )
}

status=0
mkdir -p "$VENVS"
for version in "${VERSIONS[@]}"; do
  venv=$VENVS/vllm-$version log=$VENVS/vllm-$version.log
  : >"$log"
  if ! has_vllm "$venv" "$version"; then
    echo "vllm_versions_check.sh: building $venv (log: $log)" >&2
    if ! build "$venv" "$version" "$log" || ! has_vllm "$venv" "$version"; then
      printf '{"vllm": "%s", "error": "venv build failed: see %s"}\n' "$version" "$log"
      status=1
      continue
    fi
  fi
  echo "vllm_versions_check.sh: vLLM $version: pytest ${TESTS[*]} (log: $log)" >&2
  out=$(run_tests "$venv" "$version" "$log")
  if [ -z "$out" ]; then
    printf '{"vllm": "%s", "error": "pytest did not finish: see %s"}\n' "$version" "$log"
    status=1
    continue
  fi
  echo "$out"
  echo "$out" | grep -q '"exit": 0,' || status=1
done
exit $status
