#!/usr/bin/env bash
# The one command for a fresh GPU machine (no pip install, no internet):
#   1. build the lqe CUDA kernels for this GPU only,
#   2. run every GPU test (pytest -m gpu tests/gpu: every gpu-marked test lives there, as tests/test_layering.py
#      checks; the CPU tests need packages a GPU machine may lack, e.g. openai),
#   3. the kernel benchmark (benchmarks/kernels.py),
#   4. the end-to-end smoke benchmark (benchmarks/e2e_gpu.py --quick), each row compared with the committed one
#      (benchmarks/compare_e2e.py; a row under 0.95x makes the stage "exit 3"),
#   5. the calibration benchmark (benchmarks/calibration_gpu.py: GPTQ W4 g128 on the llama3-8b shape with 4 of its
#      32 layers, 128 x 2048 random tokens; the per-layer time is extrapolated to 32 layers in the JSON),
# then write benchmarks/results/gpu-<gpu>.json = {commit, device, torch, tests: {passed, failed, skipped,
# not_run, failed_ids}, build_seconds, stages} beside kernels-<gpu>.json, e2e-<gpu>.json and calibration-<gpu>.json. A failing stage is reported
# and the next one still runs; the exit status is non-zero when any stage failed or any test failed.
#
#   bash benchmarks/run_gpu.sh                 # results in benchmarks/results/
#   OUT=/some/dir bash benchmarks/run_gpu.sh   # results (and logs) in /some/dir
#   LQE_COMMIT=abc1234 ...                     # the commit measured, where the tree has no .git
#   bash benchmarks/run_gpu.sh --w4a16         # one focused stage instead: benchmarks/stages/w4a16.sh (build, that
#                                              # issue's GPU tests and its sweep, JSON; each under 8 minutes)
# Stage time limits (seconds): LQE_TEST_TIMEOUT (360), LQE_KERNELS_TIMEOUT (220: what a 560 s budget leaves after
# the build and a whole test stage; the kernel rows grew to ~25 per shape and M), LQE_E2E_TIMEOUT (240),
# LQE_CALIB_TIMEOUT (300; LQE_CALIB_ARGS replaces "--layers 4 --methods gptq-sym").
# LQE_BUDGET_S (560): the whole run's time budget; stages are cut / skipped to keep inside it (one device call: 600 s).
# LQE_SKIP="kernels e2e calib" skips stages by name (reported as "skipped"); LQE_TESTS="tests/gpu/x.py" narrows stage 2.
# The stage limits add up to more than one call, so the gate is two device calls at the same commit; a stage skipped
# by name keeps what the earlier call wrote in gpu-<gpu>.json (tests included), so the file covers the whole gate:
#   LQE_SKIP="e2e calib" bash benchmarks/run_gpu.sh      # build, every GPU test, kernels
#   LQE_SKIP="tests kernels" bash benchmarks/run_gpu.sh  # e2e --quick (each row compared with the committed one by
#                                                          # benchmarks/compare_e2e.py: under 0.95x fails), calibration
# Issue 27's 32-layer calibration rows are further calls of benchmarks/calibration_gpu.py (see its docstring).
# A kernel that faults on the device (illegal address, trap) loses its process's CUDA context, and everything after
# it in that process would fail: a test group stops after the culprit and goes on with the rest in a fresh process
# (budget.sh gpu_pytest, tests/device_faults.py; the faults are listed in gpu-<gpu>.json under tests.device_faults),
# and kernels.py / e2e_gpu.py save their rows, record the fault (device_faults in their JSON) and go on in a fresh
# process without the faulting kernel / variant (benchmarks/common.py restart; a hung test or kernel row too:
# LQE_TEST_HANG_S, default 120, and LQE_BENCH_HANG_S, default 90).
set -uo pipefail
cd "$(dirname "$0")/.."
if [[ "${1:-}" == --* ]]; then  # a focused stage: benchmarks/stages/<name>.sh
  stage="benchmarks/stages/${1#--}.sh"
  if [[ ! -f "$stage" || "${1#--}" == common || "${1#--}" == budget ]]; then
    echo "run_gpu.sh: no stage '${1#--}'; stages: $(ls benchmarks/stages | grep -v -e common.sh -e budget.sh | sed 's/\.sh$//' | tr '\n' ' ')" >&2
    exit 2
  fi
  shift; exec bash "$stage" "$@"
