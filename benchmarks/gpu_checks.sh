#!/usr/bin/env bash
# The device checks, as one prepared script for a session that is lent a GPU (the `device` tool runs it from the
# repository root; CI never does). Nothing is installed: the device image's python3 already holds torch, Triton,
# transformers, safetensors, tokenizers, pytest and hypothesis, and the source runs from src/ (PYTHONPATH). vLLM is
# not there and cannot be: every check uses torch alone.
#
#   run:      bash benchmarks/gpu_checks.sh             (timeout_s ~540; what it writes under $OUT comes back)
#   dry run:  bash benchmarks/gpu_checks.sh --dry-run   (here, without a GPU: each check's CPU part)
#   list:     bash benchmarks/gpu_checks.sh --list
#
# One JSON line per check on stdout ({"check", "ok", "rc", "seconds", "device"}); each check's output goes to
# $OUT/<check>.log; a failing check does not stop the others; the exit status is the number of failed checks.
set -u
MODE=run
case "${1:-}" in --dry-run) MODE=dry ;; --list) MODE=list ;; "") ;; *) echo "usage: $0 [--dry-run|--list]" >&2; exit 2 ;; esac
OUT="${OUT:-/tmp/gpu_checks}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
failed=0
DEVICE=cuda
if [ "$MODE" = dry ] || ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    DEVICE=cpu
fi
declare -A ABOUT=(
    [vmm-ledger]="the line's one memory (vllm.vmm, vmm_backing) on the driver: device bytes never above the start-up budget through grant, staging and give-back; experts and KV intact; 1,000 cycles leak nothing; a grant that cannot be covered changes nothing"
    [vmm-graph]="the pager's per-call path and a reference MoE over moved chunks, captured once in a CUDA graph and replayed while regions are granted and given back: outputs equal the all-resident reference"
    [vmm-fp8]="block-FP8 experts and their scales paged and staged: the dequantize-and-apply MoE over the slots equals it over the original tensors"
    [staging]="the per-call path's slot tables, counters, Triton masked copy from pinned rows, and its CUDA-graph replay across line moves (plain device rows)"
    [staging-overlap]="the staging copy on a side stream beside MoE-shaped compute: the overlap measured (benchmarks/gpu_staging_overlap.py)"
    [host-tier-merge]="the host KV tier's CUDA side: torch's fused attention over the device-resident keys with its log-sum-exp, merged with a CPU partial over the host-resident ones, equals full attention (decode and a causal prefill chunk, GQA, fp32/fp16/bf16, five split points)"
    [triton-fused-moe]="vLLM's Triton fused-MoE kernel with staging row ids: not run, the kernel is vLLM's and vLLM cannot be installed on the lent machine"
    [engine-cuda-tests]="moetide's engine on CUDA: parity with transformers under a tight budget, split attention with host KV, the arena, vamp-reclaim"
    [calibrate]="moetide calibrate --quick: this host's DRAM and CPU attention, and the pinned host->device bandwidth"
    [make-model]="moetide make-test-model: the tiny qwen3_moe checkpoint the next checks run"
    [bench-engine]="moetide bench-engine on a tiny checkpoint: prefill/decode tokens/s at batch 1, 8, 32"
    [generate-vamp]="moetide generate --policy vamp-reclaim under a tight budget (counters in JSON)"
    [generate-cold-fetch]="moetide generate --static-offload, offloaded experts staged from pinned host copies"
    [generate-cold-cpu]="moetide generate --static-offload, offloaded experts computed on the host"
    [cold-experts-same-tokens]="the two runs above give the same tokens"
)
ORDER=(vmm-ledger vmm-graph vmm-fp8 staging staging-overlap host-tier-merge triton-fused-moe engine-cuda-tests calibrate make-model
       bench-engine generate-vamp generate-cold-fetch generate-cold-cpu cold-experts-same-tokens)
if [ "$MODE" = list ]; then
    for name in "${ORDER[@]}"; do printf '%-26s %s\n' "$name" "${ABOUT[$name]}"; done
    exit 0
