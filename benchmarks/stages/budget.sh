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
