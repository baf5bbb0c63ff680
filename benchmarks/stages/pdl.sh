#!/usr/bin/env bash
# Programmatic dependent launch (on by default on sm_90+, LQE_PDL=0 off; issues 24, 25, 26). `bash benchmarks/run_gpu.sh
# --pdl`, one device call
# (sm_90+; on an older GPU the tests skip and the -pdl rows fail, naming why):
#   1. build the CUDA kernels for this GPU (common.sh),
#   2. tests: PDL against none, bit for bit: a chain of six CUDA GEMVs eagerly and in a CUDA graph
#      (test_gemm_wna16.py), and models (float, W4A16 / W8A16, int8 W8A8, FP8) token for token and logprob for
#      logprob, in graphs and eagerly (test_pdl_models.py),
#   3. kernels: the CUDA GEMV (default and ring) with and without PDL at M = 1 / 4 / 16 beside the layer path and
#      cuBLAS bf16, graph-timed back-to-back calls (kernels.py --w4a16: the rows lqe-w4a16-fused[-ring][-pdl]),
#      -> $OUTDIR/kernels-pdl-<gpu>.json,
#   4. e2e: the small shapes (decode is launch-bound there: where PDL shows first), each variant (with PDL, the
#      default) beside its -nopdl twin (LQE_PDL=0) in the same run (LQE_PDL_VARIANTS, default
#      bf16-nopdl,bf16,w4a16,w4a16-nopdl,w8a8,w8a8-nopdl; LQE_PDL_SHAPES, default smollm2-135m; LQE_PDL_REQUESTS
#      requests, default 32) -> $OUTDIR/e2e-<gpu>.json (rows merged by shape and variant); bf16's twin runs first
#      (at 50fb9ce bf16 ran first and was the slow one of its pair: TTFT phase 0.7 s against 0.3 s for every other
#      variant, throughput 0.85x its twin; a slow bf16-nopdl now is the first variant's cost, not PDL's),
# then $OUTDIR/pdl-stage-<gpu>.json (exit codes, seconds). Time limits (s): LQE_TEST_TIMEOUT (150),
# LQE_KERNELS_TIMEOUT (150), LQE_E2E_TIMEOUT (300), all cut to the stage budget LQE_BUDGET_S (570).
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
t0=$(date +%s)
rc_tests=-1; rc_sweep=-1; rc_e2e=-1
if [[ $BUILD_RC -eq 0 ]]; then
  if ! skip tests; then
    LQE_TEST_TIMEOUT=${LQE_TEST_TIMEOUT:-150} run_tests pdl tests/gpu/test_gemm_wna16.py::test_pdl_gives_the_same_outputs \
      tests/gpu/test_pdl_models.py
    rc_tests=$?
  fi
  if ! skip sweep; then
    echo "== CUDA GEMV with and without PDL (M = ${LQE_KERNEL_MS:-1 4 16})"
    timeout "$(budget "${LQE_KERNELS_TIMEOUT:-150}")" python benchmarks/kernels.py --w4a16 --m ${LQE_KERNEL_MS:-1 4 16} \
      --shapes ${LQE_PDL_KERNEL_SHAPES:-4096x4096 14336x4096} --out "$OUTDIR/kernels-pdl-$SLUG.json" 2>&1 \
      | tee "$LOGDIR/kernels-pdl.txt" | grep -E "^(# |lqe-w4a16 |lqe-w4a16-fused|cublas)" | tail -60
    rc_sweep=${PIPESTATUS[0]}
    pack_logs
  fi
  if ! skip e2e; then
    echo "== e2e ${LQE_PDL_SHAPES:=smollm2-135m}: ${LQE_PDL_VARIANTS:=bf16-nopdl,bf16,w4a16,w4a16-nopdl,w8a8,w8a8-nopdl}"
    timeout "$(budget "${LQE_E2E_TIMEOUT:-300}")" python benchmarks/e2e_gpu.py --shapes "$LQE_PDL_SHAPES" \
      --variants "$LQE_PDL_VARIANTS" --num-requests "${LQE_PDL_REQUESTS:-32}" --max-num-seqs 64 --no-eager \
      --out-dir "$OUTDIR" > "$LOGDIR/pdl-e2e.log" 2>&1
    rc_e2e=$?
    grep -E "^\[" "$LOGDIR/pdl-e2e.log"
    pack_logs
  fi
fi
stage_summary pdl "$t0" tests=$rc_tests kernels=$rc_sweep e2e=$rc_e2e