fi
LQE_BUDGET_S=${LQE_BUDGET_S:-560} source benchmarks/stages/budget.sh
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
out_and_logs  # budget.sh: results in $OUTDIR, logs in $LOGDIR (with $OUT: packed into $OUT/logs.tgz)
declare -A stage_rc=([build]=1 [tests]=1 [kernels]=1 [e2e]=1 [calib]=1)

if ! python -c "import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "run_gpu.sh: no CUDA GPU visible (torch.cuda.is_available() is False); nothing was run." >&2
  exit 2
fi
SLUG=$(python -c "import re,torch;print(re.sub(r'[^a-z0-9]+','-',torch.cuda.get_device_name(0).lower()).strip('-'))")
if [[ -z "${LQE_CUDA_ARCHS:-}" ]]; then  # build only for this GPU (sm_90a on Hopper: wgmma)
  LQE_CUDA_ARCHS=$(python -c "import torch;c=torch.cuda.get_device_capability();print(f'{c[0]}{c[1]}'+('a' if c[0]==9 else ''))")
  export LQE_CUDA_ARCHS
fi

echo "== [1/5] build the CUDA kernels ($LQE_CUDA_ARCHS)"
t0=$(date +%s)
timeout "$(budget "${LQE_BUILD_TIMEOUT:-300}")" python -c "import logging,sys;logging.basicConfig(level=logging.INFO);import lqe.kernels as k;ok=k.available();print('lqe kernels available:',ok,k.unavailable_reason() or '');sys.exit(0 if ok else 1)" \
  2>&1 | tee "$LOGDIR/build.log"
stage_rc[build]=${PIPESTATUS[0]}
BUILD_S=$(( $(date +%s) - t0 ))
pack_logs

# The whole run keeps inside LQE_BUDGET_S seconds (default 560 from the start: one device call is limited to 600 s,
# and the summary JSON must still be written): each stage's timeout is cut to what is left (budget.sh), and a stage
# with under 30 s left is skipped and reported as "skipped (time budget)".
skip_stage() {
  if [[ " ${LQE_SKIP:-} " == *" $1 "* ]]; then stage_rc[$1]=-1; return 0; fi
  if skip "$1"; then stage_rc[$1]=-2; return 0; fi
  return 1
}

echo "== [2/5] GPU tests (${LQE_TEST_JOBS:-8} pytest processes side by side)"
if ! skip_stage tests; then
  # the test ids split into LQE_TEST_JOBS groups, run concurrently on the one GPU (the tests
  # are latency-bound and small; nothing in them is timed), each group writing its own JUnit XML
  rm -f "$LOGDIR"/gpu-tests-*.xml "$LOGDIR"/gpu-tests-*.fault "$LOGDIR"/gpu-tests-*.dropped
  # test ids grouped by file (a module's fixtures, e.g. a model built once, are built in one process, not in every
  # group), a file with more than its share of the tests cut into consecutive chunks, the chunks dealt largest first
  # to the group with the fewest tests so far
  python -m pytest -m gpu ${LQE_TESTS:-tests/gpu} --collect-only -q -p no:cacheprovider 2>/dev/null \
    | grep "::" > "$LOGDIR/gpu-test-ids.txt"
  mapfile -t groups < <(python - "$LOGDIR/gpu-test-ids.txt" "${LQE_TEST_JOBS:-8}" < benchmarks/stages/test_groups.py)
  pids=()
  for i in "${!groups[@]}"; do
    # SIGINT first: pytest stops as on Ctrl-C and still writes its JUnit XML (the summary then counts what ran)
    # (gpu_pytest, benchmarks/stages/budget.sh: a test that loses the CUDA context stops its group, which goes on
    # with the tests it did not reach in a fresh process, so one faulting kernel costs one test, not a group)
    gpu_pytest "gpu-tests-$i" "${LQE_TEST_TIMEOUT:-360}" ${groups[$i]} &
    pids+=($!)
  done
  stage_rc[tests]=0
  for i in "${!pids[@]}"; do
    wait "${pids[$i]}"; rc=$?
    echo "-- group $i ($(wc -w <<< "${groups[$i]}") tests): exit $rc"; tail -15 "$LOGDIR/gpu-tests-$i.txt"
    [[ -f "$LOGDIR/gpu-tests-$i.fault" ]] && { echo "-- device faults (test, error):"; cat "$LOGDIR/gpu-tests-$i.fault"; }
    (( rc != 0 )) && stage_rc[tests]=$rc
  done
  pack_logs