fi

check() {  # check NAME COMMAND...: run, log, one JSON line, count a failure
    local name=$1 rc start ms
    shift
    start=$(date +%s%N)
    "$@" >"$OUT/$name.log" 2>&1
    rc=$?
    [ $rc -eq 0 ] || failed=$((failed + 1))
    ms=$(( ($(date +%s%N) - start) / 1000000 ))
    printf '{"check": "%s", "ok": %s, "rc": %d, "seconds": %d.%03d, "device": "%s"}\n' "$name" \
        "$([ $rc -eq 0 ] && echo true || echo false)" "$rc" $((ms / 1000)) $((ms % 1000)) "$DEVICE"
}

"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(),
torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')" >"$OUT/env.log" 2>&1
PYTEST=("$PY" -m pytest -q -p no:cacheprovider)
check vmm-ledger "${PYTEST[@]}" tests/test_vllm_vmm.py -k "not replays and not fp8"
check vmm-graph "${PYTEST[@]}" tests/test_vllm_vmm.py -k replays
check vmm-fp8 "${PYTEST[@]}" tests/test_vllm_vmm.py -k fp8
check staging "${PYTEST[@]}" tests/test_vllm_staging.py tests/test_vllm_backing.py
OVERLAP_ARGS=()
[ "$DEVICE" = cpu ] && OVERLAP_ARGS=(--dry-run)
check staging-overlap "$PY" benchmarks/gpu_staging_overlap.py "${OVERLAP_ARGS[@]}"
check host-tier-merge "${PYTEST[@]}" tests/test_split_attention_cuda.py
printf '{"check": "triton-fused-moe", "ok": null, "skipped": "%s"}\n' "${ABOUT[triton-fused-moe]}"
check engine-cuda-tests "${PYTEST[@]}" -x -k cuda tests/test_engine_runner.py tests/test_engine_spill.py \
    tests/test_engine_storage.py tests/test_engine_vamp.py
check calibrate "$PY" -m moetide.cli calibrate --quick --out "$OUT/host.toml"
MODEL="$OUT/tiny-qwen3-moe"
check make-model "$PY" -m moetide.cli make-test-model --arch qwen3_moe --out "$MODEL" --overwrite --layers 4 \
    --hidden 256 --experts 16 --top-k 2
check bench-engine "$PY" -m moetide.cli bench-engine --model "$MODEL" --device "$DEVICE" --kv-cache-memory 64MiB
printf 'The scheduler compares the cost of evicting a prefix\n%.0s' 1 2 3 4 5 6 7 8 > "$OUT/prompts.txt"
check generate-vamp "$PY" -m moetide.cli generate --model "$MODEL" --device "$DEVICE" --prompts-file \
    "$OUT/prompts.txt" --max-tokens 32 --ignore-eos --kv-cache-memory 256KiB --policy vamp-reclaim \
    --vamp-horizon-s 0.5 --json "$OUT/generate-vamp.json"
for mode in fetch cpu; do
    check "generate-cold-$mode" "$PY" -m moetide.cli generate --model "$MODEL" --device "$DEVICE" --prompts-file \
        "$OUT/prompts.txt" --max-tokens 32 --ignore-eos --static-offload --max-offload-ratio 0.25 \
        --cold-experts "$mode" --json "$OUT/generate-cold-$mode.json"
done
check cold-experts-same-tokens "$PY" -c "import json, sys
runs = [json.load(open(sys.argv[i])) for i in (1, 2)]
tokens = [[o['token_ids'] for o in r['outputs']] for r in runs]
print({m: (r['stats']['experts_staged'], r['stats']['experts_on_host']) for m, r in zip(('fetch', 'cpu'), runs)})
sys.exit(0 if tokens[0] == tokens[1] else 1)" "$OUT/generate-cold-fetch.json" "$OUT/generate-cold-cpu.json"
rm -rf "$MODEL"  # only logs and small files come back
echo "failed checks: $failed" >&2
exit "$failed"
