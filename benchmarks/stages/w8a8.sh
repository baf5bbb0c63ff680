#!/usr/bin/env bash
# Issue 25 (W8A8 int8 and FP8 that beat bf16): `bash benchmarks/run_gpu.sh --w8a8`. Steps:
#   1. build the CUDA kernels (common.sh),
#   2. tests: the GPU tests of the W8A8 / FP8 kernels (fused quantization bit-exactness: int8 sym / asym / static,
#      fp8; the standalone Triton activation quantizer of unfused layers such as o_proj; the GEMV, the fp8 GEMMs, the
#      int8 GEMMs; ~2-3 min), then the model-level checks of the int8 / fp8 formats (tests/gpu/test_model_matrix.py,
#      test_quant_layers_gpu.py, test_cuda_graphs.py with -k "w8a8 or fp8": 33 tests; limit LQE_MODEL_TEST_TIMEOUT),
#   3. kernels: the W8A8 / FP8 rows only (--rows w8a8,fp8) on the Llama-3-8B shapes at M = 1 16 64 256 1024:
#      per-kernel rows, the layer rows (lqe-w8a8-layer, lqe-fp8-layer, lqe-fp8-block-layer: the fused producer +
#      GEMM against producer + cuBLAS bf16; for o_proj the standalone quantizer + GEMM against cuBLAS bf16 alone), the
#      floors, and the W8A8 / FP8 tables the run implies, printed and saved after every shape
#      -> $OUTDIR/kernels-$SLUG.json,
#   4. (LQE_W8A8_SWEEP=1 only) the GEMV / int8 tile-config sweep at M = LQE_W8A8_SWEEP_MS (default 1 16) on two
#      shapes, printing paste-able triton_w8a8 / triton_gemv_w8a8 CONFIGS and W8A8_TABLE
#      -> $OUTDIR/kernels-w8a8-sweep-$SLUG.json,
#   5. (LQE_FP8_SWEEP=1 only) the same for fp8 at M = LQE_FP8_SWEEP_MS (default 1 16 256): per-channel, block-scaled,
#      GEMV; triton_fp8 CONFIGS / BLOCK_CONFIGS, triton_gemv_w8a8 FP8_CONFIGS, FP8_TABLE
#      -> $OUTDIR/kernels-fp8-sweep-$SLUG.json,
#   6. the end-to-end rows on the llama3-8b shape, same run: bf16, w8a8-online (int8 per-channel weights, dynamic
#      per-token activations, quantized on load: the `w8a8` scheme without a 16 GB conversion) and fp8 (dynamic,
#      quantized on load), no eager columns, LQE_W8A8_REQUESTS (32) requests -> $OUTDIR/e2e-$SLUG.json (~3 min).
# Time limits (s): LQE_TEST_TIMEOUT (200), LQE_MODEL_TEST_TIMEOUT (150), LQE_KERNELS_TIMEOUT (150), LQE_SWEEP_TIMEOUT
# (150, each sweep), LQE_E2E_TIMEOUT (560: the last step), each cut to what is left of the stage budget LQE_BUDGET_S (570 s; a step
# with under 30 s left is skipped, and kernels.py saves its rows and tables shape by shape, so a cut step keeps what
# it measured). The steps add up to more than one device call: run the tests and kernels in one
# (LQE_SKIP=e2e) and the e2e in another (LQE_SKIP="tests kernels"), sweeps likewise alone.
# LQE_SKIP="tests kernels sweep e2e" skips steps (sweep: both sweeps). Exit status non-zero when any step failed.
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
rc=0

if ! skip tests; then
  LQE_TEST_TIMEOUT=${LQE_TEST_TIMEOUT:-200} run_tests w8a8 tests/gpu/test_fused_act_quant.py \
    tests/gpu/test_fused_act_quant_schemes.py tests/gpu/test_fused_act_quant_fp8.py tests/gpu/test_act_quant_standalone.py \
    tests/gpu/test_gemv_w8a8.py tests/gpu/test_triton_fp8_gemm.py tests/gpu/test_gemm_w8a8.py || rc=1
  LQE_TEST_TIMEOUT=${LQE_MODEL_TEST_TIMEOUT:-150} run_tests w8a8-models tests/gpu/test_model_matrix.py \
    tests/gpu/test_quant_layers_gpu.py tests/gpu/test_cuda_graphs.py -k "w8a8 or fp8" || rc=1
