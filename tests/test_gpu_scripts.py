"""The GPU device scripts (benchmarks/run_gpu.sh and benchmarks/stages/*.sh), checked on the CPU: a GPU session has
30 minutes and one call is 600 s, so a script that breaks on a typo, names a flag or a file that does not exist, or
runs past the call's limit costs a whole iteration there."""
import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STAGES = sorted((ROOT / "benchmarks" / "stages").glob("*.sh"))
SCRIPTS = [ROOT / "benchmarks" / "run_gpu.sh", ROOT / "benchmarks" / "w4a16_ptxas.sh", *STAGES]


def _commands(path: Path) -> list[str]:
    """The script's lines with backslash continuations joined."""
    return path.read_text().replace("\\\n", " ").splitlines()


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_parses(script):
    subprocess.run(["bash", "-n", str(script)], check=True)


def test_budget_cuts_timeouts_and_skips_steps():
    def run(body: str, budget_s: int, skip: str = "") -> list[str]:
        env = {**os.environ, "LQE_BUDGET_S": str(budget_s), "LQE_SKIP": skip}
        out = subprocess.run(["bash", "-c", f"source benchmarks/stages/budget.sh; {body}"], cwd=ROOT, env=env,
                             capture_output=True, text=True, check=True)
        return out.stdout.split()

    assert run("budget 100", 570) == ["100"]  # a step's own limit when the budget has room
    assert int(run("budget 900", 570)[0]) in (564, 565)  # else what is left, 5 s kept for the summary
    assert run("budget 100", 3) == ["1"]  # never 0 or negative (timeout 0 would mean no limit)
    assert run("skip tests && echo yes || echo no", 570) == ["no"]
    assert run("skip tests && echo yes || echo no", 570, skip="kernels tests") == ["yes"]
    assert run("skip tests && echo yes || echo no", 20)[-1] == "yes"  # under 30 s left: skipped, and it says why


@pytest.mark.parametrize("script", [ROOT / "benchmarks" / "run_gpu.sh", *STAGES], ids=lambda p: p.name)
def test_every_timeout_is_cut_to_the_budget(script):
    raw = [line.strip() for line in _commands(script) if re.search(r"\btimeout\s", line)
           and not line.lstrip().startswith("#") and not re.search(r'\btimeout (-\w \w+ )*"\$\(budget ', line)]
    assert not raw, f"{script.name}: a timeout outside the stage budget (use \"$(budget N)\"): {raw}"


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_named_files_exist(script):
    text = "\n".join(line for line in script.read_text().splitlines() if not line.lstrip().startswith("#"))
    named = set(re.findall(r"\b((?:tests|benchmarks)/[\w/.-]+\.(?:py|sh))", text))
    missing = sorted(p for p in named if not (ROOT / p).exists())
    assert not missing, f"{script.name} names files that do not exist: {missing}"


def _undefined_flags(lines: list[str]) -> list[str]:
    """The --flags, shapes, variants and methods that ``python benchmarks/X.py ...`` in LINES passes and X.py does
    not define."""
    bad = []
    for line in lines:
        for m in re.finditer(r"python (benchmarks/\w+\.py)([^|;>&]*)", line):
            source = (ROOT / m.group(1)).read_text()
            for flag in re.findall(r"(?<![\w-])(--[a-z][\w-]*)", m.group(2)):
                if f'"{flag}"' not in source:
                    bad.append(f"{m.group(1)} {flag}")
            for flag, names in re.findall(r"(--variants|--methods|--shape|--shapes) ([\w.,+-]+)", m.group(2)):
                bad += [f"{m.group(1)} {flag} {n}" for n in names.split(",") if f'"{n}"' not in source
                        and not re.fullmatch(r"\d+x\d+", n)]  # kernels.py --shapes KxN
    return bad


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_python_flags_exist(script):
    """Every --flag a script passes to ``python benchmarks/X.py`` is one X.py's argument parser defines, and every
    shape / variant / method it names is one X.py knows."""
    bad = _undefined_flags(_commands(script))
    assert not bad, f"{script.name} passes flags the scripts do not define: {bad}"


