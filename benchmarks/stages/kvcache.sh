#!/usr/bin/env bash
# Issue 29 (fp8 KV cache): `bash benchmarks/run_gpu.sh --kvcache`. About 7 minutes on an H100:
#   1. build the CUDA kernels (common.sh),
#   2. the GPU tests of the Triton paged attention over fp8 caches (store bytes == the torch reference, prefill /
#      split-K decode / mixed batches vs the reference, scales read at replay time by a CUDA graph), and the bf16
#      attention tests beside them, and the engine with an fp8 cache (tests/gpu/test_kv_cache_fp8_engine.py: graphs
#      and piecewise graphs give the eager tokens, prefix caching, preemption, the block count) (~1-2 min),
#   3. decode at 4k-token contexts, batch 64, on the llama3-8b shape (random bf16 weights: e2e_gpu.py's checkpoint,
#      $LQE_BENCH_DIR/llama3-8b/bf16, built once and shared): bf16, fp8 KV (keys rotated, the default) and fp8-plain
#      (no rotation: its cost) in the same run; every request prefilled first, then 64 engine steps timed with exactly
#      64 sequences decoding: tok/s beside the byte floor at the device's bandwidth; the allocator's blocks /
#      concurrent sequences at gpu_memory_utilization 0.9 -> $OUTDIR/kvcache-$SLUG.json, written after each variant
#      (~5 min with the checkpoint built; LQE_KV_ARGS="--variants auto,fp8" ~4).
# Time limits (s): LQE_TEST_TIMEOUT (150), LQE_KV_TIMEOUT (560: the last step), cut to the stage budget LQE_BUDGET_S (570).
# LQE_SKIP="tests bench" skips steps.
# LQE_KV_ARGS replaces the benchmark's arguments (e.g. "--shape smollm2-135m" for a quick check).
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
rc=0

if ! skip tests; then
  LQE_TEST_TIMEOUT=${LQE_TEST_TIMEOUT:-150} run_tests kvcache tests/gpu/test_triton_attention_fp8.py \
    tests/gpu/test_triton_attention.py tests/gpu/test_kv_cache_fp8_engine.py || rc=1
fi

if ! skip bench; then
  echo "== fp8 vs bf16 KV cache: decode at 4k contexts x 64, capacity"
  # shellcheck disable=SC2086
  timeout "$(budget "${LQE_KV_TIMEOUT:-560}")" python benchmarks/kv_cache_gpu.py ${LQE_KV_ARGS:-} --out "$OUTDIR/kvcache-$SLUG.json" \
    2>&1 | tee "$LOGDIR/kvcache.log" | grep -v "^\[lqe"
  brc=${PIPESTATUS[0]}
  [[ $brc -eq 0 ]] || { echo "kv_cache_gpu: exit $brc (log: $LOGDIR/kvcache.log)"; rc=1; }
  pack_logs
fi
echo "kvcache stage: exit $rc"
exit $rc
