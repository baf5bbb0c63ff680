#!/usr/bin/env bash
# Issue 24 stage: lqe-w4a16-mma (csrc/gemm/w4a16_mma.cu). `bash benchmarks/run_gpu.sh --w4a16`, one device call:
#   1. build the CUDA kernels for this GPU (common.sh),
#   2. tests: the lqe-w4a16-mma GPU tests (every W4/W8 format, group size, M, stripes, graphs, the layer path, and
#      a W4A16 model through the engine on the mma table: graphs give the eager tokens), lqe-wna16-ring against the
#      default GEMV and programmatic dependent launch against none (kernels and models: the same bits),
#   3. sweep: the W4A16 M sweep on the four Llama-3-8B shapes (M = 1 .. 1024): lqe-w4a16-mma and its dequantize +
#      cuBLAS beside the layer path lqe-w4a16, torch int4pack, triton-wna16, triton-wna16-swap, dequant + cuBLAS and cuBLAS bf16,
#      with bytes floors; it prints the WNA16_MMA_TABLE and WNA16_TABLE (one per weight layout) the measurement
#      implies -> $OUTDIR/kernels-w4a16-<gpu>.json
#      (kept apart from kernels-<gpu>.json, which the W8A8 stage and run_gpu.sh write; rows saved shape by shape);
#      LQE_WNA16_SWEEP=1 adds the triton-wna16 tile-config sweep at M = LQE_WNA16_SWEEP_MS (default 16 32 64 128)
#      on LQE_WNA16_SWEEP_SHAPES (default 4096x6144 14336x4096; kernels.py --wna16-sweep, which prints the paste-able
#      CONFIG_TABLE; its own step name: configs)
#      -> $OUTDIR/kernels-wna16-sweep-<gpu>.json,
#   4. e2e: the llama3-8b shape, bf16 and w4a16 (dispatch.WNA16_TABLE: set it from step 3's implied table first)
#      in the same run, no eager columns, LQE_W4A16_REQUESTS (default 32) requests -> $OUTDIR/e2e-<gpu>.json, rows
#      saved variant by variant. LQE_W4A16_VARIANTS adds w4a16-mma / w4a16-mma-k2 / w4a16-swap / w4a16-ring (the same
#      checkpoint on dispatch.WNA16_MMA_TABLE / WNA16_MMA_K2_TABLE / WNA16_SWAP_TABLE / WNA16_RING_TABLE) and
#      w4a16-nopdl (LQE_PDL=0: without programmatic dependent launch, the default on sm_90+; each ~1 min more). A
#      16 GB checkpoint is built first on a fresh machine, so this is a call of its own (the last step: its limit is
#      what is left of the budget):
#      LQE_SKIP="tests sweep" bash benchmarks/run_gpu.sh --w4a16
# then $OUTDIR/w4a16-stage-<gpu>.json (exit codes, seconds). Time limits (s): LQE_TEST_TIMEOUT (240),
# LQE_KERNELS_TIMEOUT (280), LQE_E2E_TIMEOUT (560), all cut to the stage budget LQE_BUDGET_S (570).
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
t0=$(date +%s)
rc_tests=-1; rc_sweep=-1; rc_e2e=-1
if [[ $BUILD_RC -eq 0 ]]; then
  if ! skip tests; then
    LQE_TEST_TIMEOUT=${LQE_TEST_TIMEOUT:-240} run_tests w4a16 tests/gpu/test_gemm_w4a16_mma.py tests/gpu/test_w4a16_mma_models.py \
      tests/gpu/test_gemm_wna16.py::test_ring_equals_the_register_buffered_gemv \
      tests/gpu/test_gemm_wna16.py::test_pdl_gives_the_same_outputs tests/gpu/test_pdl_models.py
    rc_tests=$?
  fi
  if ! skip sweep; then
    echo "== W4A16 M sweep"
    timeout "$(budget "${LQE_KERNELS_TIMEOUT:-280}")" python benchmarks/kernels.py --w4a16 \
      --m ${LQE_KERNEL_MS:-1 2 4 8 16 32 64 128 256 1024} --out "$OUTDIR/kernels-w4a16-$SLUG.json" 2>&1 \
      | tee "$LOGDIR/kernels-w4a16.txt" | grep -v "^lqe-\|^cublas\|^torch\|^triton" | tail -40
    rc_sweep=${PIPESTATUS[0]}
    pack_logs
  fi
  if [[ "${LQE_WNA16_SWEEP:-0}" == 1 ]] && ! skip configs; then
    echo "== triton-wna16 tile-config sweep (M = ${LQE_WNA16_SWEEP_MS:=16 32 64 128})"
    timeout "$(budget "${LQE_SWEEP_TIMEOUT:-150}")" python benchmarks/kernels.py --wna16-sweep --m $LQE_WNA16_SWEEP_MS \
      --shapes ${LQE_WNA16_SWEEP_SHAPES:-4096x6144 14336x4096} --out "$OUTDIR/kernels-wna16-sweep-$SLUG.json" \
      > "$LOGDIR/wna16-sweep.log" 2>&1
    wrc=$?
    grep -E "^# |^[A-Z_0-9]+ = \[|^    \(|^\]" "$LOGDIR/wna16-sweep.log" | tail -60
    (( wrc != 0 )) && rc_sweep=$wrc
    pack_logs
  fi
  if ! skip e2e; then
    echo "== e2e llama3-8b: ${LQE_W4A16_VARIANTS:=bf16,w4a16}"
    timeout "$(budget "${LQE_E2E_TIMEOUT:-560}")" python benchmarks/e2e_gpu.py --shapes llama3-8b \
      --variants "$LQE_W4A16_VARIANTS" --num-requests "${LQE_W4A16_REQUESTS:-32}" --no-eager --out-dir "$OUTDIR" \
      > "$LOGDIR/w4a16-e2e.log" 2>&1
    rc_e2e=$?
    grep -E "^\[" "$LOGDIR/w4a16-e2e.log"
    pack_logs
  fi
fi
stage_summary w4a16 "$t0" tests=$rc_tests sweep=$rc_sweep e2e=$rc_e2e