fi

echo "== [3/5] kernel benchmark"
if ! skip_stage kernels; then
  timeout "$(budget "${LQE_KERNELS_TIMEOUT:-220}")" python benchmarks/kernels.py --m ${LQE_KERNEL_MS:-1 4 16 64 256 1024} --out "$OUTDIR/kernels-$SLUG.json" 2>&1 \
    | tee "$LOGDIR/kernels.txt" | tail -60
  stage_rc[kernels]=${PIPESTATUS[0]}
  pack_logs
fi

echo "== [4/5] end-to-end benchmark (--quick), then each row against the committed one (>= 0.95x: issue 27)"
if ! skip_stage e2e; then
  # the rows as they were before this run (the device copy of the tree may have no .git to read them back from)
  committed="benchmarks/results/e2e-$SLUG.json"
  [[ -f "$committed" ]] && cp "$committed" "$LOGDIR/e2e-committed.json"
  timeout "$(budget "${LQE_E2E_TIMEOUT:-240}")" python benchmarks/e2e_gpu.py --quick --out-dir "$OUTDIR" ${LQE_E2E_ARGS:-} 2>&1 \
    | tee "$LOGDIR/e2e.txt" | grep -v "^\[lqe" | tail -30
  stage_rc[e2e]=${PIPESTATUS[0]}
  # every row asked for against the committed one, also after a failed or cut run (what it did measure is compared;
  # --requested: a requested row that failed, is absent or was only carried over fails too)
  if [[ -f "$OUTDIR/e2e-$SLUG.json" && -f "$LOGDIR/e2e-committed.json" ]]; then
    python benchmarks/compare_e2e.py "$OUTDIR/e2e-$SLUG.json" --old "$LOGDIR/e2e-committed.json" --requested 2>&1 \
      | tee "$LOGDIR/e2e-compare.txt"
    (( PIPESTATUS[0] == 0 || stage_rc[e2e] != 0 )) || stage_rc[e2e]=3  # a row under 0.95x the committed one
  fi
  pack_logs
fi

echo "== [5/5] calibration benchmark (llama3-8b shape, 4 layers, 128 x 2048 tokens; extrapolated to 32 layers)"
if ! skip_stage calib; then
  # the script's own deadline (LQE_BUDGET_S: a clean pause between layers, a partial row) inside the timeout
  calib_s=$(budget "${LQE_CALIB_TIMEOUT:-300}")
  LQE_BUDGET_S=$calib_s timeout "$(budget "$calib_s")" python benchmarks/calibration_gpu.py --out "$OUTDIR/calibration-$SLUG.json" \
    ${LQE_CALIB_ARGS:---layers 4 --methods gptq-sym} 2>&1 | tee "$LOGDIR/calibration.txt" | grep "^\[\|^wrote" | tail -20
  stage_rc[calib]=${PIPESTATUS[0]}
  pack_logs
fi

python - "$OUTDIR/gpu-$SLUG.json" "$LOGDIR" "$BUILD_S" "${stage_rc[build]}" "${stage_rc[tests]}" \
  "${stage_rc[kernels]}" "${stage_rc[e2e]}" "${stage_rc[calib]}" <<'EOF'
import json, os, subprocess, sys
import xml.etree.ElementTree as ET

import torch

import glob