STUB_PYTHON = r"""#!/usr/bin/env bash
# A GPU machine's `python`, for a dry run of the device scripts on the CPU: every call is logged; the checks for a
# GPU pass, the build succeeds, pytest passes what it is given (JUnit XML written), benchmarks exit 0; the scripts'
# own summary code (python - <<EOF) runs on the real interpreter, with torch.cuda naming a stub device.
printf '%s\n' "$*" >> "$LQE_STUB_LOG"
if [[ "$1" == - ]]; then exec "$LQE_REAL_PY" "$@"; fi
if [[ "$1" == -c ]]; then
  [[ "$2" == *get_device_name* ]] && echo stub-gpu
  [[ "$2" == *build_random_model* ]] && echo /tmp/lqe-stub-model
  exit 0
fi
if [[ "$1 $2" == "-m pytest" ]]; then
  all=(); for t in ${LQE_STUB_TESTS:-test_a test_b}; do  # "name" in test_stub.py, or "file.py::name"
    [[ "$t" == *::* ]] && all+=("tests/gpu/$t") || all+=("tests/gpu/test_stub.py::$t"); done
  if [[ "$*" == *--collect-only* ]]; then printf '%s\n' "${all[@]}"; exit 0; fi
  [[ -n "${LQE_STUB_CUT:-}" && "$*" == *"$LQE_STUB_CUT"* ]] && exit 124  # a group killed before its XML
  ids=(); xml=/dev/null
  for a in "$@"; do [[ " ${all[*]} " == *" $a "* ]] && ids+=("$a"); [[ "$a" == --junitxml=* ]] && xml=${a#--junitxml=}; done
  (( ${#ids[@]} )) || ids=("${all[@]}")  # files (or other ids) given: they hold every stub test
  cases=""; rc=0
  for id in "${ids[@]}"; do  # tests/device_faults.py's records; LQE_STUB_FAULT's test loses the CUDA context,
    # LQE_STUB_CRASH's ends the process inside it (no end record, no XML: a crash, or the hang watchdog)
    [[ -n "${LQE_TESTS_DONE_FILE:-}" ]] && printf 'start\t%s\n' "$id" >> "$LQE_TESTS_DONE_FILE"
    [[ -n "${LQE_STUB_CRASH:-}" && "$id" == *"::$LQE_STUB_CRASH" ]] && exit 1
    [[ -n "${LQE_TESTS_DONE_FILE:-}" ]] && printf 'end\t%s\tpassed\n' "$id" >> "$LQE_TESTS_DONE_FILE"
    if [[ " ${LQE_STUB_FAULT:-} " == *" ${id##*::} "* ]]; then  # (LQE_STUB_FAULT: names, space-separated)
      cases+="<testcase classname=\"stub\" name=\"${id##*::}\"><failure/></testcase>"
      printf '%s\tAcceleratorError: CUDA error: an illegal memory access was encountered\n' "$id" >> "$LQE_CUDA_FAULT_FILE"
      rc=2; break
    fi
    cases+="<testcase classname=\"stub\" name=\"${id##*::}\"/>"
  done
  echo "<testsuite>$cases</testsuite>" > "$xml"
  echo "${#ids[@]} run"; exit $rc
fi
exit 0
"""
# torch.cuda names the stub device, patched when a script imports torch (not at every start: importing torch takes
# 2-4 s on a 2-core machine, and most of the scripts' `python -` summaries never do).
SITECUSTOMIZE = """
import importlib.abc, importlib.util, sys

class _StubDeviceName(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != "torch":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec("torch")
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            module.cuda.get_device_name = lambda *a, **k: "Stub GPU"
        spec.loader.exec_module = exec_module
        return spec

sys.meta_path.insert(0, _StubDeviceName())
"""


