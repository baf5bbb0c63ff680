#!/usr/bin/env bash
# ptxas resource report of lqe-w4a16-mma (csrc/gemm/w4a16_mma.cu) per template configuration and arch:
# registers, spills (none may sit in a k-tile loop: read the SASS where ptxas reports any) and shared memory
# (dynamic: stages * (weights + activations + 2 x scale slots) per stage, + the KW = 2 hand-over buffer, from the
# Smem<> formula; ptxas reports only static shared memory). No GPU needed.
#   bash benchmarks/w4a16_ptxas.sh > benchmarks/results/w4a16-ptxas.txt
set -euo pipefail
cd "$(dirname "$0")/.."
NVCC="${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}"
mapfile -t INC < <(python - <<'PY'
import sysconfig
from torch.utils.cpp_extension import include_paths
for p in include_paths() + [sysconfig.get_paths()["include"]]:
    print("-I" + p)
PY
)
LOG=$(mktemp); trap 'rm -f "$LOG" "$LOG.o"' EXIT
"$NVCC" -c -std=c++17 -O3 -Xcompiler -fPIC -gencode arch=compute_90a,code=sm_90a -gencode arch=compute_80,code=sm_80 \
  -D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__ -D__CUDA_NO_BFLOAT16_CONVERSIONS__ \
  -D__CUDA_NO_HALF2_OPERATORS__ --expt-relaxed-constexpr -Werror all-warnings "${INC[@]}" -Icsrc/gemm \
  --ptxas-options=-v csrc/gemm/w4a16_mma.cu -o "$LOG.o" > "$LOG" 2>&1
echo "# lqe-w4a16-mma ptxas -v ($("$NVCC" --version | tail -1)), commit $(git rev-parse --short HEAD 2>/dev/null || echo ?)"
echo "# command: bash benchmarks/w4a16_ptxas.sh"
echo "# g64: one scale group per 64-row k-tile (group size a power of two >= 64, or channel-wise); stages and dynamic"
echo "# shared memory from the Smem<BITS, MB, G64, KW> formula (ptxas reports only static shared memory); threads:"
echo "# 128 x KW (KW = 2: 8 warps splitting each k-tile, g64 only, + the MB x 16 KB hand-over buffer)"
python - "$LOG" <<'PY'
import re, sys
cur = None
print(f"{'arch':7} {'act':5} {'bits':>4} {'rows':>4} {'g64':>3} {'threads':>7} {'stages':>6} {'regs':>5} {'spill_st':>8} {'spill_ld':>8} "
      f"{'stack':>5} {'smem_dyn':>9}")
for line in open(sys.argv[1]):
    m = re.search(r"Compiling entry function '(\S+)' for '(sm_\w+)'", line)
    if m and "w4a16_mma_kernel" in m.group(1):
        t = re.search(r"kernelI(\w+?)Li(\d)ELi(\d)ELb(\d)ELi(\d)E", m.group(1))
        cur = {"arch": m.group(2), "act": "bf16" if "bfloat16" in t.group(1) else "fp16", "bits": int(t.group(2)),
               "mb": int(t.group(3)), "g64": t.group(4) == "1", "kw": int(t.group(5))}
        continue
    if cur is None:
        continue
    m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
    if m:
        cur["stack"], cur["st"], cur["ld"] = m.groups()
    m = re.search(r"Used (\d+) registers", line)
    if m:
        c = cur
        stages = 8 if c["bits"] == 4 and c["mb"] == 1 and c["g64"] else 4
        smem = stages * (64 * 256 * c["bits"] // 8 + c["mb"] * 16 * 64 * 2 + 2 * (1 if c["g64"] else 4) * 256 * 2)
        smem += c["mb"] * 8 * 4 * 128 * 4 if c["kw"] > 1 else 0
        print(f"{c['arch']:7} {c['act']:5} {c['bits']:>4} {16 * c['mb']:>4} {int(c['g64']):>3} {128 * c['kw']:>7} {stages:>6} "
              f"{m.group(1):>5} {c['st']:>8} {c['ld']:>8} {c['stack']:>5} {smem:>9}")
        cur = None
PY