out, logdir, build_s = sys.argv[1], sys.argv[2], float(sys.argv[3])
rcs = dict(zip(("build", "tests", "kernels", "e2e", "calib"), map(int, sys.argv[4:9])))
tests = {"passed": 0, "failed": 0, "skipped": 0, "not_run": 0, "failed_ids": []}
for xml_path in sorted(glob.glob(os.path.join(logdir, "gpu-tests-*.xml"))):
    for case in ET.parse(xml_path).getroot().iter("testcase"):
        cid = f"{case.get('classname')}::{case.get('name')}"
        if case.find("failure") is not None or case.find("error") is not None:
            tests["failed"] += 1
            tests["failed_ids"].append(cid)
        elif case.find("skipped") is not None:
            tests["skipped"] += 1
        else:
            tests["passed"] += 1
for fault_path in sorted(glob.glob(os.path.join(logdir, "gpu-tests-*.fault"))):  # tests/device_faults.py
    tests.setdefault("device_faults", []).extend(line.rstrip("\n") for line in open(fault_path) if line.strip())
for dropped_path in sorted(glob.glob(os.path.join(logdir, "gpu-tests-*.dropped"))):  # budget.sh: a file's cap
    for line in open(dropped_path):
        if line.strip():
            f = line.split("::", 1)[0]
            tests.setdefault("dropped_after_faults", {})[f] = tests.get("dropped_after_faults", {}).get(f, 0) + 1
ids_path = os.path.join(logdir, "gpu-test-ids.txt")
if rcs["tests"] != -1 and os.path.exists(ids_path):  # collected but never reported: a group cut by its timeout
    collected = sum(1 for line in open(ids_path) if line.strip())
    tests["not_run"] = max(0, collected - tests["passed"] - tests["failed"] - tests["skipped"])
commit = os.environ.get("LQE_COMMIT") or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                                        text=True).stdout.strip() or None
report = {"commit": commit, "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
          "cuda": torch.version.cuda, "build_seconds": build_s, "tests": tests,
          "stages": {k: ("ok" if v == 0 else "skipped" if v == -1 else "skipped (time budget)" if v == -2 else f"exit {v}" + (" (timed out)" if v in (124, 137) else ""))
                     for k, v in rcs.items()}}
try:
    import triton
    report["triton"] = triton.__version__
except ImportError:
    pass
# The gate in several device calls (LQE_SKIP names what an earlier call ran): a stage skipped by name keeps the
# result an earlier call at the same commit wrote, tests included, so the file ends up describing the whole gate.
# (a device call starts with an empty $OUT: the earlier call's file then comes from the tree, where the session put
# what that call brought back: LQE_PREV_RESULTS, default benchmarks/results)
prev = None
for path in (out, os.path.join(os.environ.get("LQE_PREV_RESULTS", "benchmarks/results"), os.path.basename(out))):
    try:
        doc = json.load(open(path))
    except (OSError, ValueError):
        continue
    if doc.get("commit") == commit and doc.get("device") == report["device"]:
        prev = doc
        break
if prev:
    for k, v in rcs.items():
        if v == -1 and k in prev.get("stages", {}):
            report["stages"][k] = prev["stages"][k]
    if rcs["tests"] == -1 and "tests" in prev:
        report["tests"] = tests = prev["tests"]
    if rcs["build"] == 0 and "build_seconds" in prev:
        report["build_seconds"] = max(build_s, prev["build_seconds"])
with open(out, "w") as f:
    json.dump(report, f, indent=1)
print(f"== summary ({out}): tests {tests['passed']} passed, {tests['failed']} failed, {tests['skipped']} skipped, "
      f"{tests['not_run']} not run; "
      f"build {build_s:.0f}s; stages {report['stages']}")
for cid in tests["failed_ids"][:30]:
    print("   FAILED", cid)
for line in tests.get("device_faults", []):
    print("   CUDA CONTEXT LOST (the group went on in a fresh process):", line)
for f, n in tests.get("dropped_after_faults", {}).items():
    print(f"   NOT RUN: {n} tests of {f} (the file faulted LQE_FAULTS_PER_FILE times; its kernel faults on every call)")
sys.exit(1 if tests["failed"] or tests["not_run"] or any(v > 0 or v == -2 for v in rcs.values()) else 0)
EOF
exit $?
