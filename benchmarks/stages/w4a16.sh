#!/usr/bin/env bash
# Issue 24 stage: lqe-w4a16-mma (csrc/gemm/w4a16_mma.cu). `bash benchmarks/run_gpu.sh --w4a16`, < 8 min on an H100:
#   1. build the CUDA kernels for this GPU (common.sh),
#   2. the lqe-w4a16-mma GPU tests (every W4/W8 format, group size, M, stripes, graphs, the layer path),
#   3. the W4A16 M sweep on the four Llama-3-8B shapes (M = 1 .. 1024): lqe-w4a16-mma and its dequantize +
#      cuBLAS beside the layer path lqe-w4a16, torch int4pack, triton-wna16, dequant + cuBLAS and cuBLAS bf16,
#      with bytes floors; it prints the WNA16_MMA_TABLE the measurement implies,
# writing $OUTDIR/kernels-w4a16-<gpu>.json and $OUTDIR/w4a16-stage-<gpu>.json (exit codes, seconds).
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
t0=$(date +%s)
rc_tests=1; rc_sweep=1
if [[ $BUILD_RC -eq 0 ]]; then
  LQE_TEST_TIMEOUT=${LQE_TEST_TIMEOUT:-240} run_tests w4a16 tests/gpu/test_gemm_w4a16_mma.py
  rc_tests=$?
  echo "== W4A16 M sweep"
  timeout "${LQE_KERNELS_TIMEOUT:-280}" python benchmarks/kernels.py --w4a16 --m ${LQE_KERNEL_MS:-1 2 4 8 16 32 64 128 256 1024} \
    --out "$OUTDIR/kernels-w4a16-$SLUG.json" 2>&1 | tee "$LOGDIR/kernels-w4a16.txt" | grep -v "^lqe-\|^cublas\|^torch\|^triton" | tail -40
  rc_sweep=${PIPESTATUS[0]}
fi
python - "$OUTDIR/w4a16-stage-$SLUG.json" "$BUILD_RC" "$rc_tests" "$rc_sweep" "$(( $(date +%s) - t0 ))" <<'PY'
import json, subprocess, sys
out, b, t, s, secs = sys.argv[1], *map(int, sys.argv[2:])
commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip() or None
json.dump({"stage": "w4a16", "commit": commit, "build": b, "tests": t, "sweep": s, "seconds": secs}, open(out, "w"), indent=1)
print(f"== w4a16 stage: build {b}, tests {t}, sweep {s}, {secs} s -> {out}")
PY
exit $(( BUILD_RC || rc_tests || rc_sweep ))
