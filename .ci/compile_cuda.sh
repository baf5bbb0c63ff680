#!/usr/bin/env bash
# Compile every csrc/**/*.cu with nvcc -c for sm_90a and sm_80 (object files are thrown away): catches
# syntax, template and PTX-assembly errors on machines without a GPU. Skips when nvcc is absent.
set -euo pipefail
cd "$(dirname "$0")/.."
NVCC="${NVCC:-$(command -v nvcc || true)}"
if [[ -z "$NVCC" && -x /usr/local/cuda/bin/nvcc ]]; then NVCC=/usr/local/cuda/bin/nvcc; fi
if [[ -z "$NVCC" ]]; then echo "compile_cuda: SKIP (nvcc not found)"; exit 0; fi
PY="${PYTHON:-python}"
mapfile -t INC < <("$PY" - <<'PYEOF'
import sysconfig
from torch.utils.cpp_extension import include_paths
for p in include_paths() + [sysconfig.get_paths()["include"]]:
    print("-I" + p)
PYEOF
)
mapfile -t SRCS < <(find csrc -name '*.cu' | sort)
if [[ ${#SRCS[@]} -eq 0 ]]; then echo "compile_cuda: no .cu files"; exit 0; fi
OUT="$(mktemp -d)"; trap 'rm -rf "$OUT"' EXIT
FLAGS=(-c -std=c++17 -O3 -Xcompiler -fPIC
       -gencode arch=compute_90a,code=sm_90a -gencode arch=compute_80,code=sm_80
       -D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__ -D__CUDA_NO_BFLOAT16_CONVERSIONS__
       -D__CUDA_NO_HALF2_OPERATORS__ --expt-relaxed-constexpr -DTORCH_API_INCLUDE_EXTENSION_H
       -DTORCH_EXTENSION_NAME=lqe_ci -Werror all-warnings)
JOBS="${JOBS:-$(nproc 2>/dev/null || echo 2)}"
echo "compile_cuda: $("$NVCC" --version | tail -1) ${#SRCS[@]} file(s), $JOBS job(s)"
fail=0; pids=(); logs=(); names=()
reap() {  # wait for the oldest job
  if ! wait "${pids[0]}"; then echo "FAIL ${names[0]}"; cat "${logs[0]}"; fail=1; fi
  pids=("${pids[@]:1}"); logs=("${logs[@]:1}"); names=("${names[@]:1}")
}
# The host bindings (csrc/gemm/bindings.cpp, compiled only by lqe.kernels.build on a GPU machine): a syntax and type
# check against the headers' launchers, beside the .cu jobs. A CPU-only torch lacks one generated CUDA header; an
# empty stand-in is found after the real include paths (-idirafter), so a CUDA torch's own wins.
CXX="${CXX:-$(command -v g++ || true)}"
if [[ -n "$CXX" ]]; then
  mkdir -p "$OUT/stub/c10/cuda/impl" && echo "#pragma once" > "$OUT/stub/c10/cuda/impl/cuda_cmake_macros.h"
  CUDA_INC=$("$NVCC" --dryrun -x cu -c /dev/null 2>&1 | sed -n 's/.*INCLUDES="-I\([^"]*\)".*/\1/p' | head -1)
  ( "$CXX" -fsyntax-only -std=c++17 "${INC[@]}" ${CUDA_INC:+-I"$CUDA_INC"} -idirafter "$OUT/stub" -Icsrc/gemm \
      -DTORCH_API_INCLUDE_EXTENSION_H -DTORCH_EXTENSION_NAME=lqe_ci csrc/gemm/bindings.cpp >"$OUT/bindings.log" 2>&1 ) &
  pids+=($!); logs+=("$OUT/bindings.log"); names+=("csrc/gemm/bindings.cpp (g++ -fsyntax-only)")
fi
for i in "${!SRCS[@]}"; do
  src="${SRCS[$i]}"
  ( "$NVCC" "${FLAGS[@]}" "${INC[@]}" -Icsrc/gemm "$src" -o "$OUT/$i.o" >"$OUT/$i.log" 2>&1 ) &
  pids+=($!); logs+=("$OUT/$i.log"); names+=("$src")
  if (( ${#pids[@]} >= JOBS )); then reap; fi
done
while (( ${#pids[@]} > 0 )); do reap; done
if (( fail )); then echo "compile_cuda: FAILED"; exit 1; fi
echo "compile_cuda: OK (${SRCS[*]}${CXX:+ csrc/gemm/bindings.cpp})"

# The SASS of every object: no instruction may read a uniform register that nothing in its kernel writes
# (.ci/sass_check.py: a ptxas 13.0 miscompile of cp.async with an L2 cache hint that killed lqe-w4a16-mma on the
# H200 with "illegal instruction"), and in a PDL kernel every path waits (griddepcontrol.wait) before it touches
# memory other than its weights. cuobjdump comes with the CUDA toolkit, or with the triton wheel torch installs.
CUOBJDUMP="${CUOBJDUMP:-$(command -v cuobjdump || true)}"
if [[ -z "$CUOBJDUMP" && -x "$(dirname "$NVCC")/cuobjdump" ]]; then CUOBJDUMP="$(dirname "$NVCC")/cuobjdump"; fi
if [[ -z "$CUOBJDUMP" ]]; then
  CUOBJDUMP=$("$PY" -c "import os, triton; p = os.path.join(os.path.dirname(triton.__file__), 'backends/nvidia/bin/cuobjdump'); print(p if os.access(p, os.X_OK) else '')" 2>/dev/null || true)
fi
if [[ -z "$CUOBJDUMP" ]]; then echo "sass_check: SKIP (cuobjdump not found)"; exit 0; fi
for i in "${!SRCS[@]}"; do
  "$CUOBJDUMP" -sass "$OUT/$i.o" | "$PY" .ci/sass_check.py --name "${SRCS[$i]}" || fail=1
done
if (( fail )); then echo "sass_check: FAILED (a uniform register read but never written, or a PDL kernel path that touches memory before griddepcontrol.wait: see above)"; exit 1; fi
echo "sass_check: OK (every uniform register read is written; every PDL kernel path waits first; $("$CUOBJDUMP" --version | tail -1))"