def _dry_run(tmp_path: Path, args: list[str], *, command: str | None = None,
             **env) -> tuple[subprocess.CompletedProcess, list[str], Path]:
    """Run ``bash benchmarks/run_gpu.sh ARGS`` (or the shell COMMAND, as a device call would) against the stub
    python; (process, logged python calls, OUT)."""
    import sys

    bin_dir, site, out = tmp_path / "bin", tmp_path / "site", tmp_path / "out"
    for d in (bin_dir, site):
        d.mkdir()
    (bin_dir / "python").write_text(STUB_PYTHON)
    (bin_dir / "python").chmod(0o755)
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    log = tmp_path / "calls.log"
    full_env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHONPATH": str(site), "OUT": str(out),
                "LQE_STUB_LOG": str(log), "LQE_REAL_PY": sys.executable, "LQE_CUDA_ARCHS": "90a", **env}
    argv = ["bash", "-c", command] if command is not None else ["bash", "benchmarks/run_gpu.sh", *args]
    proc = subprocess.run(argv, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=120)
    calls = log.read_text().splitlines() if log.exists() else []
    return proc, calls, out


def _packed_logs(out: Path) -> set[str]:
    """The names of the files in $OUT/logs.tgz."""
    import tarfile

    with tarfile.open(out / "logs.tgz") as tar:
        return {Path(m.name).name for m in tar.getmembers() if m.isfile()}


def _assert_comes_back(out: Path) -> None:
    """What a device call brings back of $OUT: at most 8 files, no more than 2 folders down, each named in
    letters, digits, '.', '_' and '-' (/work/.library/device/README.md, Limits)."""
    files = [p.relative_to(out) for p in out.rglob("*") if p.is_file()]
    assert len(files) <= 8, f"{len(files)} files in $OUT, at most 8 come back: {sorted(map(str, files))}"
    for f in files:
        assert len(f.parts) <= 3 and all(re.fullmatch(r"[\w.-]+", part) for part in f.parts), f


def _ran(calls: list[str], *words: str) -> bool:
    return any(all(w in c for w in words) for c in calls)


# stage -> (LQE_SKIP, python calls the stage must make: words each call contains, files it must leave in OUT)
DRY_RUNS = {
    "w4a16": ("", [("-m pytest", "tests/gpu/test_gemm_w4a16_mma.py", "tests/gpu/test_w4a16_mma_models.py"),
                   ("benchmarks/kernels.py", "--w4a16", "kernels-w4a16-stub-gpu.json"),
                   ("benchmarks/e2e_gpu.py", "--variants bf16,w4a16 ")],
              ["w4a16-stage-stub-gpu.json"]),
    "w8a8": ("", [("-m pytest", "tests/gpu/test_fused_act_quant.py"), ("-m pytest", "tests/gpu/test_model_matrix.py"),
                  ("benchmarks/kernels.py", "--rows w8a8,fp8", "kernels-stub-gpu.json"),
                  ("benchmarks/e2e_gpu.py", "--variants bf16,w8a8-online,fp8")], []),
    "engine": ("", [("-m pytest", "tests/gpu/test_piecewise_gpu.py"), ("benchmarks/step_host_time.py", "--device cuda"),
                    ("benchmarks/prefill_attention.py",), ("benchmarks/e2e_gpu.py", "qwen2.5-0.5b", "FULL_AND_PIECEWISE"),
                    ("benchmarks/serving.py", "/tmp/lqe-stub-model"), ("benchmarks/e2e_gpu.py", "llama3-8b")], []),
    "pdl": ("", [("-m pytest", "tests/gpu/test_gemm_wna16.py::test_pdl_gives_the_same_outputs",
                  "tests/gpu/test_pdl_models.py"),
                 ("benchmarks/kernels.py", "--w4a16", "--m 1 4 16", "kernels-pdl-stub-gpu.json"),
                 ("benchmarks/e2e_gpu.py", "smollm2-135m",
                  "--variants bf16-nopdl,bf16,w4a16,w4a16-nopdl,w8a8,w8a8-nopdl")],
            ["pdl-stage-stub-gpu.json"]),
    "kvcache": ("", [("-m pytest", "tests/gpu/test_triton_attention_fp8.py"),
                     ("benchmarks/kv_cache_gpu.py", "kvcache-stub-gpu.json")], []),
}