fi

if ! skip kernels; then
  echo "== kernel rows (W8A8 / FP8 only; Llama-3-8B shapes, M = 1 16 64 256 1024)"
  timeout "$(budget "${LQE_KERNELS_TIMEOUT:-150}")" python benchmarks/kernels.py --rows w8a8,fp8 --m 1 16 64 256 1024 \
    --out "$OUTDIR/kernels-$SLUG.json" > "$LOGDIR/w8a8-kernels.log" 2>&1
  krc=$?
  grep -E "^# |^(cublas-bf16|w8a8-table\+quant|lqe-w8a8-layer|lqe-fp8-layer|lqe-fp8-block-layer|triton-gemv|triton-gemv-fp8|triton-fp8|lqe-fp8/torch-scaled-mm) " \
    "$LOGDIR/w8a8-kernels.log"
  [[ $krc -eq 0 ]] || { echo "kernels: exit $krc (log: $LOGDIR/w8a8-kernels.log)"; rc=1; }
  pack_logs
fi

if [[ "${LQE_W8A8_SWEEP:-0}" == 1 ]] && ! skip sweep; then
  echo "== GEMV / int8 tile-config sweep (M = ${LQE_W8A8_SWEEP_MS:=1 16})"
  timeout "$(budget "${LQE_SWEEP_TIMEOUT:-150}")" python benchmarks/kernels.py --w8a8-sweep --m $LQE_W8A8_SWEEP_MS --shapes 4096x6144 14336x4096 \
    --out "$OUTDIR/kernels-w8a8-sweep-$SLUG.json" > "$LOGDIR/w8a8-sweep.log" 2>&1
  src=$?
  grep -E "^# |^[A-Z_0-9]+ = \[|^    \(|^\]" "$LOGDIR/w8a8-sweep.log" | tail -60
  [[ $src -eq 0 ]] || { echo "sweep: exit $src"; rc=1; }
  pack_logs
fi

if [[ "${LQE_FP8_SWEEP:-0}" == 1 ]] && ! skip sweep; then
  echo "== fp8 GEMM / block-scaled / GEMV config sweep (M = ${LQE_FP8_SWEEP_MS:=1 16 256})"
  timeout "$(budget "${LQE_SWEEP_TIMEOUT:-150}")" python benchmarks/kernels.py --fp8-sweep --m $LQE_FP8_SWEEP_MS --shapes 4096x6144 14336x4096 \
    --out "$OUTDIR/kernels-fp8-sweep-$SLUG.json" > "$LOGDIR/fp8-sweep.log" 2>&1
  frc=$?
  grep -E "^# |^[A-Z_0-9]+ = \[|^    \(|^\]" "$LOGDIR/fp8-sweep.log" | tail -60
  [[ $frc -eq 0 ]] || { echo "fp8 sweep: exit $frc"; rc=1; }
  pack_logs
fi

if ! skip e2e; then
  echo "== e2e llama3-8b: bf16, w8a8-online, fp8"
  timeout "$(budget "${LQE_E2E_TIMEOUT:-560}")" python benchmarks/e2e_gpu.py --shapes llama3-8b --variants bf16,w8a8-online,fp8 \
    --num-requests "${LQE_W8A8_REQUESTS:-32}" --no-eager --out-dir "$OUTDIR" > "$LOGDIR/w8a8-e2e.log" 2>&1
  erc=$?
  grep -E "^\[" "$LOGDIR/w8a8-e2e.log"
  [[ $erc -eq 0 ]] || { echo "e2e: exit $erc (log: $LOGDIR/w8a8-e2e.log)"; rc=1; }
  pack_logs
fi
exit $rc
