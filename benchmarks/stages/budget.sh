# Sourced by common.sh (and tests/test_gpu_scripts.py): one device call is 600 s, so a stage keeps inside
# LQE_BUDGET_S seconds (default 570) from the moment this is sourced.
#   budget WANT   a step's timeout: WANT seconds, or what is left of the budget (5 s kept for the stage's summary)
#   skip NAME     true when NAME is in LQE_SKIP, or when under 30 s of the budget are left (then it says so)
T_END=$(( $(date +%s) + ${LQE_BUDGET_S:-570} ))
budget() {
  local left=$(( T_END - $(date +%s) - 5 )); (( left < $1 )) && echo "$(( left > 1 ? left : 1 ))" || echo "$1"
}
skip() {
  [[ " ${LQE_SKIP:-} " == *" $1 "* ]] && return 0
  if (( T_END - $(date +%s) < 30 )); then echo "-- $1: skipped (time budget LQE_BUDGET_S)"; return 0; fi
  return 1
}
# out_and_logs: OUTDIR (results: $OUT, or benchmarks/results without one) and LOGDIR (logs, JUnit XML, records).
# A device call brings back at most 8 files of $OUT, no more than 2 folders down (/work/.library/device/README.md):
# with $OUT set the logs live outside it and come back packed as the one file $OUT/logs.tgz (pack_logs, after every
# step and at exit, so a call cut short still brings back what it logged), and $OUT holds only a few result JSONs.
out_and_logs() {
  OUTDIR="${OUT:-benchmarks/results}"; mkdir -p "$OUTDIR"
  if [[ -n "${OUT:-}" ]]; then
    LOGDIR="${LQE_LOGDIR:-$(mktemp -d "${TMPDIR:-/tmp}/lqe-gpu-logs.XXXXXX")}"
    trap pack_logs EXIT
  else
    LOGDIR="$OUTDIR/logs"
  fi
  mkdir -p "$LOGDIR"
}
pack_logs() {  # $LOGDIR -> $OUT/logs.tgz (written beside, then moved in: never half a file in $OUT)
  [[ -n "${OUT:-}" && -d "${LOGDIR:-}" && "$LOGDIR" != "$OUTDIR"/* ]] || return 0
  tar czf "$LOGDIR.tgz" -C "$LOGDIR" . 2>/dev/null && mv -f "$LOGDIR.tgz" "$OUTDIR/logs.tgz"
}
# gpu_pytest NAME WANT ARGS...: `python -m pytest -m gpu ARGS`, cut at WANT seconds or what is left of the budget
# (SIGINT first: pytest still writes its JUnit XML), output in $LOGDIR/NAME.txt, JUnit XML in $LOGDIR/NAME.xml.
# A kernel that faults on the device loses the process's CUDA context and would fail every test after it:
# tests/device_faults.py then stops pytest after the culprit and names it in $LOGDIR/NAME.fault, and the tests not
# reached go on in a fresh process (JUnit XML $LOGDIR/NAME.r1.xml, ...) while the time lasts. A process that ends
# inside a test (a crash, or a test past LQE_TEST_HANG_S seconds, default 120: a hung kernel) is named there too and
# handled the same way. Returns pytest's status, at least 1 after a fault.
gpu_pytest() {
  local name=$1 want=$2; shift 2
  local base="$LOGDIR/$name" args=("$@") all=("$@") try=0 rc faults=0 t_stop left culprit xml first
  rm -f "$base".xml "$base".r*.xml "$base".done "$base".fault "$base".dropped
  : > "$base.txt"
  t_stop=$(( $(date +%s) + $(budget "$want") ))
  while :; do
    left=$(( t_stop - $(date +%s) )) xml="$base$( (( try )) && echo ".r$try").xml"
    first=$( [[ -f "$base.done" ]] && wc -l < "$base.done" || echo 0 )  # this attempt's records start after it
    LQE_TESTS_DONE_FILE="$base.done" LQE_CUDA_FAULT_FILE="$base.fault" LQE_TEST_HANG_S="${LQE_TEST_HANG_S:-120}" \
      timeout -s INT -k 20 "$(budget "$(( left > 1 ? left : 1 ))")" python -m pytest -m gpu -q -p no:cacheprovider \
      --junitxml="$xml" "${args[@]}" >> "$base.txt" 2>&1
    rc=$?
    # a test started and never ended, and not the time limit's doing (124; 137 after -k): the process died in it
    culprit=$(awk -F'\t' '$1 == "start" {s[$2] = 1} $1 == "end" {delete s[$2]} END {for (t in s) print t}' \
      "$base.done" 2>/dev/null | grep -vxFf <(cut -f1 "$base.fault" 2>/dev/null) | head -1)
    if [[ -n "$culprit" && $rc -ne 124 && $rc -ne 137 ]]; then
      printf '%s\tthe pytest process ended in this test (exit %s: a crash, or over LQE_TEST_HANG_S seconds: see %s);' \
        "$culprit" "$rc" "$base.txt" >> "$base.fault"
      printf ' its JUnit XML was not written\n' >> "$base.fault"
      # the XML it did not write, from its records: the tests it ran, and the culprit failed
      [[ -f "$xml" ]] || python - "$base.done" "$first" "$culprit" "$xml" <<'PY'
import sys
from xml.sax.saxutils import quoteattr
done, first, culprit, xml = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
ended = [line.rstrip("\n").split("\t") for line in open(done).readlines()[first:] if line.startswith("end\t")]
cases = []
for nodeid, outcome in [(f[1], f[2] if len(f) > 2 else "passed") for f in ended] + [(culprit, "failed")]:
    cls, _, name = nodeid.rpartition("::")
    body = {"failed": "<failure message='see the fault file'/>", "skipped": "<skipped/>"}.get(outcome, "")
    cases.append(f"<testcase classname={quoteattr(cls)} name={quoteattr(name)}>{body}</testcase>")
open(xml, "w").write("<testsuite>" + "".join(cases) + "</testsuite>\n")
PY
    fi
    local now_faults; now_faults=$( [[ -f "$base.fault" ]] && wc -l < "$base.fault" || echo 0 )
    (( now_faults > faults )) || break
    faults=$now_faults
    echo "-- $name: $(tail -1 "$base.fault")" >> "$base.txt"
    # the tests not reached: the arguments (when they are test ids) or what they collect, less every test started
    if printf '%s\n' "${all[@]}" | grep -qv '::'; then
      mapfile -t args < <(python -m pytest -m gpu --collect-only -q -p no:cacheprovider "${all[@]}" 2>/dev/null | grep '::')
    else
      args=("${all[@]}")
    fi
    mapfile -t args < <(printf '%s\n' "${args[@]}" | grep -vxFf <(awk -F'\t' '$1 == "start" {print $2}' "$base.done" 2>/dev/null) | awk NF)
    # A file whose tests lost the context LQE_FAULTS_PER_FILE times (default 3) has a kernel that faults on every
    # call: each fresh process costs its imports and fixtures (the H200 gate at 257cdec lost 314 tests' time to 54
    # restarts in one file pair), so that file's tests not reached are dropped (listed in $base.dropped, counted as
    # not run) and the group goes on with the other files.
    local cap=${LQE_FAULTS_PER_FILE:-3} bad
    mapfile -t bad < <(cut -f1 "$base.fault" | sed 's/::.*//' | sort | uniq -c | awk -v c="$cap" '$1 >= c {print $2}')
    if (( ${#bad[@]} > 0 )); then
      printf '%s\n' "${args[@]}" | grep -F -f <(printf '%s::\n' "${bad[@]}") \
        | sed "s/\$/\tnot run: its file faulted $cap times/" >> "$base.dropped"
      mapfile -t args < <(printf '%s\n' "${args[@]}" | grep -vF -f <(printf '%s::\n' "${bad[@]}") | awk NF)
      echo "-- $name: $(wc -l < "$base.dropped") tests of ${bad[*]} dropped after $cap faults each" >> "$base.txt"
    fi
    (( ${#args[@]} > 0 )) || break
    if (( t_stop - $(date +%s) < 30 )); then
      echo "-- $name: ${#args[@]} tests not run after the fault (time budget)" >> "$base.txt"; break
    fi
    try=$(( try + 1 ))
    echo "-- $name: going on in a fresh process with the ${#args[@]} tests not reached" >> "$base.txt"
  done
  (( faults > 0 && rc == 0 )) && rc=1
  return $rc
}