@pytest.mark.parametrize("stage", sorted(DRY_RUNS))
def test_stage_dry_run(tmp_path, stage):
    """Each focused stage runs end to end on a stub GPU machine: no unset variable, no missing helper, every step
    reached (with the budget it has) and its files written under $OUT."""
    skip_steps, want_calls, want_files = DRY_RUNS[stage]
    proc, calls, out = _dry_run(tmp_path, [f"--{stage}"], LQE_SKIP=skip_steps)
    assert proc.returncode == 0, f"--{stage} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert "unbound variable" not in proc.stderr and "command not found" not in proc.stderr, proc.stderr
    for words in want_calls:
        assert _ran(calls, *words), f"--{stage} never ran python {' '.join(words)}; calls:\n" + "\n".join(calls)
    for name in want_files:
        assert (out / name).is_file(), f"--{stage} did not write {name} in $OUT"
    _assert_comes_back(out)
    assert _packed_logs(out), "the logs did not come back packed in $OUT/logs.tgz"


def test_stage_dry_run_skips_named_steps(tmp_path):
    proc, calls, _ = _dry_run(tmp_path, ["--w4a16"], LQE_SKIP="tests sweep")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not _ran(calls, "-m pytest") and not _ran(calls, "benchmarks/kernels.py")
    assert _ran(calls, "benchmarks/e2e_gpu.py", "llama3-8b")


