#!/usr/bin/env bash
# The device checks, as one prepared script for a session that is lent a GPU (the `device` tool runs it from the
# repository root; CI never does). Nothing is installed: the device image's python3 already holds torch,
# transformers, safetensors, tokenizers, pytest and hypothesis, and the source runs from src/ (PYTHONPATH).
#
#   run: bash benchmarks/gpu_checks.sh            (timeout_s ~480; what it writes under $OUT comes back)
#
# 1. the CUDA-marked tests: engine parity with transformers on CUDA (tight budget: eviction, preemption, expert
#    offload through pinned host copies, a copy stream and events), split attention with host KV on CUDA, the
#    arena storage on CUDA, and vamp-reclaim giving experts back on CUDA; then the vLLM plugin's KV backings and
#    the pager's staging with torch alone (the CUDA driver's virtual memory: only base and granted chunks mapped,
#    released on give-back; the expert pager's per-call path captured in a CUDA graph and replayed across line
#    moves, staging from pinned host copies with its Triton copy);
# 2. `moetide calibrate --quick`: this host's DRAM and CPU attention, and the pinned host->device bandwidth;
# 3. `moetide bench-engine --device cuda` on a tiny checkpoint (prefill/decode tokens/s at batch 1, 8, 32);
# 4. `moetide generate --device cuda --policy vamp-reclaim` under a tight budget (counters in JSON);
# 5. `moetide generate --device cuda --static-offload` with offloaded experts staged (fetch) and computed from their
#    pinned host copies (--cold-experts cpu): the same tokens, and the counters say which ran.
# Each step's output goes to $OUT/<step>.log; a failing step does not stop the others; the exit status is the
# number of failed steps.
set -u
OUT="${OUT:-/tmp/gpu_checks}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
failed=0

step() {  # step NAME COMMAND...: run, log, count a failure
    local name=$1
    shift
    echo "== $name: $*"
    if "$@" >"$OUT/$name.log" 2>&1; then echo "   ok"; else echo "   FAILED (rc $?)"; failed=$((failed + 1)); fi
    tail -n 5 "$OUT/$name.log"
}

"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(),
torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')" | tee "$OUT/env.log"

step cuda-tests "$PY" -m pytest -q -x -k cuda tests/test_engine_runner.py tests/test_engine_spill.py \
    tests/test_engine_storage.py tests/test_engine_vamp.py -p no:cacheprovider
step vllm-backings "$PY" -m pytest -q tests/test_vllm_cuda_backing.py tests/test_vllm_backing.py \
    tests/test_vllm_staging.py -p no:cacheprovider
step calibrate "$PY" -m moetide.cli calibrate --quick --out "$OUT/host.toml"
MODEL="$OUT/tiny-qwen3-moe"
step make-model "$PY" -m moetide.cli make-test-model --arch qwen3_moe --out "$MODEL" --layers 4 --hidden 256 \
    --experts 16 --top-k 2
DEVICE=cuda
"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" || DEVICE=cpu
step bench-engine "$PY" -m moetide.cli bench-engine --model "$MODEL" --device "$DEVICE" --kv-cache-memory 64MiB
printf 'The scheduler compares the cost of evicting a prefix\n%.0s' 1 2 3 4 5 6 7 8 > "$OUT/prompts.txt"
step generate-vamp "$PY" -m moetide.cli generate --model "$MODEL" --device "$DEVICE" --prompts-file \
    "$OUT/prompts.txt" --max-tokens 32 --ignore-eos --kv-cache-memory 256KiB --policy vamp-reclaim \
    --vamp-horizon-s 0.5 --json "$OUT/generate-vamp.json"
for mode in fetch cpu; do
    step "generate-cold-$mode" "$PY" -m moetide.cli generate --model "$MODEL" --device "$DEVICE" --prompts-file \
        "$OUT/prompts.txt" --max-tokens 32 --ignore-eos --static-offload --max-offload-ratio 0.25 \
        --cold-experts "$mode" --json "$OUT/generate-cold-$mode.json"
done
step cold-experts-same-tokens "$PY" -c "import json, sys
runs = [json.load(open(sys.argv[i])) for i in (1, 2)]
tokens = [[o['token_ids'] for o in r['outputs']] for r in runs]
print({m: (r['stats']['experts_staged'], r['stats']['experts_on_host']) for m, r in zip(('fetch', 'cpu'), runs)})
sys.exit(0 if tokens[0] == tokens[1] else 1)" "$OUT/generate-cold-fetch.json" "$OUT/generate-cold-cpu.json"
rm -rf "$MODEL"  # only logs and small files come back
echo "failed steps: $failed"
exit "$failed"
