#!/usr/bin/env bash
# One command for a GPU machine: build the lqe CUDA kernels (JIT), run the GPU GEMM tests, then the kernel
# benchmark. Outputs go under $OUT when set (else benchmarks/results/). Usage: bash benchmarks/run_gpu_kernels.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUTDIR="${OUT:-benchmarks/results}"; mkdir -p "$OUTDIR"
if [[ -z "${LQE_CUDA_ARCHS:-}" ]]; then  # build only for this GPU: faster first use
  LQE_CUDA_ARCHS=$(python -c "import torch;c=torch.cuda.get_device_capability();print(f'{c[0]}{c[1]}'+('a' if c[0]==9 else ''))" 2>/dev/null || echo "80;89;90a")
  export LQE_CUDA_ARCHS
fi
python -c "import logging;logging.basicConfig(level=logging.INFO);import lqe.kernels as k;print('lqe kernels available:',k.available(),k.unavailable_reason() or '')" 2>&1 | tee "$OUTDIR/build.log"
python -m pytest -m gpu tests/gpu/test_gemm_wna16.py tests/gpu/test_gemm_w8a8.py -q -x --junitxml="$OUTDIR/gpu-tests.xml" 2>&1 | tail -40 | tee "$OUTDIR/gpu-tests.txt"
rc=${PIPESTATUS[0]}
python benchmarks/kernels.py --out "$OUTDIR/kernels-$(python -c "import torch;print(''.join(c if c.isalnum() else '-' for c in torch.cuda.get_device_name()).strip('-').lower())" 2>/dev/null || echo gpu).json" 2>&1 | tee "$OUTDIR/kernels.txt"
exit $(( rc || ${PIPESTATUS[0]} ))