def test_w4a16_stage_runs_the_wna16_sweep_when_asked(tmp_path):
    proc, calls, out = _dry_run(tmp_path, ["--w4a16"], LQE_SKIP="tests e2e", LQE_WNA16_SWEEP="1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _ran(calls, "benchmarks/kernels.py", "--wna16-sweep", "--m 16 32 64 128", "kernels-wna16-sweep-stub-gpu.json")
    assert _ran(calls, "benchmarks/kernels.py", "--w4a16")
    _assert_comes_back(out)
    (tmp_path / "off").mkdir()
    proc, calls, _ = _dry_run(tmp_path / "off", ["--w4a16"], LQE_SKIP="tests e2e")
    assert not _ran(calls, "--wna16-sweep")


def test_run_gpu_dry_run_writes_the_summary(tmp_path):
    """The whole gate (no stage argument): tests split into groups, every stage reached, gpu-<slug>.json written
    with the test counts read back from the groups' JUnit XML."""
    import json

    proc, calls, out = _dry_run(tmp_path, [])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for words in [("--collect-only",), ("benchmarks/kernels.py",), ("benchmarks/e2e_gpu.py", "--quick"),
                  ("benchmarks/calibration_gpu.py",)]:
        assert _ran(calls, *words), words
    summary = json.loads((out / "gpu-stub-gpu.json").read_text())
    assert summary["device"] == "Stub GPU"
    _assert_comes_back(out)
    assert {"build.log", "gpu-test-ids.txt", "gpu-tests-0.xml"} <= _packed_logs(out)
    assert summary["tests"]["passed"] == 2 and summary["tests"]["failed"] == 0
    assert all(v == "ok" for v in summary["stages"].values()), summary["stages"]


def test_run_gpu_counts_a_cut_test_group_as_not_run(tmp_path):
    """A test group killed by its timeout writes no JUnit XML: its tests are 'not run', and the gate fails."""
    import json

    proc, _, out = _dry_run(tmp_path, [], LQE_SKIP="kernels e2e calib", LQE_STUB_CUT="test_b")
    assert proc.returncode != 0
    summary = json.loads((out / "gpu-stub-gpu.json").read_text())
    assert summary["tests"]["passed"] == 1 and summary["tests"]["not_run"] == 1, summary["tests"]
    assert summary["stages"]["tests"] == "exit 124 (timed out)"


def test_run_gpu_in_two_calls_keeps_the_first_calls_results(tmp_path):
    """The gate in two calls: the second (tests and kernels skipped by name) keeps the first's test counts and
    stage results in gpu-<slug>.json instead of reporting them as skipped."""
    import json
    import shutil

    proc, _, out = _dry_run(tmp_path, [], LQE_SKIP="e2e calib")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    first = json.loads((out / "gpu-stub-gpu.json").read_text())
    assert first["stages"]["e2e"] == "skipped" and first["tests"]["passed"] == 2
    for d in ("bin", "site"):
        shutil.rmtree(tmp_path / d)
    (tmp_path / "calls.log").unlink()
    proc, calls, out = _dry_run(tmp_path, [], LQE_SKIP="tests kernels")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not _ran(calls, "-m pytest")
    both = json.loads((out / "gpu-stub-gpu.json").read_text())
    assert both["tests"] == first["tests"]
    assert all(v == "ok" for v in both["stages"].values()), both["stages"]


def test_run_gpu_goes_on_after_a_device_fault(tmp_path):
    """A test that loses the CUDA context (tests/device_faults.py stops its pytest and names it) costs that test:
    its group goes on with the tests it did not reach in a fresh process, and the summary names the fault."""
    import json

    proc, calls, out = _dry_run(tmp_path, [], LQE_SKIP="kernels e2e calib", LQE_TEST_JOBS="1",
                                LQE_STUB_TESTS="test_a test_b test_c", LQE_STUB_FAULT="test_a")
    assert proc.returncode != 0  # a fault is a failure
    summary = json.loads((out / "gpu-stub-gpu.json").read_text())
    assert summary["tests"]["passed"] == 2 and summary["tests"]["failed"] == 1, summary["tests"]
    assert summary["tests"]["not_run"] == 0
    assert [f.split("\t")[0] for f in summary["tests"]["device_faults"]] == ["tests/gpu/test_stub.py::test_a"]
    runs = [c for c in calls if c.startswith("-m pytest") and "--collect-only" not in c]
    assert len(runs) == 2 and "test_a" not in runs[1] and "test_b" in runs[1] and "test_c" in runs[1], runs
    assert "gpu-tests-0.r1.xml" in _packed_logs(out)
    assert "CUDA CONTEXT LOST" in proc.stdout


def test_a_file_that_keeps_faulting_is_dropped_after_the_cap(tmp_path):
    """Each fault costs a fresh process: after LQE_FAULTS_PER_FILE faults in one file (a kernel that faults on every
    call), that file's tests not reached are dropped, listed and counted as not run, and the other files still run."""
    import json

    proc, calls, out = _dry_run(tmp_path, [], LQE_SKIP="kernels e2e calib", LQE_TEST_JOBS="1",
                                LQE_FAULTS_PER_FILE="2", LQE_STUB_FAULT="test_a test_b test_c test_d",
                                LQE_STUB_TESTS="test_a test_b test_c test_d test_other.py::test_x")
    assert proc.returncode != 0
    tests = json.loads((out / "gpu-stub-gpu.json").read_text())["tests"]
    assert [f.split("\t")[0].rsplit("::", 1)[1] for f in tests["device_faults"]] == ["test_a", "test_b"], tests
    assert tests["dropped_after_faults"] == {"tests/gpu/test_stub.py": 2}, tests
    assert tests["passed"] == 1 and tests["failed"] == 2 and tests["not_run"] == 2, tests
    runs = [c for c in calls if c.startswith("-m pytest") and "--collect-only" not in c]
    assert len(runs) == 3 and runs[2].split()[-1] == "tests/gpu/test_other.py::test_x", runs
    assert "NOT RUN: 2 tests of tests/gpu/test_stub.py" in proc.stdout


def test_stage_tests_go_on_after_a_device_fault(tmp_path):
    """run_tests in a focused stage (test files as arguments): after a fault the tests not reached are collected
    again and run in a fresh process, less every test already started."""
    proc, calls, out = _dry_run(tmp_path, ["--w4a16"], LQE_SKIP="sweep e2e", LQE_STAGE_TEST_JOBS="1",
                                LQE_STUB_TESTS="test_a test_b test_c", LQE_STUB_FAULT="test_b")
    runs = [c for c in calls if c.startswith("-m pytest") and "--collect-only" not in c]
    assert len(runs) == 2, runs
    assert "test_gemm_w4a16_mma.py" in runs[0]
    assert "::test_c" in runs[1] and "::test_a" not in runs[1] and "::test_b" not in runs[1], runs[1]
    assert "device faults" in proc.stdout and "test_stub.py::test_b" in proc.stdout
    assert '"tests": 1' in (out / "w4a16-stage-stub-gpu.json").read_text()  # the rest passed; the fault fails it


def test_stage_tests_run_in_parallel_groups(tmp_path):
    """A stage's tests run in LQE_STAGE_TEST_JOBS groups side by side (ids grouped as the gate groups them), each
    with its own JUnit XML, every collected id run once; a group's failure fails the step."""
    import re as _re

    proc, calls, out = _dry_run(tmp_path, ["--w4a16"], LQE_SKIP="sweep e2e", LQE_STAGE_TEST_JOBS="3",
                                LQE_STUB_TESTS=" ".join(f"test_{i}" for i in range(9)))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    runs = [c for c in calls if c.startswith("-m pytest") and "--collect-only" not in c]
    assert len(runs) == 3, runs
    ran = sorted(t for r in runs for t in _re.findall(r"::(test_\d)", r))
    assert ran == [f"test_{i}" for i in range(9)]
    assert {"w4a16-0.xml", "w4a16-1.xml", "w4a16-2.xml"} <= _packed_logs(out)
    (tmp_path / "f").mkdir()
    proc, calls, out = _dry_run(tmp_path / "f", ["--w4a16"], LQE_SKIP="sweep e2e", LQE_STAGE_TEST_JOBS="3",
                                LQE_STUB_TESTS=" ".join(f"test_{i}" for i in range(9)), LQE_STUB_FAULT="test_4")
    assert '"tests": 0' not in (out / "w4a16-stage-stub-gpu.json").read_text()


def test_run_gpu_goes_on_after_a_process_ends_inside_a_test(tmp_path):
    """A pytest process that ends inside a test (a crash, or LQE_TEST_HANG_S: a hung kernel) writes no JUnit XML:
    the runner names the test, writes the XML from the process's records (what it ran, the culprit failed) and goes
    on with the tests not reached."""
    import json

    proc, calls, out = _dry_run(tmp_path, [], LQE_SKIP="kernels e2e calib", LQE_TEST_JOBS="1",
                                LQE_STUB_TESTS="test_a test_b test_c", LQE_STUB_CRASH="test_b")
    assert proc.returncode != 0
    summary = json.loads((out / "gpu-stub-gpu.json").read_text())
    assert summary["tests"]["passed"] == 2 and summary["tests"]["failed"] == 1, summary["tests"]
    assert summary["tests"]["not_run"] == 0
    assert summary["tests"]["failed_ids"] == ["tests/gpu/test_stub.py::test_b"]
    fault = summary["tests"]["device_faults"]
    assert len(fault) == 1 and fault[0].startswith("tests/gpu/test_stub.py::test_b\tthe pytest process ended"), fault
    runs = [c for c in calls if c.startswith("-m pytest") and "--collect-only" not in c]
    assert len(runs) == 2 and "::test_c" in runs[1] and "::test_b" not in runs[1] and "::test_a" not in runs[1]


def test_run_gpu_second_call_finds_the_first_calls_file_in_the_tree(tmp_path):
    """On the device every call starts with an empty $OUT: the second call of the gate reads the first call's
    gpu-<gpu>.json from the tree (LQE_PREV_RESULTS, default benchmarks/results), where the session put it, when it
    is of the same commit and device."""
    import json
    import shutil

    proc, _, out = _dry_run(tmp_path, [], LQE_SKIP="e2e calib", LQE_COMMIT="abc1234")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    tree = tmp_path / "tree-results"
    tree.mkdir()
    shutil.copy(out / "gpu-stub-gpu.json", tree / "gpu-stub-gpu.json")
    shutil.rmtree(out)
    for d in ("bin", "site"):
        shutil.rmtree(tmp_path / d)
    (tmp_path / "calls.log").unlink()
    proc, _, out = _dry_run(tmp_path, [], LQE_SKIP="tests kernels", LQE_COMMIT="abc1234",
                            LQE_PREV_RESULTS=str(tree))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    both = json.loads((out / "gpu-stub-gpu.json").read_text())
    assert both["tests"]["passed"] == 2 and all(v == "ok" for v in both["stages"].values()), both
    # another commit's file is not taken for this one's
    for d in ("bin", "site"):
        shutil.rmtree(tmp_path / d)
    (tmp_path / "calls.log").unlink()
    shutil.rmtree(out)
    proc, _, out = _dry_run(tmp_path, [], LQE_SKIP="tests kernels", LQE_COMMIT="def5678",
                            LQE_PREV_RESULTS=str(tree))
    other = json.loads((out / "gpu-stub-gpu.json").read_text())
    assert other["stages"]["tests"] == "skipped" and proc.returncode == 0


def test_gpu_test_groups_keep_files_together_and_balance_cost():
    """The gate's test groups (benchmarks/stages/test_groups.py): a file's tests stay in one group unless the file
    costs more than a group's share (then consecutive chunks), model/engine tests weigh more, loads are balanced,
    and every id is run exactly once."""
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks" / "stages"))
    from test_groups import HEAVY_S, LIGHT_S, cost, test_groups

    ids = ([f"tests/gpu/test_gemm_a.py::t[{i}]" for i in range(300)] + [f"tests/gpu/test_b.py::t{i}" for i in range(40)]
           + [f"tests/gpu/test_model_x.py::t{i}" for i in range(30)] + ["tests/gpu/test_c.py::t"])
    groups = test_groups(ids, 4)
    assert sorted(sum(groups, [])) == sorted(ids)
    where = {f: {i for i, g in enumerate(groups) for t in g if t.startswith(f)} for f in
             ("tests/gpu/test_b.py", "tests/gpu/test_model_x.py", "tests/gpu/test_c.py")}
    assert len(where["tests/gpu/test_b.py"]) == 1 and len(where["tests/gpu/test_c.py"]) == 1, where
    assert len(where["tests/gpu/test_model_x.py"]) == 2  # 30 x 2.0 s over a share of 40.6 s: two chunks
    for name in ("test_gemm_a", "test_model_x"):  # files over their share: consecutive chunks
        for chunk in filter(None, ([t for t in g if name in t] for g in groups)):
            first = ids.index(chunk[0])
            assert chunk == ids[first:first + len(chunk)]
    assert cost(ids[-2]) == HEAVY_S and cost(ids[0]) == LIGHT_S  # files not measured: by name
    assert cost("tests/gpu/test_gemm_wna16.py::t[0]") == 0.25  # measured: its seconds per test
    loads = [sum(map(cost, g)) for g in groups]
    assert max(loads) - min(loads) <= max(map(cost, ids)) * 30, loads


RUNBOOK = ROOT / "benchmarks" / "GPU_RUNBOOK.md"


def _runbook_calls() -> list[str]:
    """The device calls benchmarks/GPU_RUNBOOK.md lists: its ```bash blocks, one command each."""
    blocks = re.findall(r"```bash\n(.*?)```", RUNBOOK.read_text(), flags=re.S)
    return [b.strip() for b in blocks]


def test_runbook_lists_a_call_per_open_gpu_stage():
    calls = _runbook_calls()
    assert len(calls) >= 10, calls
    assert all("\n" not in c for c in calls), "one line per call (a device call is one command line)"
    stages = {m for c in calls for m in re.findall(r"run_gpu\.sh --(\w+)", c)}
    assert stages == {"pdl", "w4a16", "w8a8", "engine", "kvcache"}, stages
    assert any("run_gpu.sh;" in c or c.endswith("run_gpu.sh") for c in calls), "the gate itself"
    assert any("calibration_gpu.py" in c for c in calls)
    bad = _undefined_flags(calls)
    assert not bad, f"the runbook passes flags the scripts do not define: {bad}"


@pytest.mark.parametrize("call", _runbook_calls(), ids=lambda c: re.sub(r"\W+", "-", c[-60:]).strip("-"))
def test_runbook_calls_dry_run(tmp_path, call):
    """Each call in the runbook, as written there, runs on the stub GPU machine: the device tool's 2,000 characters,
    exit 0, no unset variable or missing command, a python call made, and at most 8 files back from $OUT."""
    command = call.replace("<commit>", "abc1234")
    assert len(command) <= 2000, f"{len(command)} characters: a device call takes 2,000 at most"
    proc, calls, out = _dry_run(tmp_path, [], command=command)
    assert proc.returncode == 0, f"{call}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert "unbound variable" not in proc.stderr and "command not found" not in proc.stderr, proc.stderr
    assert calls, "the call ran no python"
    if out.exists():
        _assert_comes_back(out)
