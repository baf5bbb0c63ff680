#!/usr/bin/env bash
# Sourced by every focused GPU stage (benchmarks/stages/<name>.sh, run as `bash benchmarks/run_gpu.sh --<name>`):
# environment, output folder, GPU slug, and the CUDA build for this GPU only. Defines:
#   OUTDIR LOGDIR SLUG  and  run_tests <pytest args...>  (gpu-marked tests, JUnit XML in $LOGDIR)
#   budget WANT   WANT seconds, or what is left of the stage's LQE_BUDGET_S (default 570: one device call is 600 s)
#   skip NAME     true when NAME is in LQE_SKIP, or when under 30 s of the budget are left (then it says so)
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
source benchmarks/stages/budget.sh
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
out_and_logs  # budget.sh: results in $OUTDIR, logs in $LOGDIR (packed into $OUT/logs.tgz)
if ! python -c "import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "stage: no CUDA GPU visible (torch.cuda.is_available() is False); nothing was run." >&2
  exit 2
fi
SLUG=$(python -c "import re,torch;print(re.sub(r'[^a-z0-9]+','-',torch.cuda.get_device_name(0).lower()).strip('-'))")
if [[ -z "${LQE_CUDA_ARCHS:-}" ]]; then
  LQE_CUDA_ARCHS=$(python -c "import torch;c=torch.cuda.get_device_capability();print(f'{c[0]}{c[1]}'+('a' if c[0]==9 else ''))")
  export LQE_CUDA_ARCHS
fi
echo "== build the CUDA kernels ($LQE_CUDA_ARCHS)"
t0=$(date +%s)
timeout "$(budget "${LQE_BUILD_TIMEOUT:-300}")" python -c "import logging,sys;logging.basicConfig(level=logging.INFO);import lqe.kernels as k;ok=k.available();print('lqe kernels available:',ok,k.unavailable_reason() or '');sys.exit(0 if ok else 1)" \
  2>&1 | tee "$LOGDIR/build.log" | tail -20
BUILD_RC=${PIPESTATUS[0]}
pack_logs
echo "build: exit $BUILD_RC in $(( $(date +%s) - t0 )) s"

# run_tests NAME pytest-args...: gpu-marked tests (budget.sh's gpu_pytest: a device fault costs only its test), in
# LQE_STAGE_TEST_JOBS (default 4) pytest processes side by side on the one GPU, as run_gpu.sh's test stage does (the
# ids grouped by file and cost: benchmarks/stages/test_groups.py); summary lines, JUnit XML in $LOGDIR/NAME-<i>.xml
# (NAME.xml with one job; and .r1.xml, ... after a fault). Returns the first non-zero status of a group.
run_tests() {
  local name=$1; shift
  local jobs=${LQE_STAGE_TEST_JOBS:-4} rc=0 r i groups=() pids=() names=()
  if (( jobs > 1 )); then
    python -m pytest -m gpu --collect-only -q -p no:cacheprovider "$@" 2>/dev/null | grep "::" > "$LOGDIR/$name-ids.txt"
    mapfile -t groups < <(python - "$LOGDIR/$name-ids.txt" "$jobs" < benchmarks/stages/test_groups.py)
  fi
  if (( ${#groups[@]} > 1 )); then
    for i in "${!groups[@]}"; do
      gpu_pytest "$name-$i" "${LQE_TEST_TIMEOUT:-300}" ${groups[$i]} &
      pids+=($!) names+=("$name-$i")
    done
  else
    gpu_pytest "$name" "${LQE_TEST_TIMEOUT:-300}" "$@" &
    pids+=($!) names+=("$name")
  fi
  for i in "${!pids[@]}"; do
    wait "${pids[$i]}"; r=$?
    (( r != 0 && rc == 0 )) && rc=$r
    echo "-- tests ${names[$i]}: exit $r"; tail -12 "$LOGDIR/${names[$i]}.txt"
    [[ -f "$LOGDIR/${names[$i]}.fault" ]] && { echo "-- device faults (test, error):"; cat "$LOGDIR/${names[$i]}.fault"; }
  done
  pack_logs
  return $rc
}

# stage_summary NAME T0 STEP=RC ...: $OUTDIR/NAME-stage-$SLUG.json = {stage, commit, build, STEP: RC ..., seconds since
# T0}, a summary line, and success only when the build passed and no step failed (RC <= 0: -1 = not run).
stage_summary() {
  local name=$1 t0=$2; shift 2
  python - "$OUTDIR/$name-stage-$SLUG.json" "$name" "$BUILD_RC" "$(( $(date +%s) - t0 ))" "$@" <<'PY'
import json, os, subprocess, sys
out, name, build, secs, *steps = sys.argv[1:]
commit = os.environ.get("LQE_COMMIT") or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                                        text=True).stdout.strip() or None
rcs = {k: int(v) for k, v in (s.split("=", 1) for s in steps)}
json.dump({"stage": name, "commit": commit, "build": int(build), **rcs, "seconds": int(secs),
           "note": "exit codes; -1 = not run (LQE_SKIP or the time budget)"}, open(out, "w"), indent=1)
print(f"== {name} stage: build {build}, " + ", ".join(f"{k} {v}" for k, v in rcs.items()) + f", {secs} s -> {out}")
sys.exit(0 if int(build) == 0 and all(v <= 0 for v in rcs.values()) else 1)
PY
}
